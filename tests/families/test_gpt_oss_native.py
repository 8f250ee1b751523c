"""The native gpt-oss target against transformers' `GptOssForCausalLM` (eager attention, fp32).

On 20 random configs (`tests.support.moe_models.random_gpt_oss_configs`: layer counts, head
groups, experts and top-k, windows from 2 keys up, YaRN factors), with weights re-drawn so
sinks, biases, clamps and routes matter (`tests.support.moe_checkpoints.save_moe_target`),
logits and features (layer-input taps = HF `output_hidden_states[j]`, post-norm final hidden)
equal HF's through a padded prefill of prompts past, at and one past the window, decode steps,
and verify passes with rejected drafts whose cache rows the next pass re-writes
(`tests.support.native_parity.speculative_rounds`). Plus the family's registration and config
facts, the static `attn_len` path, greedy generation, the bf16 norm and one-line errors. MXFP4
checkpoints: `test_mxfp4.py`.
"""

from __future__ import annotations

import shutil
from functools import partial

import pytest
import torch

from draftinfer.families.gpt_oss import GptOssForCausalLM
from draftinfer.files.errors import CheckpointError, ConfigError
from draftinfer.models.layers import RMSNorm
from draftinfer.models.moe import ClampedSwiGLU, MoEBlock, TopKSoftmaxRouter
from draftinfer.registry import FAMILIES, FEATURES, family_spec
from tests.support.kind_factories import kinds_for_family
from tests.support.moe_checkpoints import save_moe_target
from tests.support.moe_models import gpt_oss_config, random_gpt_oss_configs
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

CONFIGS = random_gpt_oss_configs(20)
MAX_SEQ_LEN = 64


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return save_moe_target(gpt_oss_config(), tmp_path_factory.mktemp("gpt_oss"))


native = partial(cpu_target, max_seq_len=MAX_SEQ_LEN)


def prompt_lengths(window: int) -> tuple[int, int, int]:
    """Past the window (twice over), at it, one past it."""
    return 2 * window + 3, window, window + 1


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_speculative_rounds_match_transformers(index, tmp_path, record_property):
    cfg = CONFIGS[index]
    random_config_parity(cfg, index, tmp_path, record_property, prompt_lengths(cfg.sliding_window))


def test_registered_and_config_facts(gpt_oss_dir):
    assert FAMILIES.native_class({"architectures": ["GptOssForCausalLM"]}) is GptOssForCausalLM
    assert FAMILIES.native_class({"model_type": "gpt_oss"}) is GptOssForCausalLM
    spec = family_spec("gpt_oss")
    assert spec.provides == FEATURES - {"dense_decoder_layer", "drafter_block"}
    assert not spec.requires
    assert kinds_for_family("gpt_oss")  # drafter kinds pair with it
    model = native(gpt_oss_dir)
    c = model.config
    assert model.info.family == "gpt_oss" and model.info.architecture == "GptOssForCausalLM"
    assert c.layer_windows == (8, None, 8, None) and (c.num_experts, c.top_k) == (4, 2)
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["truncate"] is False
    assert model.rotary.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)) + 1)
    for j, layer in enumerate(model.model.layers):
        a = layer.self_attn
        assert a.window == c.layer_windows[j] and a.sinks.shape == (4,)
        assert a.q_proj.bias is not None and a.o_proj.bias is not None and a.q_norm is None
        assert isinstance(layer.mlp, MoEBlock) and isinstance(layer.mlp.router, TopKSoftmaxRouter)
        assert isinstance(layer.mlp.experts.act, ClampedSwiGLU)
        assert layer.mlp.experts.gate_up_proj.shape == (4, 64, 64)  # [E, H, 2I]
        assert layer.input_layernorm.scale_in_fp32
    assert model.model.norm.scale_in_fp32
    hf = hf_model(str(gpt_oss_dir))
    ours = dict(model.named_parameters())
    for name, p in hf.named_parameters():  # every HF weight, under its HF name
        assert torch.equal(ours[name], p), name
    assert len(ours) == len(dict(hf.named_parameters()))


def test_static_attn_len_and_greedy_generate(gpt_oss_dir):
    """The sync-free path (a fixed `attn_len`, as the compiled round runs) gives the same
    rounds; greedy decoding equals HF `generate` token for token, past the window."""
    hf = hf_model(str(gpt_oss_dir))
    diffs = speculative_rounds(
        native(gpt_oss_dir), hf, prompt_lengths(8), taps=(1, 3), attn_len=MAX_SEQ_LEN
    )
    diffs.check()
    assert_greedy_matches_hf(native, gpt_oss_dir, hf, 12)


def test_rms_norm_scales_in_fp32_like_transformers():
    """bf16 input, fp32 weight (HF keeps it so): the weight multiplies before the cast back,
    bit for bit HF's `GptOssRMSNorm`; Llama's order rounds differently."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=g) * 3).bfloat16()
    w = torch.randn(256, generator=g).bfloat16().float()  # a bf16 checkpoint's values
    hf = GptOssRMSNorm(256, eps=1e-5)
    ours, llama = RMSNorm(256, 1e-5, scale_in_fp32=True), RMSNorm(256, 1e-5)
    with torch.no_grad():
        for n in (hf, ours, llama):
            n.weight.copy_(w)
    ours_bf16 = RMSNorm(256, 1e-5, scale_in_fp32=True).bfloat16()  # the runner's bf16 model
    with torch.no_grad():
        ours_bf16.weight.copy_(w)
    want = hf(x)
    assert want.dtype == torch.bfloat16
    assert torch.equal(ours(x), want) and torch.equal(ours_bf16(x), want)
    assert not torch.equal(llama(x), want)


def test_bf16_target_runs_and_follows_fp32(gpt_oss_dir):
    """bf16 (the runner's dtype on a GPU; grouped products in bf16 on the CPU): finite logits,
    the fp32 argmax at almost every slot of a prefill past the window."""
    seq = torch.tensor([rand_ids(30, 4)])
    from draftinfer.conventions.slots import Slots

    slots = Slots(torch.tensor([0]), torch.arange(30)[None])
    lo = native(gpt_oss_dir, dtype=torch.bfloat16)(seq, slots).logits
    hi = native(gpt_oss_dir)(seq, slots).logits
    assert torch.isfinite(lo).all()
    assert (lo.argmax(-1) == hi.argmax(-1)).float().mean() > 0.8


def test_serving_transforms_keep_parity(gpt_oss_dir):
    """Fused q/k/v (with biases) and gate/up GEMMs, another attention backend and the skinny
    linear (each a no-op in maths on the CPU) leave the rounds equal to transformers'."""
    from draftinfer.models.transforms import fuse_projections, use_attention, use_skinny_gemm

    model = native(gpt_oss_dir)
    fuse_projections(model)
    use_attention(model, "maths_decode")
    use_skinny_gemm(model)
    speculative_rounds(model, hf_model(str(gpt_oss_dir)), prompt_lengths(8), taps=(1, 3)).check()


def test_fixed_attn_len_forward_traces_as_one_graph(gpt_oss_dir):
    """With a fixed `attn_len` (the compiled round's call) the whole forward, routing and
    grouped expert products included, traces as one graph. bf16, the dtype the grouped
    products trace in."""
    assert_forward_traces_as_one_graph(
        native(gpt_oss_dir, max_batch=2, max_seq_len=32, dtype=torch.bfloat16)
    )


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"layer_types": ["chunked_attention"] * 4}, "layer type 'chunked_attention'"),
        # transformers' own validation, as a one-line ConfigError.
        ({"layer_types": ["full_attention"] * 3}, r"cannot parse .*\(4\).*`layer_types` \(3\)"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization 'fp8'"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 for 4 experts"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "zzz": 1}}, "unknown rope key"),
    ],
)
def test_unsupported_configs_are_one_line_config_errors(gpt_oss_dir, tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message) as e:
        native(edited_config(gpt_oss_dir, tmp_path / "t", **changes))
    assert "\n" not in str(e.value)


def test_missing_and_unknown_tensors_are_one_line_checkpoint_errors(gpt_oss_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(gpt_oss_dir / "model.safetensors"))

    def err(tensors, name) -> str:
        d = shutil.copytree(gpt_oss_dir, tmp_path / name)
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError) as e:
            native(d)
        assert "\n" not in str(e.value)
        return str(e.value)

    sinks = "model.layers.1.self_attn.sinks"
    assert f"lacks tensor(s) {sinks}" in err({k: v for k, v in sd.items() if k != sinks}, "a")
    gu = "model.layers.0.mlp.experts.gate_up_proj"
    assert f"lacks tensor(s) {gu}" in err({k: v for k, v in sd.items() if k != gu}, "b")
    # MXFP4 blocks without their scales.
    half = {k: v for k, v in sd.items() if k != gu}
    half[f"{gu}_blocks"] = torch.zeros(4, 64, 2, 16, dtype=torch.uint8)
    assert f"lacks tensor(s) {gu}_scales" in err(half, "c")
    extra = {**sd, "model.layers.0.mlp.experts.gate_up_proj_scales": torch.zeros(2)}
    assert "does not use: model.layers.0.mlp.experts.gate_up_proj_scales" in err(extra, "d")
