"""Training checkpoints: atomic, safetensors-only, exactly resumable.

Layout: `<output_dir>/checkpoints/step_000100/` holding
- `drafter.safetensors`: the drafter's own tensors (no shared target embedding),
- `optimizer.safetensors` + `optimizer.json`: AdamW state tensors flattened by name, and the
  param groups (JSON),
- `state.json`: step, micro-batch cursor, scheduler state, the drafter architecture,
- `rng.safetensors`: CPU (and CUDA) generator states as uint8 tensors (`rng_rank{r}` for
  the other ranks of a multi-process run),
- `engine/` instead of the optimizer files when DeepSpeed ZeRO or FSDP shard the drafter and
  its optimizer: the engine's own sharded state (`accelerator.save_state`), written by every
  rank; `drafter.safetensors` is still the full drafter, gathered on rank 0;
- `manifest.json`: every file above with its size and sha256, in the layout every sharded
  output of the project shares (`drafttrain.trainer.shards`, format `drafttrain-checkpoint`).
`<output_dir>/checkpoints/latest` names the newest complete one (a pointer file).

Atomicity (`drafttrain.trainer.shards`): everything is written into `step_N.tmp/`, fsynced and renamed
in one `os.replace`, then `latest` is replaced atomically; a run killed at any instant leaves
either the old or the new checkpoint, never half of one. Loading checks every listed file's
size and sha256 (a one-line `CheckpointError` naming the file); a checkpoint written before
manifests existed loads as before (its files are checked for presence only). Nothing of ours
is unpickled on load (an `engine/` folder is the engine's own format, read by
`accelerator.load_state`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from drafttrain.jobs.errors import CheckpointError
from drafttrain.trainer.shards import (
    ManifestFormat,
    ShardedOutput,
    publish_dir,
    read_pointer,
    write_pointer,
)

FORMAT = ManifestFormat("drafttrain-checkpoint", 1, "checkpoint", CheckpointError)
LATEST = "latest"


def _flatten_optimizer(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        pid, k = name.split(".", 1)
        state.setdefault(int(pid), {})[k] = t
    for name, v in meta["scalars"].items():
        pid, k = name.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    return out


def begin_checkpoint(ckpt_root: Path, step: int) -> Path:
    """A fresh `step_N.tmp/` to write a checkpoint into (removed again if it existed)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def finish_checkpoint(
    ckpt_root: Path,
    step: int,
    drafter_tensors: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write the drafter, optimizer (None: an engine wrote its own sharded state under
    `engine/`, `state["engine_state"]` says so), RNG and state into `step_N.tmp/`, list every
    file in its manifest, and publish it with one rename."""
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f"step_{step:06d}.tmp"
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in drafter_tensors.items()},
        str(tmp / "drafter.safetensors"),
    )
    if optimizer is not None:
        opt_tensors, opt_meta = _flatten_optimizer(optimizer)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(opt_meta))
    save_file(rng_tensors(), str(tmp / "rng.safetensors"))
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))
    # Every file (the other ranks' RNG and an engine's shards included), then the manifest.
    files = sorted(f.relative_to(tmp).as_posix() for f in tmp.rglob("*") if f.is_file())
    listing = ShardedOutput(tmp, FORMAT, FORMAT.new(len(files), step=step))
    for i, name in enumerate(files):
        listing.add(listing.entry(i, name))
    listing.save()
    publish_dir(tmp, final)
    write_pointer(ckpt_root / LATEST, final.name)
    steps = sorted(p for p in ckpt_root.glob("step_*") if not p.name.endswith(".tmp"))
    for old in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_rank_rng(tmp: Path, rank: int) -> None:
    """Ranks other than 0 keep their own RNG state beside rank 0's `rng.safetensors`."""
    save_file(rng_tensors(), str(tmp / f"rng_rank{rank}.safetensors"))


def load_rank_rng(path: Path, rank: int) -> dict[str, torch.Tensor]:
    f = path / (f"rng_rank{rank}.safetensors" if rank else "rng.safetensors")
    return _load(f) if f.is_file() else {}


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    name = read_pointer(ckpt_root / LATEST)
    path = ckpt_root / name if name else None
    return path if path is not None and path.is_dir() else None


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"corrupted checkpoint file {path}: {first}") from None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """-> {"drafter": tensors, "optimizer": optimizer state dict (None when a sharding engine
    keeps it under `engine/`), "state": dict, "rng": tensors}"""
    listing = FORMAT.read(path)
    if listing is not None:  # None: written before checkpoints had a manifest
        ShardedOutput(path, FORMAT, listing).check()  # each file there, its size and sha256
    for name in ("drafter.safetensors", "state.json"):
        if not (path / name).is_file():
            raise CheckpointError(f"incomplete checkpoint {path}: {name} missing")
    state = json.loads((path / "state.json").read_text())
    optimizer = None
    if state.get("engine_state"):
        if not (path / "engine").is_dir():
            raise CheckpointError(f"incomplete checkpoint {path}: engine/ missing")
    else:
        for name in ("optimizer.safetensors", "optimizer.json"):
            if not (path / name).is_file():
                raise CheckpointError(f"incomplete checkpoint {path}: {name} missing")
        optimizer = _unflatten_optimizer(
            _load(path / "optimizer.safetensors"), json.loads((path / "optimizer.json").read_text())
        )
    return {
        "drafter": _load(path / "drafter.safetensors"),
        "optimizer": optimizer,
        "state": state,
        "rng": _load(path / "rng.safetensors") if (path / "rng.safetensors").is_file() else {},
    }


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda{i}" in rng:
                torch.cuda.set_rng_state(rng[f"cuda{i}"], i)


def init_checkpoint(path: str | Path) -> Path:
    """The checkpoint `trainer.init_from` names: a run directory (its latest checkpoint) or a
    `checkpoints/step_N` directory; a one-line `CheckpointError` when there is none."""
    p = Path(path).expanduser()
    if (p / "state.json").is_file():
        return p
    ck = latest_checkpoint(p / "checkpoints") if p.is_dir() else None
    if ck is None:
        raise CheckpointError(
            f"trainer.init_from: no checkpoint at {path} (a training run's output_dir or its "
            "checkpoints/step_N; train the SFT stage first)"
        )
    return ck


def load_init_weights(
    path: str | Path, kind: str, arch: dict, new_heads=lambda saved: ()
) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """The drafter tensors of `trainer.init_from`'s checkpoint, after checking it holds a
    `kind` drafter of architecture `arch`, or of one the kind starts from with heads added
    (`new_heads(saved_arch)`: their name prefixes, `TrainSpec.warm_start_heads`; one-line
    `CheckpointError` otherwise) -> (tensors, the prefixes left at their init)."""
    ck = init_checkpoint(path)
    state = json.loads((ck / "state.json").read_text())
    saved = state.get("drafter_config")
    heads = () if saved == arch else new_heads(saved or {})
    if state.get("drafter_kind") != kind or (saved != arch and not heads):
        raise CheckpointError(
            f"trainer.init_from: {ck} holds a {state.get('drafter_kind')} drafter of another "
            f"architecture than this config's {kind} drafter"
        )
    return load_checkpoint(ck)["drafter"], heads
