"""RoPE against transformers' implementations: plain/llama3/yarn inverse frequencies, interleaved
M-RoPE cos/sin by value against `Qwen3VLTextRotaryEmbedding`, strict rope parsing."""

from __future__ import annotations

import pytest
import torch

from draftinfer.conventions.positions import draft_step_positions
from draftinfer.files.errors import ConfigError
from draftinfer.models.rope import RotaryEmbedding, parse_rope, rope_from_hf, rope_inv_freq
from tests.support.tiny_models import llama3_config, qwen3_config


@pytest.mark.parametrize("make", [llama3_config, qwen3_config])
def test_rope_matches_hf(make):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = make()
    theta, scaling = rope_from_hf(cfg)
    ours = rope_inv_freq(cfg.head_dim, theta, scaling)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        ref = 1.0 / (theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def qwen3_vl_text_config(section=(4, 2, 2)):
    from transformers import Qwen3VLTextConfig

    return Qwen3VLTextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000.0,
            "mrope_section": list(section),
            "mrope_interleaved": True,
        },
    )


def test_interleaved_mrope_matches_transformers_qwen3_vl():
    """head_dim 16 with mrope_section [4, 2, 2]: all three rows get frequencies, so a wrong
    interleave (or a dropped `mrope_section`) changes the values."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    cfg = qwen3_vl_text_config()
    theta, scaling = rope_from_hf(cfg)
    assert scaling["mrope_section"] == [4, 2, 2]
    ours = RotaryEmbedding(16, theta, scaling)
    ref = Qwen3VLTextRotaryEmbedding(cfg)
    torch.manual_seed(0)
    pos = torch.randint(0, 300, (3, 2, 17))  # [3, B, N], three different rows
    cos_r, sin_r = ref(torch.zeros(2, 17, 16), pos)
    cos, sin = ours(pos)
    assert cos.shape == (2, 17, 16)
    torch.testing.assert_close(cos, cos_r.float(), rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_r.float(), rtol=0, atol=0)
    # Equal axes (text tokens) reduce to plain RoPE.
    plain = RotaryEmbedding(16, theta, None)
    same = torch.arange(9)[None].expand(3, 1, 9)
    torch.testing.assert_close(ours(same)[0], plain(same[0])[0], rtol=0, atol=0)
    # The H and W rows really matter: move one of them and cos changes.
    moved = pos.clone()
    moved[1] += 1
    assert not torch.allclose(ours(moved)[0], cos)


YARN_CASES = [
    # gpt-oss: no floor/ceil of the ramp's ends.
    {"factor": 32.0, "original_max_position_embeddings": 4096, "truncate": False},
    {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0, "beta_slow": 2.0},
    {"factor": 8.0, "original_max_position_embeddings": 256, "attention_factor": 1.25},
    {
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.7,
    },
]


@pytest.mark.parametrize("yarn", YARN_CASES)
def test_yarn_matches_transformers(yarn):
    """YaRN inverse frequencies bit for bit, and cos/sin (the attention factor on both) by value,
    against transformers' `_compute_yarn_parameters` and a rotary that applies it."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **yarn},
    )
    theta, scaling = rope_from_hf(cfg)
    assert scaling["rope_type"] == "yarn"
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = RotaryEmbedding(16, theta, scaling)
    assert torch.equal(ours.inv_freq, ref_inv.float())
    assert ours.attention_factor == pytest.approx(ref_factor, rel=1e-15) and ref_factor != 1.0
    pos = torch.arange(0, 9000, 37)[None]
    cos_r, sin_r = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = ours(pos)
    torch.testing.assert_close(cos, cos_r, rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_r, rtol=0, atol=0)


def test_mrope_needs_three_rows():
    cfg = qwen3_vl_text_config()
    rot = RotaryEmbedding(16, *rope_from_hf(cfg))
    with pytest.raises(ValueError, match=r"M-RoPE positions must be \[3, ..., N\]"):
        rot(torch.arange(5)[None])


@pytest.mark.parametrize(
    "params, message",
    [
        ({"rope_type": "yarnish"}, "unsupported rope_type 'yarnish'"),
        ({"rope_type": "yarn", "factor": 4.0}, "needs 'original_max_position_embeddings'"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "x": 1},
            "unknown rope key 'x'",
        ),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 32}, "unknown rope key 'beta_fast'"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "unknown rope key"),
        ({"rope_type": "llama3", "factor": 8.0}, "needs 'high_freq_factor'"),
        ({"rope_type": "default", "mrope_section": [4, 2, 1]}, "must have 3 entries summing"),
        (
            {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": False},
            "chunked M-RoPE",
        ),
    ],
)
def test_unknown_rope_keys_are_one_line_errors(params, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_rope(params, 16, "cfg")
    assert "\n" not in str(e.value)


def test_unknown_rope_key_in_a_target_config_is_an_error():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0, "mystery": 1},
    )
    cfg.rope_parameters = {"rope_type": "linear", "factor": 2.0, "mystery": 1, "rope_theta": 1e4}
    with pytest.raises(ConfigError, match="unknown rope key 'mystery'"):
        rope_from_hf(cfg)


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
