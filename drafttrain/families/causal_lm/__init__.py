"""The default family on the training side: any HF causal LM through `AutoModelForCausalLM`
(`drafttrain.target.frozen.FrozenTarget`) and text chat through its tokenizer's template."""

from __future__ import annotations

from drafttrain.registry import TrainFamily, register_train_family


class CausalLMTrainFamily(TrainFamily):
    name = "causal_lm"


register_train_family(CausalLMTrainFamily())
