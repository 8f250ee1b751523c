"""The default family on the training side: any HF causal LM through `AutoModelForCausalLM`
(`drafttrain.target.FrozenTarget`) and text chat through its tokenizer's template."""

from __future__ import annotations

from drafttrain.families import TrainFamily, register_train_family


class CausalLMTrainFamily(TrainFamily):
    name = "causal_lm"


register_train_family(CausalLMTrainFamily())
