"""The native GLM-4.5/4.6 target against transformers' `Glm4MoeForCausalLM` (eager, fp32).

On 24 random configs (`tests.support.moe_models.random_glm4_moe_configs`: head groups,
`head_dim` given or `hidden / heads`, partial rotary of a half, a quarter or the whole head, q/k
norm on and off, q/k/v biases on and off, plain RoPE or YaRN, expert groups and kept groups,
top-k, shared experts, 0 to L-1 dense first layers), weights re-drawn so routes are decisive and
the correction bias matters (`tests.support.moe_checkpoints.save_moe_target`), logits and
features (layer-input taps = HF `output_hidden_states[j]`, the post-norm final hidden) equal
HF's through a padded prefill of three prompts (batch 3), decode steps and verify passes with
rejected drafts whose cache rows the next pass re-writes
(`tests.support.native_parity.speculative_rounds`). Plus: each GLM piece (partial rotary, q/k
norm, the correction bias, the shared experts) moves the logits when dropped, so the parity
above can fail; the partial-rotary rule itself; registration and config facts at GLM-4.5's
sizes; greedy generation; one graph with a fixed `attn_len`; bf16; one-line errors.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from draftinfer.families.glm4_moe import Glm4MoeForCausalLM
from draftinfer.files.errors import ConfigError
from draftinfer.models.decoder import CachedAttention
from draftinfer.models.layers import SwiGLU
from draftinfer.models.moe import GroupedSigmoidRouter, MoEBlock
from draftinfer.models.rope import apply_rope
from draftinfer.registry import FAMILIES, FEATURES, family_spec
from tests.support.kind_factories import kinds_for_family
from tests.support.moe_checkpoints import save_moe_target
from tests.support.moe_models import glm4_moe_config, random_glm4_moe_configs
from tests.support.native_parity import (
    assert_forward_traces_as_one_graph,
    assert_greedy_matches_hf,
    cpu_target,
    edited_config,
    hf_model,
    rand_ids,
    random_config_parity,
    speculative_rounds,
)

CONFIGS = random_glm4_moe_configs(24)
MAX_SEQ_LEN = 64
LENGTHS = (19, 7, 12)
YARN = {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return save_moe_target(glm4_moe_config(yarn=YARN), tmp_path_factory.mktemp("glm4_moe"))


native = partial(cpu_target, max_seq_len=MAX_SEQ_LEN)


def test_the_random_configs_cover_each_setting():
    rot = {c.rope_parameters["partial_rotary_factor"] for c in CONFIGS}
    assert rot == {0.25, 0.5, 1.0}
    assert {c.use_qk_norm for c in CONFIGS} == {True, False}
    assert {c.attention_bias for c in CONFIGS} == {True, False}
    assert {c.n_group for c in CONFIGS} == {1, 2, 4}
    assert {c.first_k_dense_replace for c in CONFIGS} >= {0, 1, 2}
    assert {c.rope_parameters["rope_type"] for c in CONFIGS} == {"default", "yarn"}
    assert any(c.num_key_value_heads < c.num_attention_heads for c in CONFIGS)


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_speculative_rounds_match_transformers(index, tmp_path, record_property):
    # fp32: ~3e-7 measured. Checked by hand: rotating the whole head fails the 15 partial-
    # rotary configs, dropping the q/k norm the 15 that have it (test_each_glm_piece_matters
    # keeps one such check per piece in the suite).
    random_config_parity(
        CONFIGS[index], index, tmp_path, record_property, LENGTHS, logits_atol=1e-5
    )


def _without(model, piece: str):
    """A copy of native `model` with one GLM piece dropped (same weights otherwise)."""
    cfg = model.config
    if piece == "partial_rotary":  # RoPE over the whole head
        cfg = replace(cfg, rotary_dim=None)
    elif piece == "qk_norm":
        cfg = replace(cfg, qk_norm=False)
    broken = Glm4MoeForCausalLM(cfg)
    broken.load_state_dict(model.state_dict(), strict=False)
    for layer in broken.model.layers:
        if piece == "correction_bias" and isinstance(layer.mlp, MoEBlock):
            layer.mlp.gate.e_score_correction_bias.data.zero_()
        if piece == "shared_experts" and isinstance(layer.mlp, MoEBlock):
            layer.mlp.shared_experts = None
    broken.setup_caches(model.max_batch, model.max_seq_len)
    return broken


@pytest.mark.parametrize(
    "piece", ["partial_rotary", "qk_norm", "correction_bias", "shared_experts"]
)
def test_each_glm_piece_matters(glm_dir, piece):
    """The parity above is not vacuous: the same weights without one piece of GLM's layer move
    the logits far past the tolerance (while the intact model is within it)."""
    model = native(glm_dir)
    hf = hf_model(str(glm_dir))
    speculative_rounds(model, hf, LENGTHS, taps=(1,)).check(1e-5)
    diffs = speculative_rounds(_without(model, piece), hf, LENGTHS, taps=(1,))
    print(f"without {piece}: max |logit diff| {diffs.logits:.2e}")
    assert diffs.logits > 1e-3


def test_partial_rotary_rotates_the_leading_slice_only():
    """`apply_rope` with a table narrower than the head: HF's `apply_rotary_pos_emb` (NeoX halves
    inside the first R dimensions), the other D - R passed through bit for bit."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 3, 16, generator=g), torch.randn(2, 5, 1, 16, generator=g)
    angle = torch.randn(2, 5, 3, generator=g)
    emb = torch.cat([angle, angle], -1)  # [B, T, R = 6]
    cos, sin = emb.cos(), emb.sin()
    ours_q, ours_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    torch.testing.assert_close(ours_q, want_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_k, want_k, rtol=0, atol=1e-6)
    assert torch.equal(ours_q[..., 6:], q[..., 6:]) and not torch.equal(ours_q[..., :6], q[..., :6])
    with pytest.raises(ValueError, match="rotary of 32 dimensions for heads of 16"):
        apply_rope(q, torch.ones(2, 5, 32), torch.zeros(2, 5, 32))


def test_glm_4_5_sizes():
    """GLM-4.5's own shape (hidden 5120, 96 heads of 128, 8 KV heads: head_dim is not hidden /
    heads): half of each head rotates, the q/k norm follows `use_qk_norm`, biases on q/k/v only,
    GLM-4.5's routing fields."""
    from transformers import Glm4MoeConfig

    hf = Glm4MoeConfig(
        hidden_size=5120,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=92,
        n_routed_experts=160,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        attention_bias=True,
        use_qk_norm=True,
    )
    cfg = Glm4MoeForCausalLM.config_from_hf(hf, [1])
    assert (cfg.head_dim, cfg.rotary_dim, cfg.num_kv_heads) == (128, 64, 8)
    assert cfg.qk_norm and cfg.qkv_bias and not cfg.o_bias
    assert (cfg.num_experts, cfg.top_k, cfg.first_k_dense_replace) == (160, 8, 3)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (1, 1, 2.5)
    assert not Glm4MoeForCausalLM.config_from_hf(
        Glm4MoeConfig(hidden_size=64, num_attention_heads=4, use_qk_norm=False), [1]
    ).qk_norm


def test_registered_and_config_facts(glm_dir):
    assert FAMILIES.native_class({"architectures": ["Glm4MoeForCausalLM"]}) is Glm4MoeForCausalLM
    assert FAMILIES.native_class({"model_type": "glm4_moe"}) is Glm4MoeForCausalLM
    spec = family_spec("glm4_moe")
    assert spec.provides == {"layer_inputs", "final_hidden", "drafter_block"} <= FEATURES
    assert spec.released_mtp["count_key"] == "num_nextn_predict_layers"
    assert not spec.requires
    assert kinds_for_family("glm4_moe")
    model = native(glm_dir)
    c = model.config
    assert model.info.family == "glm4_moe" and model.info.architecture == "Glm4MoeForCausalLM"
    assert (c.head_dim, c.rotary_dim, c.qk_norm) == (16, 8, True)
    assert model.rotary.head_dim == 8 and c.rope_scaling["rope_type"] == "yarn"
    assert (c.num_experts, c.n_group, c.topk_group, c.top_k, c.first_k_dense_replace) == (
        8,
        4,
        2,
        2,
        1,
    )
    hf = hf_model(str(glm_dir))
    for j, layer in enumerate(model.model.layers):
        a = layer.self_attn
        assert isinstance(a, CachedAttention) and a.q_norm is not None
        assert a.q_proj.bias is not None and a.o_proj.bias is None
        if j < 1:
            assert isinstance(layer.mlp, SwiGLU)
        else:
            assert isinstance(layer.mlp, MoEBlock)
            assert isinstance(layer.mlp.gate, GroupedSigmoidRouter)
            assert isinstance(layer.mlp.shared_experts, SwiGLU)
            assert layer.mlp.experts.gate_up_proj.shape == (8, 32, 64)  # [E, 2I, H]
    ours = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())
    theirs.update((n, b) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    for name, p in theirs.items():  # every HF weight (and the bias buffer), under its HF name
        assert torch.equal(ours[name], p), name
    assert len(ours) == len(theirs)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0


def test_static_attn_len_and_greedy_generate(glm_dir):
    """The sync-free path (a fixed `attn_len`) gives the same rounds; greedy decoding equals HF
    `generate` token for token, batched and alone."""
    hf = hf_model(str(glm_dir))
    speculative_rounds(native(glm_dir), hf, LENGTHS, taps=(1,), attn_len=MAX_SEQ_LEN).check(1e-5)
    assert_greedy_matches_hf(native, glm_dir, hf, 10)


def test_fixed_attn_len_forward_traces_as_one_graph(glm_dir):
    """With a fixed `attn_len` the whole forward (partial rotary, the grouped router, the grouped
    expert products) traces as one graph: no host sync, no data-dependent shape. bf16."""
    assert_forward_traces_as_one_graph(
        native(glm_dir, max_batch=2, max_seq_len=32, dtype=torch.bfloat16)
    )


def test_bf16_target_keeps_the_router_in_fp32_and_follows_fp32(glm_dir):
    from draftinfer.conventions.slots import Slots

    lo, hi = native(glm_dir, dtype=torch.bfloat16), native(glm_dir)
    gate = lo.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert lo.model.layers[1].self_attn.k_cache.dtype == torch.bfloat16
    seq = torch.tensor([rand_ids(30, 4)])
    slots = Slots(torch.tensor([0]), torch.arange(30)[None])
    a, b = lo(seq, slots).logits, hi(seq, slots).logits
    assert torch.isfinite(a).all() and (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_serving_transforms_keep_parity(glm_dir):
    """The runner's CUDA defaults applied (fused q/k/v and gate/up, the skinny linear on every
    projection and router; no-ops in maths on the CPU): the rounds still equal transformers'."""
    from draftinfer.models.transforms import fuse_projections, use_skinny_gemm

    model = native(glm_dir)
    fuse_projections(model)
    use_skinny_gemm(model)
    speculative_rounds(model, hf_model(str(glm_dir)), LENGTHS, taps=(1, 2)).check(1e-5)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization 'fp8'"),
        ({"n_shared_experts": 0}, "n_shared_experts 0"),
        ({"n_group": 3}, "do not split into 3 groups"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 for 2 kept groups"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.1875}},
            "gives 3 rotary dimensions",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_configs_are_one_line_config_errors(glm_dir, tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message) as e:
        native(edited_config(glm_dir, tmp_path / "t", **changes))
    assert "\n" not in str(e.value)


def test_partial_rotary_is_refused_where_the_attention_rotates_whole_heads():
    """The knob is a family's to take (`NativeCausalLM.partial_rotary`): a dense target whose
    config asks for partial rotary is a one-line error, not a silently whole-head RoPE."""
    from transformers import LlamaConfig

    from draftinfer.families.causal_lm import LlamaForCausalLM

    hf = LlamaConfig(hidden_size=64, num_attention_heads=4)
    hf.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(ConfigError, match="partial_rotary_factor 0.5 is not supported") as e:
        LlamaForCausalLM.config_from_hf(hf, [1])
    assert "\n" not in str(e.value)


def test_the_released_mtp_layer_is_skipped(glm_dir, tmp_path):
    """GLM-4.5's files carry the MTP layer at `model.layers.{L}` (`num_nextn_predict_layers`):
    the target loads without it, logits unchanged; the same tensors with no
    `num_nextn_predict_layers` are unknown tensors (the count is what skips them)."""
    from draftinfer.conventions.slots import Slots
    from draftinfer.files.errors import CheckpointError
    from tests.support.moe_checkpoints import with_released_mtp_layer

    stitched = with_released_mtp_layer(glm_dir, tmp_path / "mtp")
    seq = torch.tensor([rand_ids(12, 5)])
    slots = Slots(torch.tensor([0]), torch.arange(12)[None])
    want = native(glm_dir)(seq, slots).logits
    assert torch.equal(native(stitched)(seq, slots).logits, want)
    with pytest.raises(CheckpointError, match="does not use: model.layers.3"):
        native(edited_config(stitched, tmp_path / "unmarked", num_nextn_predict_layers=0))
