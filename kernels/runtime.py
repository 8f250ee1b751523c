"""Where Triton kernels run: natively on CUDA, or through the Triton interpreter on CPU.

This folder is installed under the import name `draftkernels` (see pyproject.toml) and has
no `__init__.py`: a top-level *regular* package named `kernels` would shadow Hugging Face's
hub-kernels library, which transformers probes for by that name (DESIGN section 5).
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device: torch.device) -> bool:
    """Run the Triton kernel (else the torch reference): on CUDA, or on CPU when interpreting."""
    if not triton_available():
        return False
    return device.type == "cuda" or interpreting()


def check_tensor(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple) -> None:
    """Launcher argument check shared by the kernels: type, dtype, exact shape, contiguity."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


# Programmatic dependent launch (Hopper and later): a kernel launched with it may be scheduled
# while the kernel before it in the stream is still running; it waits (`griddepcontrol.wait`:
# the earlier kernel complete, its writes visible) before it touches memory an earlier kernel
# may write, and then lets the kernel after it be scheduled (`launch_dependents`). Kernels
# without it in between are serialised as usual. Off at import; `enable_pdl()` or
# `DRAFTKERNELS_PDL=1` turns it on for these kernels and inductor's together (ours alone,
# between inductor's kernels launched the usual way, measured slower: docs/results.md), and
# the runner does so for its job when it compiles on CUDA
# (`draftinfer.evaluation.config.InferConfig.pdl`).
PDL = {"on": False}


def enable_pdl(on: bool = True) -> None:
    """Launch these kernels with programmatic dependent launch, and have inductor generate
    and launch its kernels so (`torch._inductor.config.triton.enable_pdl`), for what is
    compiled and captured from now on."""
    import torch._inductor.config as inductor_config

    PDL["on"] = bool(on)
    if hasattr(inductor_config.triton, "enable_pdl"):
        inductor_config.triton.enable_pdl = bool(on)


def pdl(device: torch.device) -> bool:
    """Whether kernels launched for `device` use programmatic dependent launch (`PDL`): on,
    CUDA (not the interpreter) and compute capability 9 or later."""
    return (
        PDL["on"]
        and device.type == "cuda"
        and not interpreting()
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


if os.environ.get("DRAFTKERNELS_PDL", "0") == "1":
    enable_pdl()


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """Under `PDL`: wait for the kernels before this one (their writes visible), then let
        the next kernel be scheduled. Nothing else, and nothing at all without `PDL`. Every
        load of memory an earlier kernel may have written, and every store, comes after it."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
