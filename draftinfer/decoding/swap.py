"""Versioned, weights-only drafter updates between rounds (a *hot swap*), for every kind.

A drafter that follows a moving target (an RL policy, a fine-tuned target) gets new weights
while the runner serves: `SpecDecoder.update_drafter(update)` checks the update at once and
copies it into the running drafter's own parameters between two rounds. Nothing else changes:

- **The update format** is the export's own: the tensors of an export's `model.safetensors`
  under their serving names (`draftinfer.files.checkpoint.serving_tensors`, what an engine's
  weight-update API takes: vLLM's `update_weights` / `load_weights`, SGLang's
  `update_weights_from_*`), with an integer `version` and, optionally, the export's
  `config.json` (parsed). The shared target weights (embeddings, head) are never in it.
- **One mapping.** Names go through the kind's own loading seam, the one `load_drafter` uses
  (`DrafterSpec.wants_tensor`, `from_serving_names`, `validate_state_dict`), so a kind that
  loads gets swaps by registering; this module names no kind.
- **All or nothing.** Every check runs, and every tensor is cast and moved to the drafter's
  device (*staged*), before anything is copied: a bad update (unknown or missing names, a
  wrong shape or dtype, a non-finite value, another config, a version not above the running
  one) is a one-line `SwapError` and leaves the running drafter untouched.
- **Staged off the round's stream.** On CUDA the upload runs on a side stream from pinned
  memory (`non_blocking`), so staging during `generate` does not make the host wait for the
  round in flight (a pageable host-to-device copy would); an update already on the GPU is
  copied after the work queued on the round's stream so far (a device-side wait only).
- **In place.** `apply_staged` makes the round's stream wait for the staging and copies into
  the parameters' own storage (`copy_`), so a compiled drafter forward and a captured CUDA
  graph read the new values on their next replay: nothing is recompiled or recaptured. The
  copies are queued on the current stream, after every round already launched (with
  `pipeline=True` the round in flight finishes on the old weights) and before the next one.
- **Derived state.** What a proposer derives from the weights (the draft-to-target id map of
  a drafter with its own vocabulary, `d2t`) is refreshed in place too
  (`Proposer.weights_updated`).

What a swap does not do: the drafter KV a request in flight already wrote stays as the old
version wrote it (rebuilding it would need the target features of its whole prefix again).
Acceptance of that request's next rounds may be a little lower than a fresh request's;
losslessness never depends on the drafter, so every round stays lossless across the swap
(tested at T = 0 and T = 1, `tests/infer/test_swap.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftinfer.files.errors import CheckpointError, DraftError


class SwapError(DraftError):
    """A drafter update the running drafter cannot take (one line; nothing was copied)."""


@dataclass(frozen=True)
class DrafterUpdate:
    """A weights-only drafter update: `tensors` under the export's names (serving names, CPU
    or device), `version` (must exceed the running one), the export's `config.json` parsed
    (`config`, checked equal to the running drafter's when given) and what the publisher says
    about it (`meta`: steps, data seen; reported, never checked)."""

    version: int
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_export(
        cls, export_dir: str | Path, version: int, meta: dict[str, Any] | None = None
    ) -> DrafterUpdate:
        """The update an export directory holds (`config.json` + `model.safetensors`)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        d = Path(export_dir)
        try:
            config = json.loads((d / "config.json").read_text())
            tensors = load_file(str(d / "model.safetensors"))
        except (OSError, json.JSONDecodeError, SafetensorError) as e:
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise SwapError(f"cannot read the drafter update in {d}: {first}") from None
        return cls(int(version), tensors, config, dict(meta or {}))


@dataclass
class Staged:
    """An update checked and on the drafter's device: tensors under the module's names, in
    each parameter's dtype, and (CUDA) the event of the side stream that uploaded them."""

    tensors: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None = None
    device: torch.device | None = None


def stage_update(drafter: torch.nn.Module, update: DrafterUpdate, running_version: int) -> Staged:
    """Check `update` against the running `drafter` and stage its tensors (module docstring).
    Raises a one-line `SwapError`; touches nothing of `drafter`."""
    from draftinfer.files.checkpoint import parse_drafter_config
    from draftinfer.registry import spec_of

    spec, arch = spec_of(drafter), drafter.config
    where = f"drafter update v{update.version}"
    if update.version <= running_version:
        raise SwapError(
            f"{where}: version {update.version} is not above the running {running_version}"
        )
    try:
        if update.config is not None:
            spec2, arch2, _ = parse_drafter_config(update.config, where)
            have, got = _plain(arch.to_dict()), _plain(arch2.to_dict())
            if spec2.name != spec.name or have != got:
                diff = _first_difference(have, got)
                raise SwapError(
                    f"{where}: its config is not the running {spec.name} drafter's ({diff}); "
                    "a swap carries weights only, load a new drafter instead"
                )
        foreign = sorted(n for n in update.tensors if not spec.wants_tensor(arch, n))
        if foreign:
            raise SwapError(f"{where}: tensor(s) {', '.join(foreign[:3])} are not the drafter's")
        tensors = spec.from_serving_names(arch, dict(update.tensors))
        spec.validate_state_dict(arch, tensors, drafter, where)
    except CheckpointError as e:
        raise SwapError(str(e)) from None
    own = drafter.trainable_state_dict()
    export_dtype = update.config.get("torch_dtype") if update.config else None
    for name, t in tensors.items():
        p = own[name]
        if p.is_floating_point() != t.is_floating_point() or (
            not p.is_floating_point() and p.dtype != t.dtype
        ):
            raise SwapError(f"{where}: tensor {name} is {t.dtype}, the drafter's is {p.dtype}")
        if t.is_floating_point():
            if export_dtype and str(t.dtype).removeprefix("torch.") != export_dtype:
                raise SwapError(
                    f"{where}: tensor {name} is {t.dtype}, its config says {export_dtype}"
                )
    device = next(iter(own.values())).device
    if device.type != "cuda":
        staged = {n: t.to(dtype=own[n].dtype, copy=True) for n, t in tensors.items()}
        _check_finite(staged, where)
        return Staged(staged)
    side = torch.cuda.Stream(device)
    if any(t.is_cuda for t in tensors.values()):
        side.wait_stream(torch.cuda.current_stream(device))  # produced there: a device wait
    staged = {}
    with torch.cuda.stream(side):
        for name, t in tensors.items():
            src = t if t.is_cuda else t.pin_memory()
            staged[name] = src.to(device, non_blocking=True).to(own[name].dtype)
        # On the device, after the upload: a host check of a bf16 tensor runs at about
        # 0.3 GB/s a core, most of an 8B-sized drafter's staging. The host waits for the side
        # stream only: for the upload, not for the round in flight (unless the update was made
        # on the GPU, whose copy waits for the work queued before it).
        _check_finite(staged, where)
    return Staged(staged, side.record_event(), device)


def _check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """A one-line `SwapError` naming the first floating tensor holding NaN or Inf (checked in
    the drafter's dtype, where it lands), with one read back for all of them."""
    names = [n for n, t in tensors.items() if t.is_floating_point()]
    if not names:
        return
    ok = torch.stack([torch.isfinite(tensors[n]).all() for n in names]).cpu()
    if not bool(ok.all()):
        bad = names[int((~ok).nonzero()[0, 0])]
        raise SwapError(f"{where}: tensor {bad} holds NaN or Inf")


@torch.no_grad()
def apply_staged(drafter: torch.nn.Module, staged: Staged) -> None:
    """Copy staged tensors into the drafter's own parameters and buffers, in place, on the
    current stream (after it waited for the staging)."""
    own = drafter.trainable_state_dict()
    if staged.ready is not None:
        stream = torch.cuda.current_stream(staged.device)
        stream.wait_event(staged.ready)
    for name, t in staged.tensors.items():
        if staged.ready is not None:
            t.record_stream(stream)  # made on the side stream, read on this one
        own[name].copy_(t)
    for m in drafter.modules():  # anything a module derives from its weights, redone
        hook = getattr(m, "after_load_weights", None)
        if hook is not None:
            hook()


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict as JSON holds it (tuples as lists), for comparison."""
    return json.loads(json.dumps(d, default=str))


def _first_difference(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> str:
    """The first field (dotted path into nested dicts) where `b` differs from the running `a`."""
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            return _first_difference(x, y, f"{prefix}{key}.")
        return f"{prefix}{key}: {_short(y)} vs running {_short(x)}"
    return "kind differs"


def _short(v: Any, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."
