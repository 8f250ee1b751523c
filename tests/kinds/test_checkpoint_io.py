"""The exported-drafter contract: round trip through disk, and one-line errors for corrupted
or mismatched checkpoints (safetensors only, never pickle)."""

from __future__ import annotations

import json

import pytest
import torch

from draftinfer.files.checkpoint import load_drafter, read_drafter_config, write_drafter
from draftinfer.files.errors import CheckpointError
from tests.support.eagle3_small import small_drafter


def _emb() -> dict[str, torch.Tensor]:
    return {"input_embeddings": torch.zeros(97, 32)}


def _export(tmp_path, layers=1):
    d = small_drafter(layers)
    ids = torch.randperm(97, generator=torch.Generator().manual_seed(3))[:61].sort().values
    d.d2t.copy_(ids - torch.arange(61))  # offsets: target id = i + d2t[i]
    d.t2d.zero_()
    d.t2d[ids] = True
    write_drafter(tmp_path, d, {"target": "tiny", "ttt_steps": 3}, dtype=torch.float32)
    return d


@pytest.mark.parametrize("layers", [1, 2])
def test_round_trip_and_serving_layout(tmp_path, layers):
    d = _export(tmp_path, layers)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draft_vocab_size"] == 61 and cfg["target_hidden_size"] == 32
    assert cfg["drafttrain"]["first_token_convention"] == "drop"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    prefix = "midlayer." if layers == 1 else "layers.0."
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        prefix + "self_attn.q_proj.weight",
        prefix + "hidden_norm.weight",
    } <= names
    assert not any(n.startswith("embed_tokens") for n in names)
    loaded, meta = load_drafter(tmp_path, {"input_embeddings": d.embed_tokens.weight})
    assert meta["ttt_steps"] == 3
    for k, v in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_corrupted_safetensors(tmp_path):
    _export(tmp_path)
    p = tmp_path / "model.safetensors"
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupted safetensors file") as e:
        load_drafter(tmp_path, _emb())
    assert "\n" not in str(e.value)


def _edit_config(tmp_path, fn):
    p = tmp_path / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["drafttrain"].update(drafter_kind="medusa"), "unknown drafter_kind 'medusa'"),
        (
            lambda c: c["drafttrain"].update(first_token_convention="zero-feature"),
            "first_token_convention is 'zero-feature'",
        ),
        (lambda c: c["drafttrain"].update(aux_tap="layer_output"), "aux_tap is 'layer_output'"),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "do not match drafter_kind"),
        (lambda c: c.pop("drafttrain"), "no 'drafttrain' section"),
        (lambda c: c.update(hidden_size=48), "tensor .* has shape"),
        (lambda c: c.pop("max_position_embeddings"), "missing field 'max_position_embeddings'"),
        (lambda c: c.pop("draft_vocab_size"), "missing field 'draft_vocab_size'"),
        (lambda c: c["drafttrain"].pop("drafter_kind"), "unknown drafter_kind None"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn'"),
        (
            lambda c: c.update(rope_scaling={**c["rope_scaling"], "extra_key": 1}),
            "unknown rope key 'extra_key'",
        ),
    ],
)
def test_mismatched_config_is_refused(tmp_path, edit, message):
    _export(tmp_path)
    _edit_config(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message) as e:
        load_drafter(tmp_path, _emb())
    assert "\n" not in str(e.value)


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        read_drafter_config(tmp_path)
    _export(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match="no model.safetensors or model.safetensors.index.json"
    ):
        load_drafter(tmp_path, _emb())


def test_inconsistent_draft_vocabulary_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _export(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(str(path))
    sd["t2d"] = torch.zeros_like(sd["t2d"])
    save_file(sd, str(path))
    with pytest.raises(CheckpointError, match="t2d does not mark exactly"):
        load_drafter(tmp_path, _emb())
    sd["d2t"][-1] = 500
    save_file(sd, str(path))
    with pytest.raises(CheckpointError, match="d2t maps outside the target vocabulary"):
        load_drafter(tmp_path, _emb())


def test_target_embedding_must_fit(tmp_path):
    _export(tmp_path)
    with pytest.raises(CheckpointError, match="target embedding"):
        load_drafter(tmp_path, {"input_embeddings": torch.zeros(50, 32)})
