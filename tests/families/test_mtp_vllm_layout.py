"""The `deepseek` MTP layout as vLLM loads it (DESIGN section 4, mtp; issue 48, item 2): an
export of N trained modules, and the target copy it is stitched into, read by an independent
reader written from vLLM's DeepSeek / GLM MTP loaders (`tests/support/vllm_mtp_loader.py`),
land in vLLM's parameters exactly as the modules hold them: routed experts per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`, as the released checkpoints and transformers'
`save_pretrained` name them), nothing skipped, nothing missing.

The expected vLLM tensors are assembled here from the modules' own submodules (vLLM's fused
parameters are concatenations of ours: `w13 = [gate | up]` per expert, `qkv_proj = [q | k |
v]`, `fused_qkv_a_proj = [q_a | kv_a]`), not from the layout's names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftinfer.files.checkpoint import load_drafter, write_drafter
from draftinfer.kinds.mtp.config import MTPConfig
from draftinfer.kinds.mtp.module import MTPDrafter
from tests.support.moe_checkpoints import save_moe_target
from tests.support.moe_models import deepseek_v3_config, glm4_moe_config, glm4_moe_lite_config
from tests.support.vllm_mtp_loader import VllmLoadError, load_mtp

pytestmark = pytest.mark.usefixtures("one_thread")

N = 2


def _deepseek_v3():
    # Three layers, the first dense: module k sits at index 3 + k, a routed layer.
    return deepseek_v3_config(layers=3, hidden=32, heads=2, first_k_dense_replace=1), "mla"


def _deepseek_v3_no_q_lora():
    cfg = deepseek_v3_config(layers=2, hidden=32, heads=2, q_lora_rank=None, experts=4, n_group=2)
    return cfg, "mla"


def _glm4_moe():
    # GQA (4 heads, 2 KV heads of 8, half rotated), q/k norm, q/k/v biases: vLLM's `qkv_proj`.
    return glm4_moe_config(layers=3, hidden=32, heads=4, kv_heads=2, head_dim=8), "gqa"


def _glm4_moe_lite():
    return glm4_moe_lite_config(layers=3, hidden=32, heads=2), "mla"


FAMILIES = {
    "deepseek_v3": _deepseek_v3,
    "deepseek_v3_no_q_lora": _deepseek_v3_no_q_lora,
    "glm4_moe": _glm4_moe,
    "glm4_moe_lite": _glm4_moe_lite,
}


def _trained_modules(target_dir: Path, seed: int) -> MTPDrafter:
    """N modules on the target at `target_dir` (its config.json), every tensor redrawn, as
    training leaves them: distinct values everywhere, so a tensor landing in the wrong place
    shows."""
    config = json.loads((target_dir / "config.json").read_text())
    config.pop("num_nextn_predict_layers", None)
    d = MTPDrafter(MTPConfig(n_predict=N, target_config=config, block="native"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in d.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g))
    return d


def _block_in_vllm(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our block's tensors as vLLM's `mtp_block.*` parameters hold them: vLLM's fused
    parameters assembled from our submodules (module docstring), the rest by name."""
    sd = block.state_dict()
    out = {}
    fused = {
        "self_attn.fused_qkv_a_proj.weight": ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa."),
        "self_attn.qkv_proj.weight": ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj."),
        "mlp.shared_experts.gate_up_proj.weight": ("mlp.shared_experts.gate_proj.", "mlp.shared_experts.up_proj."),
        "mlp.gate_up_proj.weight": ("mlp.gate_proj.", "mlp.up_proj."),
    }  # fmt: skip
    used = set()
    for vname, parts in fused.items():
        for leaf in ("weight", "bias"):
            names = [p + leaf for p in parts]
            if all(n in sd for n in names):
                out[vname.replace(".weight", "." + leaf)] = torch.cat([sd[n] for n in names])
                used.update(names)
    if hasattr(block.mlp, "experts"):
        out["mlp.experts.w13_weight"] = block.mlp.experts.gate_up_proj.detach()
        out["mlp.experts.w2_weight"] = block.mlp.experts.down_proj.detach()
        used.update({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})
    for name, t in sd.items():
        if name not in used:
            out[name] = t
    return out


def modules_in_vllm(d: MTPDrafter) -> dict[str, torch.Tensor]:
    """Every vLLM MTP parameter's expected value, from the modules `d`."""
    L = d.config.target_num_layers
    want = {"model.embed_tokens.weight": d.embed_tokens.weight.detach()}
    for k, layer in enumerate(d.layers):
        p = f"model.layers.{L + k}."
        want[p + "enorm.weight"] = layer.enorm.weight.detach()
        want[p + "hnorm.weight"] = layer.hnorm.weight.detach()
        want[p + "eh_proj.weight"] = layer.eh_proj.weight.detach()
        want[p + "shared_head.norm.weight"] = layer.norm.weight.detach()
        want[p + "shared_head.head.weight"] = d.lm_head.weight.detach()
        for name, t in _block_in_vllm(layer.block).items():
            want[p + "mtp_block." + name] = t
    return want


def _assert_lands(loaded: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(want)
    for name, t in want.items():
        assert torch.equal(loaded[name], t.float()), name


@pytest.fixture(params=sorted(FAMILIES))
def case(request, tmp_path):
    cfg, attention = FAMILIES[request.param]()
    target = save_moe_target(cfg, tmp_path / "target")
    d = _trained_modules(target, seed=5)
    export = tmp_path / "export"
    write_drafter(export, d, {"target": str(target), "serving_k": N}, torch.float32)
    return target, d, export, attention


def test_export_lands_in_vllms_parameters(case):
    """The standalone export (config.json + model.safetensors) read by vLLM's rules: every
    tensor is an MTP tensor vLLM reads (none skipped), routed experts per expert, and every
    parameter of vLLM's N-layer MTP model equals the trained modules' tensors."""
    target, d, export, attention = case
    config = json.loads((export / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == N
    tensors = load_file(str(export / "model.safetensors"))
    assert not [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    load = load_mtp(config, tensors, attention)
    assert load.ignored == []
    _assert_lands(load.params, modules_in_vllm(d))


def test_stitched_target_lands_in_vllms_parameters(case, tmp_path):
    """vLLM with no draft model reads the MTP layers from the target itself: over the whole
    stitched copy, the target's own tensors are skipped (and only they) and the MTP
    parameters equal the modules'."""
    from draftinfer.files.target_dir import weight_files
    from draftinfer.registry import drafter_spec

    target, d, export, attention = case
    out = drafter_spec("mtp").stitch(export, d.config, target, tmp_path / "stitched")
    config = json.loads((out / "config.json").read_text())
    tensors = {}
    for f in weight_files(out):
        tensors.update(load_file(str(f)))
    load = load_mtp(config, tensors, attention)
    assert sorted(load.ignored) == sorted(load_file(str(target / "model.safetensors")))
    _assert_lands(load.params, modules_in_vllm(d))


def test_reader_refuses_stacked_experts_and_missing_tensors(case, tmp_path):
    """The reader fails where vLLM does: the stacked experts our earlier exports wrote
    (`mlp.experts.gate_up_proj` matches no per-expert mapping and is no parameter of vLLM's
    `FusedMoE`), a missing tensor, a tensor of the wrong shape. Our own reader still loads the stacked
    form."""
    target, d, export, attention = case
    config = json.loads((export / "config.json").read_text())
    tensors = load_file(str(export / "model.safetensors"))
    L = d.config.target_num_layers
    p = f"model.layers.{L}.mlp.experts."
    stacked = {n: t for n, t in tensors.items() if not n.startswith(p)}
    stacked[p + "gate_up_proj"] = d.layers[0].block.mlp.experts.gate_up_proj.detach().clone()
    stacked[p + "down_proj"] = d.layers[0].block.mlp.experts.down_proj.detach().clone()
    with pytest.raises(VllmLoadError, match=r"no parameter .*mlp\.experts\.(gate_up|down)_proj'"):
        load_mtp(config, stacked, attention)
    missing = dict(tensors)
    del missing[f"model.layers.{L + 1}.mlp.experts.0.up_proj.weight"]
    with pytest.raises(VllmLoadError, match=r"experts\.w13_weight: \d+ of \d+ values not written"):
        load_mtp(config, missing, attention)
    wrong = dict(tensors)
    wrong[f"model.layers.{L}.eh_proj.weight"] = wrong[f"model.layers.{L}.eh_proj.weight"].T
    with pytest.raises(VllmLoadError, match="eh_proj.weight"):
        load_mtp(config, wrong, attention)

    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text((export / "config.json").read_text())
    save_file(stacked, str(old / "model.safetensors"), metadata={"format": "pt"})
    shared = {"input_embeddings": d.embed_tokens.weight, "output_embeddings": d.lm_head.weight}
    for src in (export, old):
        back, _ = load_drafter(src, shared)
        theirs = back.trainable_state_dict()
        for name, t in d.trainable_state_dict().items():
            assert torch.equal(theirs[name], t), (src.name, name)
