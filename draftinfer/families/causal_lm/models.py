"""Native text decoders of the `causal_lm` family: Llama 2/3, Qwen2, Qwen3. Each only says how
its HF config maps onto the shared decoder (`draftinfer.models.decoder.NativeCausalLM`)."""

from __future__ import annotations

from draftinfer.models.decoder import NativeCausalLM

FAMILY = "causal_lm"


class LlamaForCausalLM(NativeCausalLM):
    """Llama 2 / 3 / 3.1 (llama3 RoPE scaling), untied or tied head, optional biases."""

    hf_model_types = ("llama",)
    family = FAMILY


class Qwen2ForCausalLM(NativeCausalLM):
    """Qwen2 / Qwen2.5: bias on q/k/v (always), none on o_proj or the MLP."""

    hf_model_types = ("qwen2",)
    family = FAMILY

    @classmethod
    def block_flags(cls, attention_bias: bool, mlp_bias: bool) -> tuple[bool, bool, bool, bool]:
        return True, False, False, False


class Qwen3ForCausalLM(NativeCausalLM):
    """Qwen3 (dense): per-head RMSNorm on q and k before RoPE; `attention_bias` on all four
    projections when set; usually a tied head."""

    hf_model_types = ("qwen3",)
    family = FAMILY

    @classmethod
    def block_flags(cls, attention_bias: bool, mlp_bias: bool) -> tuple[bool, bool, bool, bool]:
        return attention_bias, attention_bias, False, True
