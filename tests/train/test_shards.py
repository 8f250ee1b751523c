"""The one sharded, atomically written output (`drafttrain/trainer/shards.py`) and its three users:
atomic files survive a kill, a manifest of another format or an old version is one line,
resume keeps exactly the shards that verify, a checkpoint lists and checks its files, and the
old on-disk versions of the feature cache and regeneration are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import drafttrain.trainer.shards as shards_mod
from drafttrain.jobs.errors import CheckpointError, ConfigError, DataError
from drafttrain.trainer.checkpoint import begin_checkpoint, finish_checkpoint, load_checkpoint
from drafttrain.trainer.shards import (
    MANIFEST,
    ManifestFormat,
    ShardedOutput,
    first_difference,
    is_temp,
    remove_temp_files,
    sha256_bytes,
    temp_path,
    write_atomic,
)

FMT = ManifestFormat("test-output", 3, "test output", DataError, hint="write it again")


class Killed(Exception):
    pass


def test_write_atomic_leaves_the_old_file_when_killed_before_the_rename(tmp_path, monkeypatch):
    path = tmp_path / "a.bin"
    write_atomic(path, b"old")

    def dies(src, dst):
        raise Killed

    monkeypatch.setattr(shards_mod.os, "replace", dies)
    with pytest.raises(Killed):
        write_atomic(path, b"new contents")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    [tmp] = [p for p in tmp_path.iterdir() if p != path]
    assert tmp == temp_path(path) and is_temp(tmp) and tmp.read_bytes() == b"new contents"
    remove_temp_files(tmp_path)
    assert sorted(tmp_path.iterdir()) == [path]
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"


def test_commit_lists_a_shard_only_after_its_file_is_in_place(tmp_path, monkeypatch):
    out = ShardedOutput(tmp_path, FMT, FMT.new(3, settings={"a": 1}))
    out.commit(0, "data/s0.bin", b"zero")
    real = shards_mod.write_atomic

    def dies_on_shard_1(path: Path, data: bytes) -> None:
        if path.name == "s1.bin":
            raise Killed
        real(path, data)

    monkeypatch.setattr(shards_mod, "write_atomic", dies_on_shard_1)
    with pytest.raises(Killed):
        out.commit(1, "data/s1.bin", b"one")
    monkeypatch.undo()
    m = FMT.read(tmp_path)
    assert m["format"] == "test-output" and m["version"] == 3 and not m["complete"]
    assert [(e["index"], e["bytes"], e["sha256"]) for e in m["shards"]] == [
        (0, 4, sha256_bytes(b"zero"))
    ]
    # Resume: the listed shard verifies and is kept; the rest are written; then complete.
    again = ShardedOutput(tmp_path, FMT, FMT.new(3, settings={"a": 1}))
    again.keep_verified(m)
    assert set(again.done()) == {0}
    again.commit(2, "data/s2.bin", b"two")
    assert not FMT.read(tmp_path)["complete"]
    again.commit(1, "data/s1.bin", b"one")
    final = FMT.read(tmp_path)
    assert final["complete"] and [e["index"] for e in final["shards"]] == [0, 1, 2]
    again.check()


def test_resume_drops_altered_shards_and_shards_of_another_plan(tmp_path):
    out = ShardedOutput(tmp_path, FMT, FMT.new(3))
    for i in range(3):
        out.commit(i, f"s{i}.bin", bytes([i]) * 8, rows=[i, i + 1])
    (tmp_path / "s1.bin").write_bytes(b"\x09" * 8)  # same size, other bytes
    old = FMT.read(tmp_path)
    assert "fails its sha256" in out.problem(old["shards"][1])
    assert out.problem(old["shards"][1], checksums=False) is None
    again = ShardedOutput(tmp_path, FMT, FMT.new(3))
    again.keep_verified(old, same=lambda e: e["rows"] != [2, 3])  # shard 2's plan changed
    assert set(again.done()) == {0}
    (tmp_path / "s0.bin").write_bytes(b"\x00" * 5)
    with pytest.raises(DataError, match=r"s0.bin is truncated or altered: 5 bytes.*write it again"):
        again.check()
    (tmp_path / "s0.bin").unlink()
    with pytest.raises(DataError, match="s0.bin is missing"):
        again.check()


def test_manifest_of_another_format_or_version_is_one_line(tmp_path):
    assert FMT.read(tmp_path) is None
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "test-output", "version": 2}))
    with pytest.raises(DataError) as e:
        FMT.read(tmp_path)
    assert str(e.value).count("\n") == 0
    assert "test output format version 2, this code reads 3; write it again" in str(e.value)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "something-else", "version": 3}))
    with pytest.raises(DataError, match="is not a test output manifest"):
        FMT.read(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="corrupted test output manifest"):
        FMT.read(tmp_path)
    legacy = ManifestFormat("new-name", 2, "x", DataError, legacy={"old/1": 1})
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "old/1"}))
    with pytest.raises(DataError, match="x format version 1, this code reads 2"):
        legacy.read(tmp_path)


def test_first_difference_flattens_and_names_unset_keys():
    assert first_difference({"a": {"b": 1}, "c": 2}, {"a": {"b": 1}, "c": 2}) is None
    assert first_difference({"a": {"b": 1}}, {"a": {"b": 2}}) == ("a.b", 1, 2)
    assert first_difference({"a": 1}, {"a": 1, "z": 0}) == ("z", "<unset>", 0)


# ---- checkpoints ---------------------------------------------------------------------------
def _checkpoint(root: Path, step: int) -> tuple[Path, torch.Tensor]:
    p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    root.mkdir(parents=True, exist_ok=True)
    begin_checkpoint(root, step)
    state = {"scheduler": {}, "data": {}}
    return finish_checkpoint(root, step, {"w": p.detach()}, opt, state), p.detach().clone()


def test_checkpoint_lists_its_files_and_refuses_an_altered_one(tmp_path):
    path, w = _checkpoint(tmp_path / "checkpoints", 4)
    m = json.loads((path / MANIFEST).read_text())
    assert m["format"] == "drafttrain-checkpoint" and m["complete"] and m["step"] == 4
    names = {e["file"] for e in m["shards"]}
    assert names == {p.name for p in path.iterdir() if p.name != MANIFEST}
    assert {"drafter.safetensors", "optimizer.safetensors", "state.json"} <= names
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == path.name
    assert torch.equal(load_checkpoint(path)["drafter"]["w"], w)
    data = bytearray((path / "optimizer.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "optimizer.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer.safetensors fails its sha256"):
        load_checkpoint(path)


def test_checkpoint_without_a_manifest_still_loads(tmp_path):
    path, _ = _checkpoint(tmp_path / "checkpoints", 2)
    (path / MANIFEST).unlink()  # as written before checkpoints had one
    assert load_checkpoint(path)["state"]["step"] == 2


# ---- old on-disk versions of the cache and regeneration ------------------------------------
def test_version_1_feature_cache_is_refused_in_one_line(tmp_path):
    from drafttrain.cache.format import FORMAT

    v1 = {"format": "drafttrain-feature-cache", "version": 1, "splits": {}, "complete": True}
    (tmp_path / MANIFEST).write_text(json.dumps(v1))
    with pytest.raises(DataError) as e:
        FORMAT.read(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "version 1, this code reads 2" in msg
    assert "python -m drafttrain.cache" in msg


def test_version_1_regeneration_is_refused_in_one_line(tmp_path):
    from drafttrain.regenerate.manifest import Manifest

    v1 = {"format": "drafttrain.regenerate/1", "fingerprint": "x", "shards": [], "complete": True}
    (tmp_path / MANIFEST).write_text(json.dumps(v1))
    with pytest.raises(DataError) as e:
        Manifest.open(tmp_path, {"a": 1}, "train", 4, 2, {})
    msg = str(e.value)
    assert "\n" not in msg and "regeneration format version 1, this code reads 2" in msg
    with pytest.raises(ConfigError, match="not empty and has no manifest.json"):
        (tmp_path / MANIFEST).unlink()
        (tmp_path / "stray.txt").write_text("x")
        Manifest.open(tmp_path, {"a": 1}, "train", 4, 2, {})
