"""The default target family: text causal LMs. The runner serves Llama 2/3, Qwen2 and Qwen3
natively (`models.py`); training takes any HF causal LM. Prompts render through the
tokenizer's chat template."""

from __future__ import annotations

from draftinfer.families.causal_lm.models import (
    FAMILY,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from draftinfer.models.tensor_parallel import parallelize_dense
from draftinfer.registry import FamilySpec, register_family


class CausalLMFamily(FamilySpec):
    name = FAMILY
    models = {
        "LlamaForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
    }
    # Heads and the dense MLP split over the group; embedding and head replicated.
    tensor_parallel = staticmethod(parallelize_dense)


register_family(CausalLMFamily())

__all__ = ["CausalLMFamily", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
