"""The native DeepSeek-V3 target against transformers' `DeepseekV3ForCausalLM` (eager, fp32).

On 24 random configs (`tests.support.moe_models.random_deepseek_v3_configs`: MLA ranks and
head widths with and without a q LoRA, interleaved or NeoX RoPE, plain RoPE or YaRN with its
`mscale` correction, expert groups and kept groups, top-k, shared experts, dense first layers,
attention biases), weights re-drawn so routes are decisive and the correction bias matters
(`tests.support.moe_checkpoints.save_moe_target`), logits and features (layer-input taps = HF
`output_hidden_states[j]`, post-norm final hidden) equal HF's through a padded prefill of three
prompts (batch 3; MLA expanded), decode steps and verify passes with rejected drafts (MLA
absorbed) whose latent-cache rows the next pass re-writes
(`tests.support.native_parity.speculative_rounds`). Plus: both MLA paths forced on every
forward, the latent cache after rejections equal to a fresh prefill's, the cache layout (576
values per token per layer at V3's sizes), registration and config facts, greedy generation,
one graph with a fixed `attn_len`, one-line errors.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.families.deepseek_v3 import DeepseekV3ForCausalLM
from draftinfer.files.errors import ConfigError
from draftinfer.models.layers import SwiGLU
from draftinfer.models.mla import PATHS, LatentAttention
from draftinfer.models.moe import GroupedSigmoidRouter, MoEBlock
from draftinfer.registry import FAMILIES, FEATURES, family_spec
from tests.support.kind_factories import kinds_for_family
from tests.support.moe_checkpoints import save_moe_target
from tests.support.moe_models import MLA_YARN, deepseek_v3_config, random_deepseek_v3_configs
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

CONFIGS = random_deepseek_v3_configs(24)
MAX_SEQ_LEN = 64
LENGTHS = (19, 7, 12)  # the prefill (19 slots) expands MLA; decode and verify absorb it
YARN = MLA_YARN

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return save_moe_target(deepseek_v3_config(yarn=YARN), tmp_path_factory.mktemp("dsv3"))


native = partial(cpu_target, max_seq_len=MAX_SEQ_LEN)


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_speculative_rounds_match_transformers(index, tmp_path, record_property):
    # fp32: ~2e-7 measured; a wrong mscale, rope layout, correction bias, group limit or a
    # missing shared expert moves logits by 1e-2 and more on most of these configs.
    random_config_parity(
        CONFIGS[index], index, tmp_path, record_property, LENGTHS, logits_atol=1e-5
    )


@pytest.mark.parametrize("path", PATHS)
def test_each_mla_path_alone_matches_transformers(ds_dir, path):
    """Prefill, decode and verify all absorbed, or all expanded: the two computations are each
    HF's attention (not only where the shape picks them)."""
    model = native(ds_dir)
    for layer in model.model.layers:
        layer.self_attn.path = path
    diffs = speculative_rounds(model, hf_model(str(ds_dir)), LENGTHS, taps=(1, 2))
    print(f"{path}: max |logit diff| {diffs.logits:.2e}")
    diffs.check()


def test_latent_cache_after_rejections_equals_a_fresh_prefill(ds_dir):
    """A verify pass whose drafts are partly rejected, then the next pass from the committed
    length: the latent cache rows up to the new length equal those a single prefill of the
    committed sequence writes (the rejected rows were re-written, nothing stale is left)."""
    prompt, k = rand_ids(9, 1), 3
    spec = native(ds_dir, max_batch=2)
    t = lambda x: torch.tensor([x])  # noqa: E731
    spec(t(prompt), Slots(torch.tensor([1]), t(list(range(9)))))
    n = len(prompt)
    first = rand_ids(k + 1, 2)  # [bonus, d1, d2, d3]; d1 accepted, d2 rejected
    spec(t(first), Slots(torch.tensor([1]), t(list(range(n, n + k + 1)))))
    committed = prompt + first[:2]
    second = rand_ids(k + 1, 3)  # [recovered, e1, e2, e3] from the committed length
    m = len(committed)
    spec(t(second), Slots(torch.tensor([1]), t(list(range(m, m + k + 1)))))
    full = committed + second
    fresh = native(ds_dir, max_batch=1)
    fresh(t(full), Slots(torch.tensor([0]), t(list(range(len(full))))))
    for a, b in zip(spec.model.layers, fresh.model.layers):
        got = a.self_attn.latent_cache[1, : len(full)]
        want = b.self_attn.latent_cache[0, : len(full)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The rows the rejected drafts wrote were overwritten: they differ from the first pass'.
    assert not torch.allclose(
        spec.model.layers[0].self_attn.latent_cache[1, m : m + 2],
        native_latent_of(ds_dir, prompt + first)[m : m + 2],
    )


def native_latent_of(path, seq):
    model = native(path, max_batch=1)
    model(torch.tensor([seq]), Slots(torch.tensor([0]), torch.arange(len(seq))[None]))
    return model.model.layers[0].self_attn.latent_cache[0]


def test_cache_is_the_latent_576_values_per_token_at_v3_sizes():
    """DeepSeek-V3's own config (transformers' defaults): each layer caches kv_lora_rank +
    qk_rope_head_dim = 512 + 64 values per token, no expanded heads; the softmax scale carries
    YaRN's mscale^2 exactly as HF's attention computes it."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    hf = DeepseekV3Config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=163840,
    )
    cfg = DeepseekV3ForCausalLM.config_from_hf(hf, [1])
    assert cfg.head_dim == 64 and cfg.num_kv_heads == cfg.num_heads == 128
    assert cfg.softmax_scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 192**-0.5))
    assert cfg.softmax_scale == pytest.approx(
        192**-0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2
    )
    with torch.device("meta"):
        attn = DeepseekV3ForCausalLM.attention(cfg)
        attn.allocate_cache(2, 100, torch.bfloat16, torch.device("meta"))
    assert attn.latent_cache.shape == (2, 101, 576)
    assert not hasattr(attn, "k_cache")


def test_registered_and_config_facts(ds_dir):
    assert FAMILIES.native_class({"architectures": ["DeepseekV3ForCausalLM"]}) is (
        DeepseekV3ForCausalLM
    )
    assert FAMILIES.native_class({"model_type": "deepseek_v3"}) is DeepseekV3ForCausalLM
    spec = family_spec("deepseek_v3")
    assert spec.provides == FEATURES - {"dense_decoder_layer"} and not spec.requires
    assert kinds_for_family("deepseek_v3")
    model = native(ds_dir)
    c = model.config
    assert model.info.family == "deepseek_v3"
    assert model.info.architecture == "DeepseekV3ForCausalLM"
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.q_lora_rank) == (16, 8, 24)
    assert (c.num_experts, c.n_group, c.topk_group, c.top_k, c.first_k_dense_replace) == (
        8,
        4,
        2,
        2,
        1,
    )
    assert model.rotary.head_dim == 8 and c.rope_scaling["rope_type"] == "yarn"
    hf = hf_model(str(ds_dir))
    for j, layer in enumerate(model.model.layers):
        a = layer.self_attn
        assert isinstance(a, LatentAttention) and a.latent_cache.shape == (3, MAX_SEQ_LEN + 1, 24)
        assert a.scale == hf.model.layers[j].self_attn.scaling
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


def test_static_attn_len_and_greedy_generate(ds_dir):
    """The sync-free path (a fixed `attn_len`) gives the same rounds; greedy decoding equals HF
    `generate` token for token, batched and alone."""
    hf = hf_model(str(ds_dir))
    speculative_rounds(native(ds_dir), hf, LENGTHS, taps=(1,), attn_len=MAX_SEQ_LEN).check()
    assert_greedy_matches_hf(native, ds_dir, hf, 10)


def test_fixed_attn_len_forward_traces_as_one_graph(ds_dir):
    """With a fixed `attn_len` the whole forward (MLA both ways, the grouped router, the grouped
    expert products) traces as one graph: no host sync, no data-dependent shape. bf16."""
    assert_forward_traces_as_one_graph(
        native(ds_dir, max_batch=2, max_seq_len=32, dtype=torch.bfloat16)
    )


def test_bf16_target_keeps_the_router_in_fp32_and_follows_fp32(ds_dir):
    lo, hi = native(ds_dir, dtype=torch.bfloat16), native(ds_dir)
    gate = lo.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(
        gate.e_score_correction_bias, hi.model.layers[1].mlp.gate.e_score_correction_bias
    )
    assert lo.model.layers[1].self_attn.latent_cache.dtype == torch.bfloat16
    seq = torch.tensor([rand_ids(30, 4)])
    slots = Slots(torch.tensor([0]), torch.arange(30)[None])
    a, b = lo(seq, slots).logits, hi(seq, slots).logits
    assert torch.isfinite(a).all() and (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 != num_attention_heads 4"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization 'fp8'"),
        ({"topk_method": "greedy"}, "topk_method 'greedy'"),
        ({"n_shared_experts": 0}, "n_shared_experts 0"),
        ({"n_group": 3}, "do not split into 3 groups"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 for 2 kept groups"),
    ],
)
def test_unsupported_configs_are_one_line_config_errors(ds_dir, tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message) as e:
        native(edited_config(ds_dir, tmp_path / "t", **changes))
    assert "\n" not in str(e.value)


def test_serving_transforms_keep_parity(ds_dir):
    """The runner's CUDA defaults applied (fused gate/up of the dense and shared SwiGLUs, the
    skinny linear on every projection and router; no-ops in maths on the CPU): MLA layers are
    left as they are, and the rounds still equal transformers'."""
    from draftinfer.models.transforms import fuse_projections, use_skinny_gemm

    model = native(ds_dir)
    fuse_projections(model)
    use_skinny_gemm(model)
    assert type(model.model.layers[0].self_attn) is LatentAttention
    speculative_rounds(model, hf_model(str(ds_dir)), LENGTHS, taps=(1, 2)).check(1e-5)
