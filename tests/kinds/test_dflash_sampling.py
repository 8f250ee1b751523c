"""Lossless sampling with DFlash2's candidate selector and LiLiCorr's lattice (T2 and T4 for
their q: both sample among a slot's top-k candidates through the same proposer path).

At temperature > 0 the selector samples among the top-k candidates of a slot and returns q over
them (its scores, -inf elsewhere), so the drafted token is a fresh sample of a q that is zero off
the candidates; rejection sampling against p then keeps the emitted distribution exact. The
registered kind's sampling tests (`tests/infer/test_lossless_sampling.py`) run plain DFlash; these
run the selector through the same statistical harness (`tests/support/sampling_harness.py`): the
joint distribution of the first three emitted tokens of 11,000 seeded requests against the
target's, full-q verification with the selector's own drafts and with close drafts restricted to its
candidates, and the same tokens solo and inside a batch.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import tests.support.sampling_harness as harness
from draftinfer.decoding.engine import Request
from draftinfer.decoding.sampling import SamplingParams
from draftinfer.decoding.verify import Verifier
from tests.support.dflash import VARIANTS, randomize_heads
from tests.support.kind_factories import drafter_for
from tests.support.sampling_harness import (
    ALPHA,
    CLOSE,
    HARNESS_PROMPT,
    POWER,
    HarnessDecoder,
    enumerate_oracle,
    fits,
    harness_target_dir,
    speculative_samples,
)

N = 11_000
K = 3
SELECTOR = {**VARIANTS["dflash2"], "selector_top_k": 8}  # 8 candidates of the 32 tokens
LILICORR = {**VARIANTS["lilicorr"], "lilicorr_top_k": 8}
RERANKERS = {"selector": SELECTOR, "lilicorr": LILICORR}


@pytest.fixture(autouse=True)
def torch_reference_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as tests/infer/test_lossless_sampling.py


def _drafter(option: str = "selector"):
    """The re-ranker's drafter, LiLiCorr's transitions randomized past their zero init."""
    d = randomize_heads(drafter_for("dflash", harness_target_dir(), seed=11, **RERANKERS[option]))
    reranker = d.candidate_selector if option == "selector" else d.lattice_correlator
    assert reranker is not None and reranker.top_k == 8
    return d


def _target(rows: int):
    from draftinfer.files.loading import load_native_target

    return load_native_target(harness_target_dir(), max_batch=rows, max_seq_len=16)


def _check(label: str, tokens: torch.Tensor, oracle) -> None:
    failures = []
    for name, fit in fits(tokens, oracle).items():
        print(f"{label} {name:9s} {fit}")
        if not fit.pvalue > ALPHA:
            failures.append(f"{name}: {fit}")
        if name in ("joint", "pos1", "pos2", "pos3") and fit.power < POWER:
            failures.append(f"{name}: power {fit.power:.3f}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "params,option",
    [
        (SamplingParams(1.0), "selector"),
        (SamplingParams(1.0), "lilicorr"),
        pytest.param(SamplingParams(1.0, top_k=5), "selector", marks=pytest.mark.slow),
    ],
    ids=["t1", "t1-lilicorr", "topk5"],
)
def test_selector_q_keeps_sampling_exact(params, option):
    """The selector's own drafts and q (full-q verification; one-hot verification drafts the
    argmax and reads no q)."""
    oracle = enumerate_oracle(harness_target_dir(), HARNESS_PROMPT, params)
    seed0 = 7 * 10**8 + params.top_k * 10**5
    reqs = [replace(params, seed=seed0 + i) for i in range(N)]
    run = speculative_samples(_target(N), _drafter(option), K, "full", reqs, HARNESS_PROMPT)
    acc = run.accepted_first_round
    print(f"{option} own top_k={params.top_k}: first-round AL {float(acc.float().mean()) + 1:.2f}")
    assert float((acc >= 1).float().mean()) > 0.01  # some re-ranked drafts are accepted
    _check(f"{option} own top_k={params.top_k}", run.tokens, oracle)


class CandidateSteered(harness.SteeredVerifier):
    """The harness's close drafter restricted to the selector's candidates: where the exact p of
    a draft's context is known, the slot's logits become `log(0.85 p + 0.15 q_own)` on the
    candidates and stay -inf elsewhere, so q is supported on the candidates only (what the
    selector guarantees) while most drafts are accepted and rounds reject in the middle."""

    def draft_chooser(self, t, L):
        base = Verifier.draft_chooser(self, t, L)
        hist, n_out, which, modes = self.context
        chosen: list[torch.Tensor] = []

        def choose(logits: torch.Tensor, step: int):
            e = n_out + step
            x1 = hist[:, 0].clamp(min=0)
            x2 = hist[:, 1] if step == 0 else torch.where(n_out >= 2, hist[:, 1], chosen[0])
            x2 = x2.clamp(min=0)
            p = torch.zeros_like(logits, dtype=torch.float32)
            p = torch.where((e == 1)[:, None], self.p2[which, x1], p)
            p = torch.where((e == 2)[:, None], self.p3[which, x1, x2], p)
            known = (p.sum(-1) > 0)[:, None] & torch.isfinite(logits)
            close = torch.log(0.85 * p + 0.15 * torch.softmax(logits.float(), -1))
            choice, q = base(torch.where(known, close, logits.float()), step)
            chosen.append(choice)
            return choice, q

        return choose


def test_selector_support_with_close_drafts_keeps_sampling_exact(monkeypatch):
    params = SamplingParams(1.0)
    oracle = enumerate_oracle(harness_target_dir(), HARNESS_PROMPT, params)
    monkeypatch.setattr(harness, "SteeredVerifier", CandidateSteered)
    reqs = [replace(params, seed=8 * 10**8 + i) for i in range(N)]
    run = speculative_samples(
        _target(N),
        _drafter(),
        K,
        "full",
        reqs,
        HARNESS_PROMPT,
        oracles=[oracle],
        steer=[(0, CLOSE)] * N,
    )
    acc, prop = run.accepted_first_round, run.proposed_first_round
    deep = float((acc >= 2).float().mean())
    mid = float(((acc > 0) & (acc < prop)).float().mean())
    print(
        f"selector close: first-round AL {float(acc.float().mean()) + 1:.2f}, "
        f"{deep:.3f} of requests accept >= 2 drafts, {mid:.3f} reject mid-round"
    )
    # The candidates are the random drafter's top 8 of 32 tokens, so the target's likely
    # tokens are often not among them: few requests get deep, but enough (hundreds of the
    # 11,000; 3.2% measured) that a wrong q at the later positions would show in pos2 / pos3.
    assert deep > 0.02  # later positions reached through acceptance
    assert mid > 0.05  # rejections mid-round
    _check("selector close", run.tokens, oracle)


@pytest.mark.parametrize("option", list(RERANKERS))
def test_selector_q_is_a_distribution_over_its_candidates(option):
    """At temperature 1 the proposer's q of every slot sums to 1 over at most the 8
    candidates, and the draft is one of them."""
    from draftinfer.decoding.proposer import FirstPass
    from draftinfer.decoding.sampling import SamplingState
    from draftinfer.decoding.verify import Verifier

    d = _drafter(option)
    from draftinfer.kinds.dflash import DFlashProposer

    proposer = DFlashProposer(d, 4, 16, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    B, T = 4, 5
    F_ = d.config.features.width(d.config.hidden_size)
    fp = FirstPass(
        torch.arange(B),
        torch.randint(0, 32, (B, T), generator=g),
        torch.randn(B, T, F_, generator=g),
        torch.arange(T).expand(B, T),
        torch.arange(T).expand(B, T),
    )
    state = SamplingState.of([SamplingParams(1.0, seed=i) for i in range(B)], "cpu")
    L = torch.full((B,), T + 1)
    drafts, q = proposer.propose(
        proposer.admit(fp),
        torch.full((B,), K),
        K,
        Verifier("full", 32).draft_chooser(state.tensors, L),
    )
    assert q.shape == (B, K, 32)
    torch.testing.assert_close(q.sum(-1), torch.ones(B, K))
    assert bool(((q > 0).sum(-1) <= 8).all())
    assert bool((q.gather(-1, drafts[..., None]) > 0).all())


@pytest.mark.parametrize("option", list(RERANKERS))
def test_selector_same_tokens_solo_and_in_a_batch(option):
    """T4 with the re-ranker: a request's tokens do not depend on the rest of the batch."""
    d = _drafter(option)
    mine = [SamplingParams(1.0, seed=30 + i) for i in range(6)]
    others = [SamplingParams(0.0), SamplingParams(0.7, top_k=3, seed=9)]

    def run(params, prompts, max_batch):
        dec = HarnessDecoder(
            _target(max_batch), d, K, max_batch=max_batch, max_model_len=16, verify="full"
        )
        reqs = [Request(list(p), s, max_tokens=K + 3) for p, s in zip(prompts, params)]
        return [o.token_ids for o in dec.generate(reqs)[0]]

    together = run(mine, [HARNESS_PROMPT] * 6, 6)
    solo = [run([p], [HARNESS_PROMPT], 1)[0] for p in mine]
    mixed = run(others + mine, [[3, 1, 4], [2, 7]] + [HARNESS_PROMPT] * 6, 3)[2:]
    assert together == solo == mixed
