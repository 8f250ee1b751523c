"""The default family on the training side: any HF causal LM through `AutoModelForCausalLM`
(`drafttrain.frozen.target.FrozenTarget`) and text chat through its tokenizer's template.
Text families of their own (new architectures with a native runner model) subclass it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from drafttrain.registry import TrainFamily, register_train_family

if TYPE_CHECKING:  # annotations only
    import torch

    from drafttrain.jobs.config import TargetConfig


class CausalLMTrainFamily(TrainFamily):
    name = "causal_lm"

    def target(self, cfg: TargetConfig, device: torch.device):
        from drafttrain.frozen.target import FrozenTarget

        return FrozenTarget(self.target_config(cfg), device)

    def data(self, target_name: str, tokenizer):
        from drafttrain.data.batching import ChatData

        return ChatData(tokenizer)


register_train_family(CausalLMTrainFamily())
