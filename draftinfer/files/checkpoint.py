"""The exported-drafter contract (DESIGN section 4): one writer, one reader, any kind.

`drafttrain.export.directory` writes with `write_drafter`; the runner loads with `load_drafter`, so
"verified end to end" means the runner read these files from disk. What a kind writes and
checks comes from its `DrafterSpec` (`draftinfer.registry`); this module names no kind.
Every convention a checkpoint depends on is recorded under the `"drafttrain"` key of
`config.json` (engines ignore it) and validated here with a one-line `CheckpointError` on
mismatch. Tensors are safetensors only; nothing is ever unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from draftinfer.files.errors import CheckpointError
from draftinfer.registry import DrafterSpec, drafter_spec, spec_of

FORMAT_VERSION = 1
# Subfolder of an export holding the same drafter in vllm-project/speculators' layout.
SPECULATORS_DIR = "speculators"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def drafter_config(
    drafter: torch.nn.Module,
    meta: dict[str, Any],
    dtype: torch.dtype,
    top_level: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `config.json` of `drafter`: the kind's serving config plus `top_level` (the target
    family's engine-facing fields), with our fields (`meta` merged with the kind's convention
    fields) under `config["drafttrain"]`."""
    spec = spec_of(drafter)
    arch = drafter.config
    config = {**spec.hf_config(arch), **(top_level or {})}
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["drafttrain"] = {
        "format_version": FORMAT_VERSION,
        "drafter_kind": spec.name,
        **spec.conventions(arch),
        **meta,
    }
    return config


def _cast(named: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors as an export stores them: on the CPU, floating ones cast to `dtype`, every one
    its own storage (safetensors refuses shared ones; a layout may hold copies of one tensor
    for the engines)."""
    tensors, seen = {}, set()
    for name, t in named.items():
        t = t.detach().cpu()
        t = (t.to(dtype) if t.is_floating_point() else t).contiguous()
        if t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    return tensors


def serving_tensors(drafter: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors an export of `drafter` holds, under their serving names (`_cast`)."""
    return _cast(spec_of(drafter).serving_state_dict(drafter), dtype)


def write_drafter(
    out_dir: str | Path,
    drafter: torch.nn.Module,
    meta: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
    top_level: dict[str, Any] | None = None,
) -> Path:
    """Write `config.json` + `model.safetensors` for `drafter` into `out_dir`, each once.

    meta: our fields (target name, training facts); merged with the kind's convention fields
    and stored under `config["drafttrain"]`. top_level: engine-facing fields the target family
    adds beside the kind's (e.g. Qwen3-VL's `target_model_type`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = drafter_config(drafter, meta, dtype, top_level)
    _save_file(out / "model.safetensors", serving_tensors(drafter, dtype))
    atomic_write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _save_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)


def _save_tensors(path: Path, named: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """`named` as an export stores them (`_cast`), written atomically as safetensors."""
    _save_file(path, _cast(named, dtype))


def write_speculators(
    out_dir: str | Path,
    drafter: torch.nn.Module,
    verifier: str,
    verifier_architectures: list[str],
    k: int,
    input_embeddings: Callable[[], torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    output_embeddings: Callable[[], torch.Tensor] | None = None,
) -> Path | None:
    """Write `out_dir/speculators/` (`config.json` + `model.safetensors`): the same drafter in
    vllm-project/speculators' layout, when its kind has one (`DrafterSpec.speculators_layout`).
    A folder of its own because speculators and the engines disagree on `config.json` (its
    `speculators_model_type` / `speculators_config`) and on tensor names.
    `input_embeddings()` / `output_embeddings()` read the target's input embedding and output
    head (called only if the layout holds them)."""
    layout = spec_of(drafter).speculators_layout(
        drafter, verifier, verifier_architectures, k, input_embeddings, output_embeddings
    )
    if layout is None:
        return None
    config, tensors = layout
    sub = Path(out_dir) / SPECULATORS_DIR
    sub.mkdir(parents=True, exist_ok=True)
    _save_tensors(sub / "model.safetensors", tensors, dtype)
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    atomic_write_text(sub / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sub


def read_drafter_config(ckpt_dir: str | Path) -> tuple[DrafterSpec, Any, dict[str, Any]]:
    """Parse and validate `config.json` -> (kind spec, architecture config, drafttrain meta)."""
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"not a drafter checkpoint: {path} does not exist")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupted {path}: {e}") from None
    return parse_drafter_config(config, str(path))


def parse_drafter_config(
    config: dict[str, Any], where: str
) -> tuple[DrafterSpec, Any, dict[str, Any]]:
    """A drafter's `config.json` (parsed) -> (kind spec, architecture config, drafttrain meta),
    every convention field checked against what this code implements."""
    meta = config.get("drafttrain")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where} has no 'drafttrain' section; not exported by drafttrain")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: format_version {meta.get('format_version')!r}, "
            f"this code reads {FORMAT_VERSION}"
        )
    spec = drafter_spec(meta.get("drafter_kind"))
    arch = spec.arch_from_hf(config, where)
    for key, want in spec.conventions(arch).items():
        if meta.get(key) != want:
            raise CheckpointError(
                f"{where}: {key} is {meta.get(key)!r}, this code implements {want!r}"
            )
    want_arch = spec.hf_config(arch).get("architectures")
    if config.get("architectures") != want_arch:
        raise CheckpointError(
            f"{where}: architectures {config.get('architectures')} do not "
            f"match drafter_kind {spec.name!r} ({want_arch})"
        )
    return spec, arch, meta


def read_drafter_tensors(
    ckpt_dir: str | Path, spec: DrafterSpec, arch: Any
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """-> (an unloaded module of the kind, the checkpoint's tensors under module names),
    validated by the kind's spec (names, drafting-mode tensors, shapes). The tensors are read
    from `model.safetensors` or the shards of `model.safetensors.index.json` (a target copy
    with MTP modules stitched in); only the names the kind claims are loaded."""
    from safetensors import safe_open

    from draftinfer.files.target_dir import weight_files

    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(Path(ckpt_dir)):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if spec.wants_tensor(arch, name):
                        tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"corrupted safetensors file {path}: {first}") from None
    return _module_and_tensors(spec, arch, tensors, str(Path(ckpt_dir)))


def _module_and_tensors(
    spec: DrafterSpec, arch: Any, serving: dict[str, torch.Tensor], where: str
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """An unloaded module and `serving` (serving names) under module names, validated."""
    module = spec.build(arch)
    tensors = spec.from_serving_names(arch, serving)
    spec.validate_state_dict(arch, tensors, module, where)
    return module, tensors


def load_drafter(
    ckpt_dir: str | Path,
    shared: dict[str, torch.Tensor],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the drafter module from an exported directory.

    shared: the target weights drafters share and checkpoints do not hold, by role
    (`"input_embeddings"` `[V, H]`, `"output_embeddings"` `[V, H]`; `target.shared_weights()`);
    the kind takes what it uses. Every tensor is checked by name and shape; the load is strict.
    """
    spec, arch, meta = read_drafter_config(ckpt_dir)
    drafter, tensors = read_drafter_tensors(ckpt_dir, spec, arch)
    spec.attach_shared(drafter, shared)
    drafter.load_own_state(tensors)
    return drafter.to(device=device, dtype=dtype).eval(), meta


def snapshot_drafter(
    drafter: torch.nn.Module,
    meta: dict[str, Any],
    shared: dict[str, torch.Tensor],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    export_dtype: torch.dtype = torch.bfloat16,
) -> torch.nn.Module:
    """What `load_drafter` returns for an export of `drafter` written with `write_drafter`
    (`meta`, `export_dtype`), built in memory, with no file written or read.

    The same steps as the disk round trip, each through the function the writer or the reader
    calls: the config (`drafter_config`, parsed back by `parse_drafter_config` after a JSON
    round trip), the serving tensors cast to `export_dtype` (`serving_tensors`), filtered by
    `wants_tensor`, renamed and validated (`_module_and_tensors`), the shared target weights
    attached and the state loaded. Only the file I/O is skipped: JSON text and safetensors
    store exactly what they are given (`tests/train/test_train_eval.py` compares the two tensor by
    tensor for every kind)."""
    config = json.loads(json.dumps(drafter_config(drafter, meta, export_dtype)))
    spec, arch, _ = parse_drafter_config(config, "<in-memory snapshot>")
    serving = {
        k: v
        for k, v in serving_tensors(drafter, export_dtype).items()
        if spec.wants_tensor(arch, k)
    }
    module, tensors = _module_and_tensors(spec, arch, serving, "<in-memory snapshot>")
    spec.attach_shared(module, shared)
    module.load_own_state(tensors)
    return module.to(device=device, dtype=dtype).eval()


# `drafter=native`: the drafter layers a target checkpoint ships in its own files (DESIGN
# convention 15: DeepSeek-V3's `model.layers.{L+k}.*` MTP layers), served with no training.
NATIVE_DRAFTER = "native"


def released_drafter_config(target: str | Path) -> tuple[DrafterSpec, Any, dict[str, Any]]:
    """(kind spec, architecture config, meta) of the drafter the target checkpoint `target`
    (a local directory or hub id) ships in its own files: the kind whose `released_arch`
    reads it from the target's `config.json` and family; a one-line `ConfigError` when it
    ships none."""
    from draftinfer.files.errors import ConfigError
    from draftinfer.files.target_dir import read_target_config
    from draftinfer.registry import FAMILIES, registered_kinds

    config = read_target_config(target)
    family = FAMILIES.for_architectures(config.get("architectures"))
    for kind in registered_kinds():
        spec = drafter_spec(kind)
        arch = spec.released_arch(config, family)
        if arch is not None:
            return spec, arch, {"target": str(target), "released": True}
    counted = (family.released_mtp or {}).get("count_key")
    why = f" (config.json: {counted} = {config.get(counted)!r})" if counted else ""
    raise ConfigError(
        f"drafter={NATIVE_DRAFTER}: target {target} ({family.name} family) ships no drafter "
        f"layers of its own{why}"
    )


def load_released_drafter(
    target: str | Path,
    shared: dict[str, torch.Tensor],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """`load_drafter` for `drafter=native`: the drafter the target ships, its tensors read from
    the target's own safetensors (the names the kind claims, e.g. `model.layers.{L+k}.*`),
    checked by name and shape like any export's."""
    from draftinfer.files.target_dir import resolve_checkpoint_dir

    spec, arch, meta = released_drafter_config(target)
    drafter, tensors = read_drafter_tensors(resolve_checkpoint_dir(target), spec, arch)
    spec.attach_shared(drafter, shared)
    drafter.load_own_state(tensors)
    return drafter.to(device=device, dtype=dtype).eval(), meta
