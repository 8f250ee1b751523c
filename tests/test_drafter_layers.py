"""RoPE and drafter building blocks against transformers' implementations."""

from __future__ import annotations

import pytest
import torch

from draftinfer.drafters.layers import RotaryEmbedding, rope_inv_freq, rope_params_from_hf
from draftinfer.positions import draft_step_positions
from tests.tiny_models import llama3_config, qwen3_config


@pytest.mark.parametrize("make", [llama3_config, qwen3_config])
def test_rope_matches_hf(make):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = make()
    theta, scaling = rope_params_from_hf(cfg)
    ours = rope_inv_freq(cfg.head_dim, theta, scaling)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        ref = 1.0 / (theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def test_rope_rejects_unknown_type():
    with pytest.raises(ValueError, match="unsupported rope_type 'yarnish'"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarnish"})


def test_positions_are_tensors_and_never_mutated():
    base = torch.tensor([[0, 1, 2, 5]])
    out = draft_step_positions(base, 3)
    assert torch.equal(out, torch.tensor([[3, 4, 5, 8]]))
    assert torch.equal(base, torch.tensor([[0, 1, 2, 5]]))
    mrope = torch.arange(12).view(3, 4)
    assert torch.equal(draft_step_positions(mrope, 2), mrope + 2)
    rot = RotaryEmbedding(8, 10000.0)
    cos, _ = rot(mrope)
    assert cos.shape == (3, 4, 8)
    with pytest.raises(ValueError):
        draft_step_positions(base, -1)
