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
