"""`trainer.loss` (`drafttrain.objectives.loss_fns`): each loss against a hand computation on a 3-token
vocabulary (values and logit gradients, worked out below on paper), the fused chunked head +
loss against the plain autograd formula for every loss (groups, masked rows, row weights, a
trained head), D-PACE's row weights by hand, every kind's objective with every loss, and bad
names rejected in one line naming the key."""

from __future__ import annotations

import math

import pytest
import torch

from drafttrain.jobs.errors import ConfigError
from drafttrain.objectives.fused_ce import (
    linear_soft_ce,
    linear_soft_ce_ref,
    linear_soft_ce_rows,
    linear_soft_ce_rows_ref,
)
from drafttrain.objectives.loss_fns import LOSSES, row_loss
from drafttrain.objectives.losses import DraftLoss, metric_values
from drafttrain.objectives.position_loss import RowPart, score_positions
from drafttrain.registry import train_spec
from tests.support.kind_factories import small_drafter, small_target
from tests.support.utils import assert_close

# ---- the 3-token example -----------------------------------------------------------------
# Target p = (0.5, 0.3, 0.2), draft q = (0.2, 0.5, 0.3) (logits z = log q, so lse(z) = 0).
#   soft_ce = -(0.5 ln 0.2 + 0.3 ln 0.5 + 0.2 ln 0.3)              = 1.2534577
#   H(p)    = -(0.5 ln 0.5 + 0.3 ln 0.3 + 0.2 ln 0.2)              = 1.0296530
#   kl      = soft_ce - H(p)                                       = 0.2238047
#   tv      = 0.5 (|0.5-0.2| + |0.3-0.5| + |0.2-0.3|) = 0.5 * 0.6  = 0.3
#   alpha   = min: 0.2 + 0.3 + 0.2 = 0.7,  lam = exp(-3 * 0.7)     = 0.1224564
#   lk      = lam * kl + (1 - lam) * tv                            = 0.2906694
# Gradients with respect to z (d/dz of f(softmax(z)) = q * (g - <q, g>), g = df/dq):
#   soft_ce, kl: q - p                                             = (-0.3, 0.2, 0.1)
#   tv: g = 0.5 sign(q - p) = (-0.5, 0.5, 0.5), <q, g> = 0.3,
#       q * (g - 0.3) = (0.2 * -0.8, 0.5 * 0.2, 0.3 * 0.2)        = (-0.16, 0.10, 0.06)
#   lk: lam * (q - p) + (1 - lam) * tv's (lam detached)            = (-0.1771439, 0.1122457,
#                                                                      0.0648983)
P = [0.5, 0.3, 0.2]
Q = [0.2, 0.5, 0.3]
LAM = math.exp(-2.1)
HAND = {
    "soft_ce": (1.2534577, [-0.3, 0.2, 0.1]),
    "kl": (0.2238047, [-0.3, 0.2, 0.1]),
    "tv": (0.3, [-0.16, 0.10, 0.06]),
    "lk": (
        LAM * 0.2238047 + (1 - LAM) * 0.3,
        [LAM * a + (1 - LAM) * b for a, b in zip([-0.3, 0.2, 0.1], [-0.16, 0.10, 0.06])],
    ),
    "dpace": (1.2534577, [-0.3, 0.2, 0.1]),  # one position: soft_ce, weight 1 (below)
}


def _three_token():
    """hidden = log q through an identity head: the logits are log q."""
    h = torch.tensor([Q]).log().requires_grad_()
    w = torch.eye(3).requires_grad_()
    probs = torch.tensor([P])
    zero = torch.zeros(1, dtype=torch.long)
    return h, w, probs, zero, probs.argmax(-1), zero


@pytest.mark.parametrize("path", ["plain", "chunked"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_equals_hand_computation(name, path):
    value, grad = HAND[name]
    h, w, probs, rows, top1, group = _three_token()
    chunk = 1 if path == "chunked" else 1 << 26  # 1: one row per chunk, the fused path
    loss, hits, count = linear_soft_ce(
        h, w, probs, rows, top1, group, chunk_elements=chunk, loss=row_loss(name)
    )
    assert loss.item() == pytest.approx(value, abs=1e-6)
    assert hits.item() == 0 and count.item() == 1  # the draft's top-1 is token 1, p's is 0
    (gh,) = torch.autograd.grad(loss.sum(), h)  # identity head: d/dh = d/dz
    assert gh[0].tolist() == pytest.approx(grad, abs=1e-6)
    # The per-row variant (frozen head) gives the same row value and gradient.
    r = linear_soft_ce_rows(
        h, w.detach(), probs, rows, top1, chunk_elements=chunk, loss=LOSSES[name]
    )
    assert r.ce.item() == pytest.approx(value, abs=1e-6)
    (gh2,) = torch.autograd.grad(r.ce.sum(), h)
    assert gh2[0].tolist() == pytest.approx(grad, abs=1e-6)


def test_dpace_weights_by_hand():
    """One anchor, three positions with the same target p (top-1: token 0) and drafts
    q_k(0) = 0.8, 0.4, 0.6. alpha 0.5: s = (0.9, 0.7, 0.8), survival P = (0.9, 0.63, 0.504),
    weights = suffix sums of P = (2.034, 1.134, 0.504). Each position counts one row, so the
    loss is sum_k w_k ce_k and d/dz_k = w_k (q_k - p); `loss_k` logs the plain ce_k."""
    qs = [[0.8, 0.1, 0.1], [0.4, 0.3, 0.3], [0.6, 0.2, 0.2]]
    ws = [2.034, 1.134, 0.504]
    p = torch.tensor([P])
    hs = [torch.tensor([q]).log().requires_grad_() for q in qs]
    one = torch.zeros(1, dtype=torch.long)
    parts = [
        RowPart(h, one, one, one + k, torch.ones(1, dtype=torch.bool)) for k, h in enumerate(hs)
    ]
    out = DraftLoss(torch.device("cpu"))
    score_positions(out, parts, torch.eye(3), p, p.argmax(-1), LOSSES["dpace"], [9.0] * 3, 1)
    total, metrics = out.result(torch.ones(1, 4))
    ce = [-sum(a * math.log(b) for a, b in zip(P, q)) for q in qs]
    assert total.item() == pytest.approx(sum(w * c for w, c in zip(ws, ce)), abs=1e-5)
    m = metric_values(metrics)
    for k in range(3):
        assert m[f"loss_{k}"] == pytest.approx(ce[k], abs=1e-6)
    grads = torch.autograd.grad(total, hs)
    for k in range(3):
        want = [ws[k] * (a - b) for a, b in zip(qs[k], P)]
        assert grads[k][0].tolist() == pytest.approx(want, abs=1e-5)


def test_dpace_with_a_frozen_head_is_one_pass_over_the_head(monkeypatch):
    """A frozen head (what `trainer.freeze=[lm_head]` and MTP's shared head train): D-PACE's
    weights come from the same chunked pass that makes the rows' gradients, so each position
    computes its logits once, where a trained head needs a weights pass first. Same total,
    metrics and hidden gradients as the two-pass form (run here with the head trainable)."""
    import torch.nn.functional as F

    from drafttrain.objectives import fused_ce

    g = torch.Generator().manual_seed(5)
    N, H, V, K = 23, 8, 19, 3
    probs = torch.softmax(2 * torch.randn(N + K, V, generator=g), -1)
    top1 = probs.argmax(-1)
    w = torch.randn(V, H, generator=g)
    hs = [torch.randn(N, H, generator=g) for _ in range(K)]
    anchor = torch.arange(N)
    valid = [torch.rand(N, generator=g) > 0.2 for _ in range(K)]
    calls = {"linear": 0}
    linear = F.linear

    def counted(*a, **kw):
        calls["linear"] += 1
        return linear(*a, **kw)

    monkeypatch.setattr(F, "linear", counted)
    monkeypatch.setattr(fused_ce, "PLAIN_ELEMENTS", 0)  # the chunked path, one chunk a part
    results = []
    for trained in (False, True):
        leaves = [h.clone().requires_grad_() for h in hs]
        parts = [
            RowPart(h, anchor + 1 + k, anchor, torch.full((N,), k), v)
            for k, (h, v) in enumerate(zip(leaves, valid))
        ]
        head = w.clone().requires_grad_(trained)
        calls["linear"] = 0
        out = DraftLoss(torch.device("cpu"))
        score_positions(out, parts, head, probs, top1, LOSSES["dpace"], [9.0] * K, N)
        heads_computed = calls["linear"]
        total, metrics = out.result(torch.ones(1, N))
        results.append((total, metric_values(metrics), torch.autograd.grad(total, leaves)))
        assert heads_computed == (2 * K if trained else K)
    (t1, m1, g1), (t2, m2, g2) = results
    torch.testing.assert_close(t1, t2, rtol=1e-6, atol=1e-6)
    assert m1 == pytest.approx(m2, rel=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- the fused path against the plain formula, every loss ---------------------------------
def _case(N=37, H=16, V=29, M=41, G=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).requires_grad_()
    w = torch.randn(V, H, generator=g).requires_grad_()
    probs = torch.softmax(2 * torch.randn(M, V, generator=g), -1)
    rows = torch.randint(0, M, (N,), generator=g)
    group = torch.randint(-1, G, (N,), generator=g)  # -1: masked rows
    rw = torch.rand(N, generator=g)
    return h, w, probs, rows, probs.argmax(-1), group, rw


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("groups", [3, 1])
@pytest.mark.parametrize("name", ["kl", "tv", "lk"])
def test_fused_loss_equals_plain_formula(name, groups, weighted):
    """Per-group sums and the gradients of hidden and a trained head, chunked (gradients in
    forward with one group, recomputed in backward with several) against autograd through
    the materialized logits."""
    h, w, probs, rows, top1, group, rw = _case(G=groups)
    group = group.clamp(max=groups - 1)
    rw = rw if weighted else None
    loss = LOSSES[name]
    got = linear_soft_ce(h, w, probs, rows, top1, group, groups, 5 * 29, loss, rw)
    want = linear_soft_ce_ref(h, w, probs, rows, top1, group, groups, loss, rw)
    for a, b in zip(got, want):
        assert_close(a, b)
    up = torch.tensor([0.7, -1.3, 2.0])[:groups]
    ga = torch.autograd.grad((got[0] * up).sum(), (h, w))
    gb = torch.autograd.grad((want[0] * up).sum(), (h, w))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    frozen = linear_soft_ce_rows(h, w.detach(), probs, rows, top1, chunk_elements=5 * 29, loss=loss)
    ref = linear_soft_ce_rows_ref(h, w.detach(), probs, rows, top1, loss=loss)
    assert_close(frozen.ce, ref.ce)


def test_kl_is_soft_ce_minus_entropy_with_the_same_gradient():
    h, w, probs, rows, top1, group, _ = _case(G=1)
    group = group.clamp(max=0)
    ce = linear_soft_ce(h, w, probs, rows, top1, group, 1, 5 * 29, LOSSES["soft_ce"])[0]
    kl = linear_soft_ce(h, w, probs, rows, top1, group, 1, 5 * 29, LOSSES["kl"])[0]
    ent = (torch.special.entr(probs[rows]).sum(-1) * (group >= 0)).sum()
    assert_close(kl, ce - ent)
    assert kl.item() >= 0
    for a, b in zip(torch.autograd.grad(ce.sum(), (h, w)), torch.autograd.grad(kl.sum(), (h, w))):
        assert_close(a, b)


# ---- every kind's objective with every loss ------------------------------------------------
KIND_CFG = {
    "eagle3": {"ttt_steps": 3},
    "ptd": {"parallel_k": 3},
    "mtp": {},
    "dflash": {"block_size": 4, "gamma": 4.0, "num_anchors": 8, "num_layers": 1},
}


def _batch(V: int, B: int = 2, T: int = 19):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 13:] = 0
    lm = (torch.rand(B, T, generator=g) < 0.8).long() * am
    pos = torch.arange(T)[None].expand(B, T) * am
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "position_ids": pos}


@pytest.fixture(scope="module")
def frozen_target():
    return small_target()


@pytest.mark.parametrize("kind", sorted(KIND_CFG))
def test_every_kind_trains_with_every_loss(kind, frozen_target):
    """Each loss gives a finite loss and finite gradients; `kl` logs soft_ce minus the
    target's entropy per position (>= 0) with soft_ce's gradient; `dpace` logs soft_ce's
    per-position values but weighs the rows differently."""
    from drafttrain.frozen.target import batch_slots

    spec = train_spec(kind)
    cfg = spec.config_class(**KIND_CFG[kind])
    over = {"draft_vocab_size": 61} if kind in ("eagle3", "ptd") else {}
    d = small_drafter(kind, **over, **(KIND_CFG[kind] if kind == "dflash" else {}))
    d.train()
    batch = _batch(frozen_target.info.vocab_size)
    tgt = frozen_target.batch_output(batch, d.config.features)
    assert batch_slots(batch) is not None
    res = {}
    for name in LOSSES:
        torch.manual_seed(5)  # ptd's slots and dflash's anchors: the same draws per loss
        d.zero_grad()
        total, m = spec.objective(d, cfg, "eager", LOSSES[name])(batch, tgt)
        total.backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        assert torch.isfinite(total), name
        assert grads and all(torch.isfinite(g).all() for g in grads.values()), name
        res[name] = (total.item(), metric_values(m), grads)
    ce, kl, dp = res["soft_ce"], res["kl"], res["dpace"]
    pos = [k for k in ce[1] if k.startswith("loss_")]
    for k in pos:
        assert 0 <= kl[1][k] < ce[1][k], k
        assert dp[1][k] == pytest.approx(ce[1][k], rel=1e-6), k
    assert kl[0] < ce[0] and dp[0] != pytest.approx(ce[0])
    for n in ce[2]:
        torch.testing.assert_close(kl[2][n], ce[2][n], atol=1e-6, rtol=1e-5)
    for name in ("tv", "lk"):  # TV is in [0, 1]; LK mixes it with KL (<= soft_ce)
        hi = 1.0 if name == "tv" else max(ce[1][k] for k in pos)
        assert all(0 < res[name][1][k] <= hi for k in pos), name


def test_bad_loss_name_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as e:
        row_loss("focal")
    msg = str(e.value)
    assert "\n" not in msg and "trainer.loss" in msg and "'focal'" in msg


def test_dflash_row_loss_chosen_twice_is_rejected():
    spec = train_spec("dflash")
    d = small_drafter("dflash", block_size=4, gamma=4.0, num_layers=1)
    cfg = spec.config_class(block_size=4, gamma=4.0, loss="kl")
    with pytest.raises(ConfigError) as e:
        spec.objective(d, cfg, "eager", LOSSES["tv"])
    assert "drafter.loss=kl and trainer.loss=tv" in str(e.value)
    spec.objective(d, cfg, "eager", LOSSES["dpace"])  # kl + D-PACE weights: fine


def test_every_kind_names_a_known_default_loss():
    """`trainer.loss: null` trains with the kind's `default_loss`: a name `row_loss` knows."""
    from drafttrain.registry import load_train_kinds

    for name, spec in load_train_kinds().items():
        assert row_loss(spec.default_loss).name == spec.default_loss, name
