"""Random TTT attention inputs (`drafttrain.objectives.ttt`'s backends' contract) with gradients on."""

from __future__ import annotations

import torch


def ttt_inputs(B, T, nh, nkv, D, n_extra, device="cpu", dtype=torch.float32):
    """(q `[B, T, nh, D]`, k0, v0 `[B, T, nkv, D]`, extra [(k_s, v_s)] * n_extra, leaves: all
    of them in order, each requiring grad)."""

    def r(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    q, k0, v0 = r(B, T, nh, D), r(B, T, nkv, D), r(B, T, nkv, D)
    extra = [(r(B, T, nkv, D), r(B, T, nkv, D)) for _ in range(n_extra)]
    leaves = [q, k0, v0] + [t for kv in extra for t in kv]
    for t in leaves:
        t.requires_grad_()
    return q, k0, v0, extra, leaves


def grads_of(out: torch.Tensor, leaves: list[torch.Tensor], up: torch.Tensor):
    """d (out * up).sum() / d leaves."""
    return torch.autograd.grad((out.float() * up).sum(), leaves)
