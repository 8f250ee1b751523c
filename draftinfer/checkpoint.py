"""The exported-drafter contract (DESIGN section 4): one writer, one reader.

`drafttrain.export` writes with `write_drafter`; the runner loads with `load_drafter`, so
"verified end to end" means the runner read these files from disk. Every convention a
checkpoint depends on is recorded under the `"drafttrain"` key of `config.json` (engines
ignore it) and validated here with a one-line `CheckpointError` on mismatch. Tensors are
safetensors only; nothing is ever unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftinfer.drafters import DRAFTERS
from draftinfer.errors import CheckpointError

FORMAT_VERSION = 1
# Conventions this code implements (DESIGN section 3). A checkpoint that records another
# value is refused rather than silently run with different semantics.
CONVENTIONS: dict[str, str] = {
    # Convention 1: row i consumes (t_{i+1}, f_i) at pos_i; token 0 has no pair.
    "first_token_convention": "drop",
    # Conventions 1 and 4: row i at draft step k sits at the target position of token i, + k.
    "position_convention": "target_pos_plus_step",
    # Convention 2: tap j = the hidden state entering decoder layer j.
    "aux_tap": "layer_input",
}


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_drafter(
    out_dir: str | Path,
    drafter: torch.nn.Module,
    meta: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write `config.json` + `model.safetensors` for `drafter` into `out_dir`.

    meta: our fields (target name, training facts); merged with the convention fields and
    stored under `config["drafttrain"]`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config
    config = cfg.to_hf()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["drafttrain"] = {
        "format_version": FORMAT_VERSION,
        "drafter_kind": cfg.kind,
        **CONVENTIONS,
        **meta,
    }
    tensors = {}
    for name, t in drafter.serving_state_dict().items():
        t = t.detach().cpu()
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    atomic_write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def read_drafter_config(ckpt_dir: str | Path) -> tuple[str, Any, dict[str, Any]]:
    """Parse and validate `config.json` -> (kind, architecture config, drafttrain meta)."""
    d = Path(ckpt_dir)
    path = d / "config.json"
    if not path.is_file():
        raise CheckpointError(f"not a drafter checkpoint: {path} does not exist")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupted {path}: {e}") from None
    meta = config.get("drafttrain")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} has no 'drafttrain' section; not exported by drafttrain")
    kind = meta.get("drafter_kind")
    if kind not in DRAFTERS:
        raise CheckpointError(f"{path}: unknown drafter_kind {kind!r} (known: {sorted(DRAFTERS)})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {meta.get('format_version')!r}, "
            f"this code reads {FORMAT_VERSION}"
        )
    for key, want in CONVENTIONS.items():
        if meta.get(key) != want:
            raise CheckpointError(
                f"{path}: {key} is {meta.get(key)!r}, this code implements {want!r}"
            )
    module_cls = DRAFTERS[kind]
    arch = module_cls.config_class.from_hf(config)
    if config.get("architectures") != [arch.architecture]:
        raise CheckpointError(
            f"{path}: architectures {config.get('architectures')} do not "
            f"match drafter_kind {kind!r} ({arch.architecture})"
        )
    return kind, arch, meta


def load_drafter(
    ckpt_dir: str | Path,
    embed_tokens: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the drafter module from an exported directory.

    embed_tokens: the target's input embedding `[V, H]` (engines share it; it is not in the
    drafter file). Shapes are checked tensor by tensor.
    """
    kind, arch, meta = read_drafter_config(ckpt_dir)
    path = Path(ckpt_dir) / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"not a drafter checkpoint: {path} does not exist")
    try:
        sd = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"corrupted safetensors file {path}: {first}") from None
    module_cls = DRAFTERS[kind]
    # Mode/weights consistency (S8): mask_hidden exists exactly for parallel drafters.
    wants_mask = getattr(module_cls, "parallel", False)
    if "mask_hidden" in sd and not wants_mask:
        raise CheckpointError(
            f"{path} has mask_hidden (a parallel drafter) but config.json says "
            f"drafter_kind {kind!r}; it cannot run as a chain drafter"
        )
    if wants_mask and "mask_hidden" not in sd:
        raise CheckpointError(
            f"{path}: drafter_kind {kind!r} needs mask_hidden, which the checkpoint lacks"
        )
    drafter = module_cls(arch)
    sd = module_cls.from_serving_names(sd)
    own = drafter.trainable_state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: tensors do not match a {kind} drafter "
            f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    for name, t in sd.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise CheckpointError(
                f"{path}: tensor {name} has shape {tuple(t.shape)}, config "
                f"implies {tuple(own[name].shape)}"
            )
    if embed_tokens is not None:
        if tuple(embed_tokens.shape) != (arch.vocab_size, arch.hidden_size):
            raise CheckpointError(
                f"target embedding {tuple(embed_tokens.shape)} does not fit the "
                f"drafter (vocab {arch.vocab_size}, hidden {arch.hidden_size})"
            )
        sd["embed_tokens.weight"] = embed_tokens
    drafter.load_state_dict(sd, strict=embed_tokens is not None)
    d2t = drafter.d2t
    ids = torch.arange(d2t.numel()) + d2t
    if ids.min() < 0 or ids.max() >= arch.vocab_size:
        raise CheckpointError(
            f"{path}: d2t maps outside the target vocabulary [0, {arch.vocab_size})"
        )
    return drafter.to(device=device, dtype=dtype).eval(), meta
