"""Stitching MTP modules into a copy of their target checkpoint (DESIGN section 4, mtp (b)).

Engines that load MTP from the target itself (vLLM's `method: mtp` with no draft model,
transformers' `MtpModel.from_pretrained(main_model)`) read `num_nextn_predict_layers` from the
target's `config.json` and the modules' tensors (`model.layers.{L+k}.*`, or `model.mtp.*` for
the `mrv2` layout) from its safetensors index. The copy gets:

- every file of the target, its weights as shard 1 of the index (a single `model.safetensors`
  is renamed, since loaders prefer a single file over an index when both exist);
- the modules' tensors (the export's `model.safetensors`) as one more shard;
- `config.json` with `num_nextn_predict_layers = N` and our `"drafttrain"` section, so
  `draftinfer` also loads the drafter from the stitched directory.

A target that ships MTP layers of its own (DeepSeek-V3, GLM) is refused unless `replace=True`
(`python -m drafttrain.stitch --replace`): then the copy's shards that hold them are rewritten
without them, so no loader (vLLM reads every tensor of the shards the index names) sees two
versions of a layer, and the modules take their place.

The copy is written to `OUT_DIR.tmp` and renamed at the end: nothing half-written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftinfer.files.errors import CheckpointError
from draftinfer.models.target import TargetInfo

INDEX = "model.safetensors.index.json"
MTP_SHARD = "model-mtp.safetensors"


def target_info(config: dict) -> TargetInfo:
    """The facts `check_fit` reads, from a target's `config.json`: `architecture` is its HF
    architecture, `family` the target family serving it (a family name, not an architecture)."""
    from draftinfer.registry import FAMILIES

    archs = config.get("architectures") or []
    family = FAMILIES.for_architectures(archs)
    text = family.decoder_config(config)
    return TargetInfo(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        num_layers=int(text["num_hidden_layers"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 0)),
        architecture=archs[0] if archs else "",
        family=family.name,
    )


def stitch(
    spec, export_dir: Path, arch, target_dir: Path, out_dir: Path, replace: bool = False
) -> Path:
    export_dir, target_dir, out = Path(export_dir), Path(target_dir), Path(out_dir)
    tcfg_path = target_dir / "config.json"
    if not tcfg_path.is_file():
        raise CheckpointError(f"not a target checkpoint: {tcfg_path} does not exist")
    tcfg = json.loads(tcfg_path.read_text())
    info = target_info(tcfg)
    spec.check_fit(arch, info)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"output directory {out} exists and is not empty")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(target_dir, tmp)
    try:
        index_path = tmp / INDEX
        if index_path.is_file():
            index = json.loads(index_path.read_text())
        else:
            single = tmp / "model.safetensors"
            if not single.is_file():
                raise CheckpointError(f"no model.safetensors or {INDEX} in {target_dir}")
            shard = "model-target.safetensors"
            single.rename(tmp / shard)
            with safe_open(str(tmp / shard), framework="pt") as f:
                index = {"metadata": {}, "weight_map": {k: shard for k in f.keys()}}
        weight_map = index["weight_map"]
        stale = [k for k in weight_map if spec.wants_tensor(arch, k)]
        if stale and not replace:
            raise CheckpointError(
                f"{target_dir} already holds MTP layers ({stale[0]}, ...); --replace puts "
                "these modules in their place"
            )
        removed = _drop_tensors(tmp, weight_map, set(stale))
        tensors = load_file(str(export_dir / "model.safetensors"))
        save_file(tensors, str(tmp / MTP_SHARD), metadata={"format": "pt"})
        weight_map.update({k: MTP_SHARD for k in tensors})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index.setdefault("metadata", {})["total_size"] = (
            int(index["metadata"].get("total_size", 0)) + total - removed
        )
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        export_cfg = json.loads((export_dir / "config.json").read_text())
        for key in ("num_nextn_predict_layers", "mtp_config", "drafttrain"):
            if key in export_cfg:
                tcfg[key] = export_cfg[key]
        (tmp / "config.json").write_text(json.dumps(tcfg, indent=2, sort_keys=True) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def _drop_tensors(root: Path, weight_map: dict[str, str], names: set[str]) -> int:
    """Rewrite the shards under `root` holding any of `names` without them and drop them from
    `weight_map`; returns the bytes removed."""
    removed = 0
    for shard in sorted({weight_map[k] for k in names}):
        path = root / shard
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {"format": "pt"}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        removed += sum(t.nbytes for k, t in tensors.items() if k in names)
        save_file({k: t for k, t in tensors.items() if k not in names}, str(path), metadata=meta)
    for k in names:
        del weight_map[k]
    return removed
