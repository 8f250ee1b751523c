"""The optimizer of the trainer, and the precision its state is kept in
(`trainer.param_dtype`, `trainer.master_weights`, `trainer.optimizer_dtype`).

- fp32 parameters and fp32 moments (the default, and what the CPU recipes use):
  `torch.optim.AdamW`, unchanged.
- anything else: `MixedAdamW`, the same AdamW update (decoupled weight decay, bias
  correction) with
  - *master weights*: an fp32 copy of every lower-precision parameter in the optimizer state;
    the update is applied to it and the parameter receives its rounded value. Without it, an
    update far below half a bf16 ulp of the weight (lr 1e-4 on an O(1) weight) is rounded
    away and training stalls;
  - moments (`exp_avg`, `exp_avg_sq`) stored in `optimizer_dtype` (the update itself is
    computed in fp32).

Memory per trainable parameter (bytes): fp32 params + fp32 AdamW = 4 + 4 (grad) + 8 = 16;
bf16 params + fp32 masters + fp32 moments = 2 + 2 + 4 + 8 = 16; with bf16 moments 12; bf16
params without masters, bf16 moments = 8. Activations are what bf16 parameters save most:
no fp32 weights to cast per use, bf16 residual streams.
"""

from __future__ import annotations

import math
from itertools import chain

import torch

from draftinfer.decoding.compiled import cuda_compiled_call
from drafttrain.jobs.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_of(name: str, field: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"trainer.{field} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


class MixedAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights for lower-precision parameters and moments in
    `state_dtype` (module docstring). Its state survives `state_dict` / `load_state_dict` in
    its own dtypes (torch's loader would cast it to the parameters' dtype)."""

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        master_weights: bool = True,
        state_dtype: torch.dtype = torch.float32,
    ):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.master_weights, self.state_dtype = master_weights, state_dtype

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
            if self.master_weights and p.dtype != torch.float32:
                st["master"] = p.detach().float().clone()
        return st

    def master_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master copy of `p` (None: `p` is its own master, or has no state yet)."""
        return self.state[p].get("master") if p in self.state else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self._state(p)
                st["step"] += 1
                t = st["step"]
                # The step-dependent scalars as device tensors (fills, no copy): a compiled
                # update is not recompiled when the learning rate changes.
                step_size, bias2, decay = (
                    torch.full((), x, dtype=torch.float32, device=p.device)
                    for x in (-lr / (1 - b1**t), math.sqrt(1 - b2**t), 1 - lr * wd)
                )
                args = (p.grad, st["exp_avg"], st["exp_avg_sq"], step_size, bias2, decay)
                consts = (b1, b2, eps)
                if "master" in st:
                    cuda_compiled_call(_adamw_master, p, st["master"], *args, *consts)
                else:
                    cuda_compiled_call(_adamw, p, *args, *consts)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # Restore the saved dtypes (the base class casts floating state to the param dtype).
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(p.device, copy=True)


def _adamw_math(w, grad, exp_avg, exp_avg_sq, step_size, bias2, decay, b1, b2, eps):
    """One AdamW update in fp32 -> (new weight, new moments), all fp32 (`MixedAdamW.step`)."""
    g = grad.float()
    m = exp_avg.float().lerp(g, 1 - b1)
    v = exp_avg_sq.float() * b2 + g * g * (1 - b2)
    denom = v.sqrt() / bias2 + eps
    return w.float() * decay + step_size * (m / denom), m, v


def _adamw_master(p, master, grad, exp_avg, exp_avg_sq, step_size, bias2, decay, b1, b2, eps):
    """The update applied to the fp32 `master`; `p` gets its rounding. In place; on CUDA one
    compiled kernel per parameter shape (`cuda_compiled_call`)."""
    w, m, v = _adamw_math(master, grad, exp_avg, exp_avg_sq, step_size, bias2, decay, b1, b2, eps)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    master.copy_(w)
    p.copy_(w)


def _adamw(p, grad, exp_avg, exp_avg_sq, step_size, bias2, decay, b1, b2, eps):
    """The update applied to `p` itself (fp32, or lower precision without masters)."""
    w, m, v = _adamw_math(p, grad, exp_avg, exp_avg_sq, step_size, bias2, decay, b1, b2, eps)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    p.copy_(w)


def build_optimizer(params: list, tc) -> torch.optim.Optimizer:
    """The trainer's optimizer for `params` (already in `trainer.param_dtype`): parameters, or
    param groups (dicts with `params` and their own `lr`, `weight_decay`, ...)."""
    state = dtype_of(tc.optimizer_dtype, "optimizer_dtype")
    flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    low = any(p.dtype != torch.float32 for p in flat)
    if state == torch.float32 and not low:
        return torch.optim.AdamW(
            params, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay
        )
    return MixedAdamW(
        params,
        lr=tc.lr,
        betas=tuple(tc.betas),
        weight_decay=tc.weight_decay,
        master_weights=tc.master_weights,
        state_dtype=state,
    )


def with_master_weights(
    own: dict[str, torch.Tensor], drafter: torch.nn.Module, optimizer
) -> dict[str, torch.Tensor]:
    """A drafter state dict with every parameter that has an fp32 master replaced by it (so a
    checkpoint, and an fp32 export of it, holds the unrounded weights)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    if not isinstance(opt, MixedAdamW):
        return own
    out = dict(own)
    for name, p in drafter.named_parameters():
        master = opt.master_of(p)
        if master is not None and name in out:
            out[name] = master
    return out
