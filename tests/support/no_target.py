"""Training that must not run the target (a feature cache, runner-emitted samples): its forward,
in every form, raises."""

from __future__ import annotations

from drafttrain.frozen.target import FrozenTarget


def forbid_target_forward(monkeypatch) -> None:
    """From here on, running the target in any form raises: its interface call, the HF
    model, its decoder layers."""
    from transformers.models.llama import modeling_llama

    def boom(*_a, **_k):
        raise AssertionError("the target forward ran during cached training")

    monkeypatch.setattr(FrozenTarget, "forward", boom)
    monkeypatch.setattr(FrozenTarget, "__call__", boom)
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", boom)
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", boom)
