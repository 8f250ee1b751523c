"""The native GLM-4.7-Flash target against transformers' `Glm4MoeLiteForCausalLM` (eager, fp32).

On 24 random configs (`tests.support.moe_models.random_glm4_moe_lite_configs`: MLA ranks and
head widths with and without a q LoRA, interleaved or NeoX RoPE, plain RoPE or YaRN with its
`mscale` correction, expert groups and kept groups, top-k, shared experts, 0 to L-1 dense
layers first in `mlp_layer_types`, attention biases; GLM's `rms_norm_eps` 1e-5, which the latent
norms do not use), weights re-drawn so routes are decisive and the correction bias matters
(`tests.support.moe_checkpoints.save_moe_target`), logits and features (layer-input taps = HF
`output_hidden_states[j]`, the post-norm final hidden) equal HF's through a padded prefill of
three prompts (batch 3; MLA expanded), decode steps and verify passes with rejected drafts (MLA
absorbed) whose latent-cache rows the next pass re-writes
(`tests.support.native_parity.speculative_rounds`). Plus: both MLA paths forced, each piece
matters, the cache layout at GLM-4.7-Flash's sizes (576 values per token per layer),
registration and config facts, greedy generation, one graph with a fixed `attn_len`, one-line
errors.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from draftinfer.families.glm4_moe_lite import Glm4MoeLiteForCausalLM
from draftinfer.files.errors import ConfigError
from draftinfer.models.layers import SwiGLU
from draftinfer.models.mla import PATHS, LatentAttention
from draftinfer.models.moe import GroupedSigmoidRouter, MoEBlock
from draftinfer.registry import FAMILIES, FEATURES, family_spec
from tests.support.kind_factories import kinds_for_family
from tests.support.moe_checkpoints import save_moe_target
from tests.support.moe_models import MLA_YARN, glm4_moe_lite_config, random_glm4_moe_lite_configs
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

CONFIGS = random_glm4_moe_lite_configs(24)
MAX_SEQ_LEN = 64
LENGTHS = (19, 7, 12)  # the prefill (19 slots) expands MLA; decode and verify absorb it
YARN = MLA_YARN

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lite_dir(tmp_path_factory):
    cfg = glm4_moe_lite_config(yarn=YARN, dense_layers=1)
    return save_moe_target(cfg, tmp_path_factory.mktemp("glm4_moe_lite"))


native = partial(cpu_target, max_seq_len=MAX_SEQ_LEN)


def test_the_random_configs_cover_each_setting():
    assert {c.q_lora_rank is None for c in CONFIGS} == {True, False}
    assert {c.rope_interleave for c in CONFIGS} == {True, False}
    assert {c.rope_parameters["rope_type"] for c in CONFIGS} == {"default", "yarn"}
    assert {c.n_group for c in CONFIGS} == {1, 2, 4}
    assert {c.mlp_layer_types.count("dense") for c in CONFIGS} >= {0, 1, 2}
    assert {c.rms_norm_eps for c in CONFIGS} == {1e-5}


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_speculative_rounds_match_transformers(index, tmp_path, record_property):
    # fp32: ~2e-7 measured. Checked by hand: the latent norms at the config's rms_norm_eps
    # (1e-5) instead of HF's 1e-6 fail 15 of the 24 configs, the RoPE layout flipped all 24;
    # test_each_piece_matters keeps one check per piece in the suite.
    random_config_parity(
        CONFIGS[index], index, tmp_path, record_property, LENGTHS, logits_atol=1e-5
    )


@pytest.mark.parametrize("path", PATHS)
def test_each_mla_path_alone_matches_transformers(lite_dir, path):
    model = native(lite_dir)
    for layer in model.model.layers:
        layer.self_attn.path = path
    diffs = speculative_rounds(model, hf_model(str(lite_dir)), LENGTHS, taps=(1, 2))
    print(f"{path}: max |logit diff| {diffs.logits:.2e}")
    diffs.check(1e-5)


@pytest.mark.parametrize("piece", ["rope_interleave", "correction_bias", "shared_experts"])
def test_each_piece_matters(lite_dir, piece):
    """The parity above is not vacuous: the same weights without one piece move the logits
    far past the tolerance."""
    model = native(lite_dir)
    for layer in model.model.layers:
        if piece == "rope_interleave":
            layer.self_attn.rope_interleave = False
        if isinstance(layer.mlp, MoEBlock):
            if piece == "correction_bias":
                layer.mlp.gate.e_score_correction_bias.data.zero_()
            if piece == "shared_experts":
                layer.mlp.shared_experts = None
    diffs = speculative_rounds(model, hf_model(str(lite_dir)), LENGTHS, taps=(1,))
    print(f"without {piece}: max |logit diff| {diffs.logits:.2e}")
    assert diffs.logits > 1e-3


def test_cache_is_the_latent_576_values_per_token_at_flash_sizes():
    """GLM-4.7-Flash's own config (transformers' defaults: 20 heads, q LoRA 768, latent 512 +
    rope 64, v 256, 64 experts top-4, routed scale 1.8, first layer dense): each layer caches
    512 + 64 values per token, no expanded heads."""
    from transformers import Glm4MoeLiteConfig

    hf = Glm4MoeLiteConfig()
    cfg = Glm4MoeLiteForCausalLM.config_from_hf(hf, [1])
    assert cfg.head_dim == 64 and cfg.num_kv_heads == cfg.num_heads == 20
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim) == (768, 512, 256)
    assert (cfg.num_experts, cfg.top_k, cfg.routed_scaling_factor) == (64, 4, 1.8)
    assert cfg.first_k_dense_replace == 1 and cfg.rotary_dim is None
    assert cfg.softmax_scale == pytest.approx(256**-0.5)  # (192 + 64)^-0.5, no YaRN
    with torch.device("meta"):
        attn = Glm4MoeLiteForCausalLM.attention(cfg)
        attn.allocate_cache(2, 100, torch.bfloat16, torch.device("meta"))
    assert attn.latent_cache.shape == (2, 101, 576)
    assert not hasattr(attn, "k_cache")


def test_registered_and_config_facts(lite_dir):
    assert FAMILIES.native_class({"architectures": ["Glm4MoeLiteForCausalLM"]}) is (
        Glm4MoeLiteForCausalLM
    )
    assert FAMILIES.native_class({"model_type": "glm4_moe_lite"}) is Glm4MoeLiteForCausalLM
    spec = family_spec("glm4_moe_lite")
    assert spec.provides == {"layer_inputs", "final_hidden", "drafter_block"} <= FEATURES
    assert spec.released_mtp["count_key"] == "num_nextn_predict_layers"
    assert not spec.requires
    assert kinds_for_family("glm4_moe_lite")
    model = native(lite_dir)
    c = model.config
    assert model.info.family == "glm4_moe_lite"
    assert model.info.architecture == "Glm4MoeLiteForCausalLM"
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.q_lora_rank) == (16, 8, 24)
    assert (c.num_experts, c.n_group, c.topk_group, c.top_k, c.first_k_dense_replace) == (
        8,
        4,
        2,
        2,
        1,
    )
    hf = hf_model(str(lite_dir))
    for j, layer in enumerate(model.model.layers):
        a, theirs = layer.self_attn, hf.model.layers[j].self_attn
        assert isinstance(a, LatentAttention) and a.latent_cache.shape == (3, MAX_SEQ_LEN + 1, 24)
        assert a.scale == theirs.scaling
        assert a.kv_a_layernorm.eps == theirs.kv_a_layernorm.variance_epsilon == 1e-6
        assert layer.input_layernorm.eps == c.rms_norm_eps == 1e-5
        if j < 1:
            assert isinstance(layer.mlp, SwiGLU)
        else:
            assert isinstance(layer.mlp, MoEBlock)
            assert isinstance(layer.mlp.gate, GroupedSigmoidRouter)
            assert isinstance(layer.mlp.shared_experts, SwiGLU)
    ours = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())
    theirs.update((n, b) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    for name, p in theirs.items():
        assert torch.equal(ours[name], p), name
    assert len(ours) == len(theirs)


def test_static_attn_len_and_greedy_generate(lite_dir):
    hf = hf_model(str(lite_dir))
    speculative_rounds(native(lite_dir), hf, LENGTHS, taps=(1,), attn_len=MAX_SEQ_LEN).check(1e-5)
    assert_greedy_matches_hf(native, lite_dir, hf, 10)


def test_fixed_attn_len_forward_traces_as_one_graph(lite_dir):
    assert_forward_traces_as_one_graph(
        native(lite_dir, max_batch=2, max_seq_len=32, dtype=torch.bfloat16)
    )


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "mlp_layer_types"),
        ({"mlp_layer_types": ["dense", "sparse"]}, "only 3 entries"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor 0.5 is not supported",
        ),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 != num_attention_heads 4"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization 'fp8'"),
        ({"n_shared_experts": 0}, "n_shared_experts 0"),
        ({"n_group": 3}, "do not split into 3 groups"),
    ],
)
def test_unsupported_configs_are_one_line_config_errors(lite_dir, tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message) as e:
        native(edited_config(lite_dir, tmp_path / "t", **changes))
    assert "\n" not in str(e.value) and "Glm4MoeLiteForCausalLM" in str(e.value)


def test_the_released_mtp_layer_is_skipped(lite_dir, tmp_path):
    """GLM-4.7-Flash's files carry the MTP layer at `model.layers.{L}` (47 released;
    `num_nextn_predict_layers`): the target loads without it, logits unchanged; unmarked, the
    same tensors are unknown ones."""
    from draftinfer.conventions.slots import Slots
    from draftinfer.files.errors import CheckpointError
    from tests.support.moe_checkpoints import with_released_mtp_layer

    stitched = with_released_mtp_layer(lite_dir, tmp_path / "mtp")
    seq = torch.tensor([rand_ids(12, 5)])
    slots = Slots(torch.tensor([0]), torch.arange(12)[None])
    want = native(lite_dir)(seq, slots).logits
    assert torch.equal(native(stitched)(seq, slots).logits, want)
    with pytest.raises(CheckpointError, match="does not use: model.layers.3"):
        native(edited_config(stitched, tmp_path / "unmarked", num_nextn_predict_layers=0))
