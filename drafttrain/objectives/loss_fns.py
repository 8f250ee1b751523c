"""The per-row draft losses `trainer.loss` names, one definition for every kind.

Each counted row has the drafter's logits `z [V]` (draft probabilities `q = softmax(z)`) and
the target's distribution `p [V]` over the same vocabulary (soft labels,
`drafttrain.frozen.head`). A loss is a function of `(z, p)` per row:

- `soft_ce`: `-sum_v p_v log q_v`, the soft cross-entropy (every kind's loss before this).
- `kl`: forward `KL(p || q) = soft_ce - H(p)`, `H(p) = -sum_v p_v log p_v`: the same gradient
  as `soft_ce`, but the logged value is 0 when the draft equals the target.
- `tv`: total variation `0.5 * sum_v |p_v - q_v|`. `1 - TV = sum_v min(p_v, q_v)` is the
  probability that speculative sampling at temperature 1 accepts one draft token (Leviathan
  et al. 2023), so TV is the per-token rejection rate itself.
- `lk`: the LK hybrid loss (arXiv 2602.23881, "LK losses"; speculators `lk_hybrid_loss`,
  SpecForge `lk_loss.py`, REFERENCES.md A2 "LK losses"): with the acceptance rate
  `alpha = sum_v min(p_v, q_v)` and `lam = exp(-eta * sg[alpha])`, `eta = 3`,
  `lam * KL(p || q) + (1 - lam) * TV(p, q)`. KL leads while the draft is poor (small
  `alpha`, its gradient does not vanish far from the target), TV (the acceptance rate
  itself) takes over as the draft gets close. `lam` is detached (`sg`), as in both sources.
- `REVERSE_KL` (not a `trainer.loss` name): reverse `KL(q || p) = sum_v q_v (log q_v - log p_v)`, mode-seeking: it pushes the
  draft's mass off tokens the target gives little, and weighs nothing the draft already
  ignores. Draft-OPD scores the rejected draft positions with it (`drafttrain.objectives.opd`).
  `log p` is floored at the fp32 `tiny` so a target zero is a large finite penalty, not inf.
- `dpace`: `soft_ce` with D-PACE per-position weights (`drafttrain.objectives.loss_weights`) instead
  of the kind's own per-position weights: an objective asks `weights_dpace` and weights its
  rows itself.

Each loss gives the per-row value and its gradient with respect to the logits in closed form
(`chunk`: what the fused linear + loss of `drafttrain.objectives.fused_ce` computes one chunk of rows at
a time, never the `[N, V]` logits) and a plain autograd formula (`ref`, the test oracle and
the small-problem path). For a loss `L(q)` with `g_v = dL / dq_v` the logit gradient is
`q * (g - sum_v q_v g_v)`; for `soft_ce` (`g = -p / q`) this is `q * sum(p) - p`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafttrain.jobs.errors import ConfigError

_TINY = torch.finfo(torch.float32).tiny  # the floor of log p in the reverse KL
LK_ETA = 3.0  # arXiv 2602.23881's eta (speculators and SpecForge default)


# ---- closed forms per chunk: zf [c, V] fp32 logits, lse [c], pf [c, V] fp32 labels ----------
def _ce_value(zf, lse, pf):
    return ((lse[:, None] - zf) * pf).sum(-1)  # -sum p * log_softmax(z)


def _ce_grad(zf, lse, pf):
    q = torch.exp(zf - lse[:, None])
    return q * pf.sum(-1, keepdim=True) - pf


def _kl_value(zf, lse, pf):
    return _ce_value(zf, lse, pf) - torch.special.entr(pf).sum(-1)  # entr = -p log p, 0 at 0


def _tv_parts(zf, lse, pf):
    q = torch.exp(zf - lse[:, None])
    return q, 0.5 * (pf - q).abs().sum(-1)


def _tv_value(zf, lse, pf):
    return _tv_parts(zf, lse, pf)[1]


def _tv_grad(zf, lse, pf):
    q = torch.exp(zf - lse[:, None])
    g = 0.5 * torch.sign(q - pf)  # d TV / d q
    return q * (g - (q * g).sum(-1, keepdim=True))


def _rkl_parts(zf, lse, pf):
    logq = zf - lse[:, None]
    q = torch.exp(logq)
    diff = logq - torch.log(pf.clamp_min(_TINY))
    return q, diff, (q * diff).sum(-1)


def _rkl_value(zf, lse, pf):
    return _rkl_parts(zf, lse, pf)[2]


def _rkl_grad(zf, lse, pf):
    # g_v = d KL(q||p) / d q_v = log q_v - log p_v + 1; the constant cancels in q * (g - q.g).
    q, diff, value = _rkl_parts(zf, lse, pf)
    return q * (diff - value[:, None])


def _lk_lambda(zf, lse, pf):
    q = torch.exp(zf - lse[:, None])
    return torch.exp(-LK_ETA * torch.minimum(pf, q).sum(-1))  # [c], a constant (sg[alpha])


def _lk_value(zf, lse, pf):
    lam = _lk_lambda(zf, lse, pf)
    return lam * _kl_value(zf, lse, pf) + (1 - lam) * _tv_value(zf, lse, pf)


def _lk_grad(zf, lse, pf):
    lam = _lk_lambda(zf, lse, pf)[:, None]
    return lam * _ce_grad(zf, lse, pf) + (1 - lam) * _tv_grad(zf, lse, pf)


# ---- plain autograd formulas: logits [N, V] (any dtype), p [N, V] -> [N] fp32 ---------------
def _ce_ref(logits, p):
    return -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1)


def _kl_ref(logits, p):
    return _ce_ref(logits, p) - torch.special.entr(p.float()).sum(-1)


def _tv_ref(logits, p):
    return 0.5 * (p.float() - torch.softmax(logits.float(), dim=-1)).abs().sum(-1)


def _rkl_ref(logits, p):
    logq = F.log_softmax(logits.float(), dim=-1)
    return (logq.exp() * (logq - torch.log(p.float().clamp_min(_TINY)))).sum(-1)


def _lk_ref(logits, p):
    q = torch.softmax(logits.float(), dim=-1)
    lam = torch.exp(-LK_ETA * torch.minimum(p.float(), q).sum(-1)).detach()
    return lam * _kl_ref(logits, p) + (1 - lam) * _tv_ref(logits, p)


@dataclass(frozen=True)
class RowLoss:
    """One `trainer.loss`: per-row value and logit gradient (module docstring)."""

    name: str
    value: Callable  # (zf [c, V], lse [c], pf [c, V]) -> [c] fp32
    grad: Callable  # (zf, lse, pf) -> [c, V] fp32: d value / d z, per row
    ref: Callable  # (logits [N, V], p [N, V]) -> [N] fp32, differentiable
    # Weight the rows by D-PACE (per anchor, over its draft positions) instead of the kind's
    # own per-position weights.
    weights_dpace: bool = False
    # Where the value equals soft_ce's: the plain path then stays the formula training
    # always used (bit for bit: the golden losses of the tiny recipes).
    is_soft_ce: bool = False


SOFT_CE = RowLoss("soft_ce", _ce_value, _ce_grad, _ce_ref, is_soft_ce=True)
LOSSES: dict[str, RowLoss] = {
    "soft_ce": SOFT_CE,
    "kl": RowLoss("kl", _kl_value, _ce_grad, _kl_ref),
    "tv": RowLoss("tv", _tv_value, _tv_grad, _tv_ref),
    "lk": RowLoss("lk", _lk_value, _lk_grad, _lk_ref),
    "dpace": RowLoss("dpace", _ce_value, _ce_grad, _ce_ref, weights_dpace=True, is_soft_ce=True),
}


# Not a `trainer.loss` choice: the reverse KL alone does not train a drafter from scratch (it
# never moves mass onto a token the draft gives ~0); Draft-OPD uses it beside forward KL.
REVERSE_KL = RowLoss("rkl", _rkl_value, _rkl_grad, _rkl_ref)


def row_loss(name: str) -> RowLoss:
    """The `trainer.loss` named `name`; a one-line `ConfigError` naming the key otherwise."""
    if name not in LOSSES:
        raise ConfigError(f"trainer.loss must be one of {sorted(LOSSES)}, got {name!r}")
    return LOSSES[name]
