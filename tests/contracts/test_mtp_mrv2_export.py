"""The `mrv2` MTP export (Inkling's layout, vLLM Model Runner V2's multi-module contract): every
field of `config.json`, every tensor name, a round trip through our loader, a stitched copy of
the target, and the module logits an independent reader computes from the documented names
(`tests/support/mrv2_loader.py`: transformers' own decoder layer, no code of ours) equal the
trainer's and so, by S9, the runner's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftinfer.files.checkpoint import load_drafter, read_drafter_config, write_drafter
from draftinfer.files.errors import CheckpointError
from draftinfer.registry import drafter_spec
from drafttrain.registry import train_spec
from tests.support.kind_factories import small_drafter, small_embeddings, small_target_dir
from tests.support.mrv2_loader import MRv2Reader

N = 3


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    torch.manual_seed(0)
    d = small_drafter("mtp", n_predict=N, layout="mrv2", mtp_carry="post_norm")
    with torch.no_grad():  # norms away from 1 so a swapped or skipped norm shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("mrv2")
    write_drafter(out, d, {"target": "t", "serving_k": N}, torch.float32)
    return d, out


def test_config_fields(export):
    d, out = export
    cfg = json.loads((out / "config.json").read_text())
    target = json.loads((Path(small_target_dir("1d")) / "config.json").read_text())
    # The target family's own config (what an MTP model class of that family reads) ...
    for key in ("architectures", "model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        assert cfg[key] == target[key], key
    assert cfg["max_position_embeddings"] >= target["max_position_embeddings"]
    # ... with the module count where vLLM reads it, and Inkling's mtp_config block.
    assert cfg["num_nextn_predict_layers"] == N
    assert cfg["mtp_config"] == {
        "num_nextn_predict_layers": N,
        "chain_hidden_post_norm": True,
        "mtp_hidden_states_first": True,
        "local_layer_ids": [],
    }
    meta = cfg["drafttrain"]
    assert meta["drafter_kind"] == "mtp" and meta["layout"] == "mrv2"
    assert (meta["n_predict"], meta["mtp_chain"], meta["mtp_carry"]) == (N, True, "post_norm")
    assert meta["mask_pos0_embedding"] is False and meta["mtp_feature_tap"] == "post_norm"


def test_tensor_names_and_shapes(export):
    d, out = export
    H = d.config.hidden_size
    tensors = load_file(str(out / "model.safetensors"))
    block = {f"transformer_block.{k}" for k in d.layers[0].block.state_dict()}
    want = {"model.mtp.chain_norm.weight"} | {
        f"model.mtp.layers.{i}.{part}"
        for i in range(N)
        for part in {"hidden_norm.weight", "embed_norm.weight", "input_proj.weight"} | block
    }
    assert set(tensors) == want  # no embedding or head copies: the target's are shared
    assert tensors["model.mtp.layers.0.input_proj.weight"].shape == (H, 2 * H)
    assert tensors["model.mtp.chain_norm.weight"].shape == (H,)


def test_round_trip_through_our_loader(export):
    d, out = export
    spec, arch, _ = read_drafter_config(out)
    assert spec.name == "mtp" and arch.layout == "mrv2" and arch.n_predict == N
    back, _ = load_drafter(out, small_embeddings(d))
    ours, theirs = d.trainable_state_dict(), back.trainable_state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def test_independent_reader_computes_our_module_logits(export):
    """The engine's semantics from the documented names: step m at position p on
    (h^{m-1}_p, t_{p+m+1}) at RoPE position p, hidden first, chain_norm carried."""
    d, out = export
    reader = MRv2Reader(out)
    assert reader.n == N and reader.hidden_first and reader.post_norm
    tspec = train_spec("mtp")
    obj = tspec.objective(d, tspec.config_class(layout="mrv2"), "eager")
    torch.manual_seed(1)
    T = 12
    ids = torch.randint(0, d.config.vocab_size, (T + N,))
    feats = torch.randn(T, d.config.hidden_size)
    pos = torch.arange(T)
    ours = obj.module_logits(ids[None, :T], feats[None], pos[None], N)
    theirs = reader.module_logits(d.embed_tokens.weight, d.lm_head.weight, ids, feats, pos)
    for m in range(N):
        # Our rows consume t_{p+m+1} for p + m + 1 < T (the rest is past the sequence).
        n = T - m - 1
        torch.testing.assert_close(ours[m][0, :n], theirs[m][:n], rtol=1e-5, atol=1e-5)


def test_reader_refuses_a_missing_module(export, tmp_path):
    """Both loaders reject a checkpoint that lacks a module, ours with one line naming it."""
    d, out = export
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((out / f).read_bytes())
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if not k.startswith("model.mtp.layers.2.")}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="module 2"):
        MRv2Reader(tmp_path)
    with pytest.raises(CheckpointError, match=r"missing model\.mtp\.layers\.2\)") as e:
        load_drafter(tmp_path, small_embeddings(d))
    assert "\n" not in str(e.value)


def test_stitched_into_the_target(export, tmp_path):
    """The modules written into a copy of the target under `model.mtp.*` (index updated) load
    back equal; stitching twice is refused."""
    d, out = export
    spec, arch, _ = read_drafter_config(out)
    target = Path(small_target_dir("1d"))
    st = spec.stitch(out, arch, target, tmp_path / "st")
    index = json.loads((st / "model.safetensors.index.json").read_text())
    mtp = {k for k, v in index["weight_map"].items() if v == "model-mtp.safetensors"}
    assert mtp == set(load_file(str(out / "model.safetensors")))
    cfg = json.loads((st / "config.json").read_text())
    assert (
        cfg["num_nextn_predict_layers"] == N and cfg["mtp_config"]["num_nextn_predict_layers"] == N
    )
    back, _ = load_drafter(st, small_embeddings(d))
    ours, theirs = d.trainable_state_dict(), back.trainable_state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with pytest.raises(CheckpointError, match="already holds MTP layers"):
        drafter_spec("mtp").stitch(out, arch, st, tmp_path / "again")


@pytest.mark.parametrize("layout", ["mrv2", "deepseek"])
def test_model_card_says_which_engines_load_the_layout(layout):
    """The card's serving section names the engines that load this layout and what an
    out-of-tree vLLM registration needs for a Llama target (vLLM registers MTP only as the
    target's own architecture)."""
    d = small_drafter("mtp", n_predict=N, layout=layout)
    hint = drafter_spec("mtp").serving_hint(d.config, N, "tgt", "drf")
    assert "out-of-tree registration" in hint and "ModelRegistry.register_model" in hint
    assert "hf_config_override" in hint and "LlamaForCausalLM" in hint
    assert f"layout {layout}" in hint
    if layout == "mrv2":
        assert "MultiModuleMTPSpeculator" in hint and "`model.mtp.layers.0.*`" in hint
    else:
        assert "deepseek_mtp.py" in hint and "`model.layers.5.*`" in hint
