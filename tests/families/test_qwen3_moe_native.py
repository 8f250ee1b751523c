"""The native Qwen3-MoE target against transformers' `Qwen3MoeForCausalLM` (eager, fp32).

On 20 random configs (`tests.support.moe_models.random_qwen3_moe_configs`: experts and top-k,
with and without `norm_topk_prob`, some layers dense through `mlp_only_layers`), loaded from the
released per-expert tensor layout, logits and features (layer-input taps = HF
`output_hidden_states[j]`, post-norm final hidden) equal HF's through a padded prefill, decode
steps, and verify passes with rejected drafts whose cache rows the next pass re-writes
(`tests.support.native_parity.speculative_rounds`). Plus the family's registration and config
facts, the stacked in-memory layout loading by name, greedy generation and one-line errors.
"""

from __future__ import annotations

import shutil
from functools import partial

import pytest
import torch

from draftinfer.families.qwen3_moe import Qwen3MoeForCausalLM
from draftinfer.files.errors import CheckpointError, ConfigError
from draftinfer.models.layers import SwiGLU
from draftinfer.models.moe import MoEBlock, SiluGLU, SoftmaxTopKRouter
from draftinfer.registry import FAMILIES, FEATURES, family_spec
from tests.support.kind_factories import kinds_for_family
from tests.support.moe_checkpoints import save_moe_target
from tests.support.moe_models import qwen3_moe_config, random_qwen3_moe_configs
from tests.support.native_parity import (
    assert_forward_traces_as_one_graph,
    assert_greedy_matches_hf,
    cpu_target,
    edited_config,
    hf_model,
    random_config_parity,
    speculative_rounds,
)

CONFIGS = random_qwen3_moe_configs(20)
MAX_SEQ_LEN = 64
LENGTHS = (19, 7, 12)  # three prompts of different lengths


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    cfg = qwen3_moe_config(mlp_only_layers=[1])
    return save_moe_target(cfg, tmp_path_factory.mktemp("qwen3_moe"))


native = partial(cpu_target, max_seq_len=MAX_SEQ_LEN)


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_speculative_rounds_match_transformers(index, tmp_path, record_property):
    random_config_parity(CONFIGS[index], index, tmp_path, record_property, LENGTHS)


def test_registered_and_config_facts(qwen3_moe_dir):
    assert FAMILIES.native_class({"architectures": ["Qwen3MoeForCausalLM"]}) is (
        Qwen3MoeForCausalLM
    )
    assert FAMILIES.native_class({"model_type": "qwen3_moe"}) is Qwen3MoeForCausalLM
    spec = family_spec("qwen3_moe")
    assert spec.provides == FEATURES - {"dense_decoder_layer", "drafter_block"}
    assert not spec.requires
    assert kinds_for_family("qwen3_moe")
    model = native(qwen3_moe_dir)
    c = model.config
    assert model.info.family == "qwen3_moe" and model.info.architecture == "Qwen3MoeForCausalLM"
    assert (c.num_experts, c.top_k, c.moe_intermediate_size) == (4, 2, 32)
    assert c.norm_topk_prob and c.mlp_only_layers == (1,) and c.qk_norm
    for j, layer in enumerate(model.model.layers):
        assert layer.self_attn.window is None and layer.self_attn.sinks is None
        assert layer.self_attn.q_norm is not None
        if j == 1:
            assert type(layer.mlp) is SwiGLU and layer.mlp.gate_proj.weight.shape == (64, 64)
            continue
        assert isinstance(layer.mlp, MoEBlock) and isinstance(layer.mlp.gate, SoftmaxTopKRouter)
        assert isinstance(layer.mlp.experts.act, SiluGLU)
        assert layer.mlp.experts.gate_up_proj.shape == (4, 64, 64)  # [E, 2I, H]
    # The per-expert tensors of the checkpoint, in HF's stacked in-memory parameters.
    hf = hf_model(str(qwen3_moe_dir))
    ours = dict(model.named_parameters())
    for name, p in hf.named_parameters():
        assert torch.equal(ours[name], p), name
    assert len(ours) == len(dict(hf.named_parameters()))


def test_stacked_layout_loads_by_name(qwen3_moe_dir, tmp_path):
    """A checkpoint in transformers' in-memory layout (`mlp.experts.gate_up_proj [E, 2I, H]`,
    as `state_dict()` holds it) loads by name into the same model."""
    from safetensors.torch import save_file

    d = shutil.copytree(qwen3_moe_dir, tmp_path / "stacked")
    sd = {k: v.contiguous() for k, v in hf_model(str(qwen3_moe_dir)).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    save_file(sd, str(d / "model.safetensors"))
    a, b = native(d).state_dict(), native(qwen3_moe_dir).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_static_attn_len_and_greedy_generate(qwen3_moe_dir):
    hf = hf_model(str(qwen3_moe_dir))
    diffs = speculative_rounds(
        native(qwen3_moe_dir), hf, LENGTHS, taps=(1, 3), attn_len=MAX_SEQ_LEN
    )
    diffs.check()
    assert_greedy_matches_hf(native, qwen3_moe_dir, hf, 12)


def test_serving_transforms_keep_parity(qwen3_moe_dir):
    """Fused q/k/v (with biases) and gate/up GEMMs, another attention backend and the skinny
    linear (each a no-op in maths on the CPU) leave the rounds equal to transformers'."""
    from draftinfer.models.transforms import fuse_projections, use_attention, use_skinny_gemm

    model = native(qwen3_moe_dir)
    fuse_projections(model)
    use_attention(model, "maths_decode")
    use_skinny_gemm(model)
    speculative_rounds(model, hf_model(str(qwen3_moe_dir)), LENGTHS, taps=(1, 3)).check()


def test_fixed_attn_len_forward_traces_as_one_graph(qwen3_moe_dir):
    """With a fixed `attn_len` (the compiled round's call) the whole forward, routing and
    grouped expert products included, traces as one graph. bf16, the dtype the grouped
    products trace in."""
    assert_forward_traces_as_one_graph(
        native(qwen3_moe_dir, max_batch=2, max_seq_len=32, dtype=torch.bfloat16)
    )


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported"),
        ({"shared_expert_intermediate_size": 512}, "shared expert"),
        ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window"),
        ({"mlp_only_layers": [4]}, r"mlp_only_layers \[4\] out of range"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 for 4 experts"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_configs_are_one_line_config_errors(qwen3_moe_dir, tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message) as e:
        native(edited_config(qwen3_moe_dir, tmp_path / "t", **changes))
    assert "\n" not in str(e.value)


def test_missing_unknown_and_misshaped_expert_tensors(qwen3_moe_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(qwen3_moe_dir / "model.safetensors"))

    def err(tensors, name) -> str:
        d = shutil.copytree(qwen3_moe_dir, tmp_path / name)
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError) as e:
            native(d)
        assert "\n" not in str(e.value)
        return str(e.value)

    up = "model.layers.2.mlp.experts.3.up_proj.weight"
    assert f"lacks tensor(s) {up}" in err({k: v for k, v in sd.items() if k != up}, "missing")
    extra = {**sd, "model.layers.0.mlp.experts.4.down_proj.weight": torch.zeros(64, 32)}
    assert "does not use: model.layers.0.mlp.experts.4.down_proj.weight" in err(extra, "extra")
    bad = {**sd, up: torch.zeros(31, 64)}
    assert f"{up} give shape (31, 64), the config implies (32, 64)" in err(bad, "shape")
