"""Lossless speculative sampling over whole sequences, for every registered drafter kind.

The joint distribution of the first three emitted tokens of many seeded requests (and the
marginals at positions 1-3) is tested against the target's exact distribution, enumerated
through transformers' model (`tests/sampling_harness.py` has the oracle, the drafters, the
statistics and the power computation). Settings: every kind, K in {1, 3} for chain kinds and
{2, 4} for parallel ones, one-hot-q and full-q verification, temperature 1, top-k and top-p,
close drafters (rounds accept most drafts and reject in the middle) and adversarial ones (q
mass on low-p and p = 0 tokens), and each kind's drafter trained on the zoo target. Every
test asserts its power against a 0.20 -> 0.23 shift is at least 0.9 at alpha = 1e-4.

The default suite runs a covering subset of (setting, drafter) pairs per (kind, K, verify);
`pytest --exhaustive tests/infer/test_lossless_sampling.py` runs the same tests on every pair
with twice the samples (an option of the test, not a second test CI would skip).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from draftinfer.decoding.engine import Request
from draftinfer.decoding.sampling import SamplingParams
from draftinfer.decoding.verify import Verifier
from draftinfer.files.loading import load_native_target
from draftinfer.files.paths import resolve_path
from draftinfer.registry import drafter_spec, registered_kinds
from tests.support.kind_factories import drafter_for
from tests.support.sampling_harness import (
    ADVERSARIAL,
    ALPHA,
    CLOSE,
    HARNESS_PROMPT,
    OWN,
    POWER,
    HarnessDecoder,
    enumerate_oracle,
    fits,
    harness_target_dir,
    plain_samples,
    speculative_samples,
)

KINDS = registered_kinds()
N = 11_000  # samples per (setting, drafter) group: power >= 0.9 for df <= 31 (asserted)
SETTINGS = {
    "t1": SamplingParams(1.0),
    "topk5": SamplingParams(1.0, top_k=5),
    "topp0.8": SamplingParams(1.0, top_p=0.8),
}
DRAFTERS = {"close": CLOSE, "adversarial": ADVERSARIAL}
# The default suite's covering subset: per verification mode every setting and both drafters;
# across the two modes every (setting, drafter) pair.
COVER = {
    "full": [("t1", "close"), ("topk5", "adversarial"), ("topp0.8", "close")],
    "onehot": [("t1", "adversarial"), ("topk5", "close"), ("topp0.8", "adversarial")],
}
ALL_PAIRS = [(s, d) for s in SETTINGS for d in DRAFTERS]
TESTED = ("joint", "joint_all", "pos1", "pos2", "pos3")
POWERED = ("joint", "pos1", "pos2", "pos3")  # the tests whose power is asserted


def harness_ks(kind: str) -> tuple[int, int]:
    """K values per kind: chain kinds 1 and 3, parallel kinds 2 and 4."""
    kind = kind.split("+")[0]
    return (2, 4) if drafter_spec(kind).mode == "parallel drafting" else (1, 3)


CASES = [(kind, k) for kind in [*KINDS, "dflash+dspark"] for k in harness_ks(kind)]


def case_seed(kind: str, k: int, verify: str) -> int:
    """Disjoint request seeds per (kind, K, verify), so every run is an independent sample
    (with shared seeds, runs whose drafts do not depend on the kind would coincide)."""
    return 10**7 * (1 + 2 * CASES.index((kind, k)) + (verify == "full"))


@pytest.fixture(autouse=True)
def torch_reference_kernels(monkeypatch):
    """The engine's kernels run as their torch references here: the CPU Triton interpreter
    runs one program per request, far too slow for 10^4-request batches, and every kernel
    equals its reference bit-exactly (T3, tests/test_chain_inputs.py, test_parallel_layout.py)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def oracles():
    d = harness_target_dir()
    return {name: enumerate_oracle(d, HARNESS_PROMPT, p) for name, p in SETTINGS.items()}


# Options of a kind that change how drafts are chosen, run through the harness as their own
# cases: DSpark's Markov head makes draft j's q depend on draft j - 1 (randomized past its
# zero init, so the dependence is real).
OPTIONS = {"dflash+dspark": ("dflash", {"dspark": True, "markov_rank": 8})}


def harness_drafter(kind: str, k: int):
    # A kind whose train config has `n_predict` (modules) gets K of them, so K = N.
    if kind in OPTIONS:
        from tests.support.dflash import randomize_heads

        base, overrides = OPTIONS[kind]
        return randomize_heads(drafter_for(base, harness_target_dir(), seed=k, **overrides))
    return drafter_for(kind, harness_target_dir(), seed=k, n_predict=k)


def harness_target(rows: int):
    return load_native_target(harness_target_dir(), max_batch=rows, max_seq_len=16)


def check(group: str, run_tokens: torch.Tensor, oracle) -> list[str]:
    """Fit every statistic; return failure lines (and print one line per statistic)."""
    failures = []
    for name, fit in fits(run_tokens, oracle).items():
        print(f"{group:48s} {name:9s} {fit}")
        if name in TESTED and not fit.pvalue > ALPHA:
            failures.append(f"{group} {name}: {fit}")
        if name in POWERED and fit.power < POWER:
            failures.append(f"{group} {name}: power {fit.power:.3f} < {POWER}")
    return failures


def run_groups(kind, k, verify, pairs, oracles, n, seed0):
    """One engine run holding every (setting, drafter) group; returns failure lines."""
    names = list(SETTINGS)
    params, steer, groups = [], [], []
    for g, (setting, drafter) in enumerate(pairs):
        params += [replace(SETTINGS[setting], seed=seed0 + g * n + i) for i in range(n)]
        steer += [(names.index(setting), DRAFTERS[drafter])] * n
        groups.append((setting, drafter))
    start = time.perf_counter()
    run = speculative_samples(
        harness_target(len(params)),
        harness_drafter(kind, k),
        k,
        verify,
        params,
        HARNESS_PROMPT,
        oracles=[oracles[s] for s in names],
        steer=steer,
    )
    seconds = time.perf_counter() - start
    failures = []
    for g, (setting, drafter) in enumerate(groups):
        sl = slice(g * n, (g + 1) * n)
        acc, prop = run.accepted_first_round[sl], run.proposed_first_round[sl]
        label = f"{kind} K={k} {verify} {setting} {drafter}"
        print(
            f"{label:48s} first round: AL {float(acc.float().mean()) + 1:.2f}, "
            f">= 2 accepted {float((acc >= 2).float().mean()):.2f}, "
            f"rejected mid-round {float(((acc > 0) & (acc < prop)).float().mean()):.2f}"
        )
        failures += check(label, run.tokens[sl], oracles[setting])
        if drafter == "close" and k > 1:
            # Later positions are reached through acceptance (one-hot q accepts the argmax
            # draft with probability p(argmax) only), and rounds reject in the middle.
            floor = 0.3 if verify == "full" else 0.05
            assert float((acc >= 2).float().mean()) > floor, label
            assert float(((acc > 0) & (acc < prop)).float().mean()) > 0.1, label
    print(f"{kind} K={k} {verify}: {len(params)} requests in {seconds:.1f} s")
    return failures


SLOW = (pytest.mark.slow,)


def joint_cases() -> list:
    """(kind, K, verify) for every case; the quick loop (`-m "not slow"`) keeps one per kind,
    its larger K under full-distribution verification, and marks the rest slow."""
    return [
        pytest.param(
            kind, k, verify, marks=() if (k, verify) == (harness_ks(kind)[1], "full") else SLOW
        )
        for kind, k in CASES
        for verify in ("onehot", "full")
    ]


@pytest.mark.parametrize("kind,k,verify", joint_cases())
def test_joint_distribution_of_three_tokens(request, oracles, kind, k, verify):
    """The covering subset with N samples per group; `pytest --exhaustive` runs the same test
    on every (setting, drafter) pair with 2N samples and fresh seeds."""
    if request.config.getoption("--exhaustive"):
        pairs, n, seed0 = ALL_PAIRS, 2 * N, 10**9 + case_seed(kind, k, verify)
    else:
        pairs, n, seed0 = COVER[verify], N, case_seed(kind, k, verify)
    failures = run_groups(kind, k, verify, pairs, oracles, n, seed0=seed0)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_plain_sampling_matches_the_oracle(oracles, setting):
    """The oracle and the statistics themselves: plain sampling of the target passes."""
    tokens = plain_samples(harness_target_dir(), HARNESS_PROMPT, SETTINGS[setting], N, seed=7)
    assert not check(f"plain {setting}", tokens, oracles[setting])


# ---- a trained drafter: each kind's zoo export against the zoo target ----------------------
ZOO_SETTING = SamplingParams(1.0, top_k=6)


def zoo_prompt() -> list[int]:
    """A held-out zoo chat prompt (21 tokens) whose answer starts with a spread distribution
    (most likely 3-token continuation 0.064 under top-k 6) that the trained drafters still
    predict (first-round AL about 1.5 at K=3)."""
    from tests.support.prompts import zoo_prompts

    return zoo_prompts(60, seed=0)[26]


@pytest.mark.parametrize("kind", KINDS)
def test_trained_zoo_drafter_joint_distribution(kind_env, kind):
    env = kind_env(kind)
    k = max(k for k in harness_ks(kind) if k <= 4)
    prompt = zoo_prompt()
    zoo_dir = str(resolve_path("zoo:llama-tiny"))
    oracle = enumerate_oracle(zoo_dir, prompt, ZOO_SETTING)
    target = load_native_target(zoo_dir, max_batch=N, max_seq_len=len(prompt) + k + 4)
    params = [replace(ZOO_SETTING, seed=5 * 10**6 + i) for i in range(N)]
    run = speculative_samples(target, env["drafter"], k, "full", params, prompt)
    acc = run.accepted_first_round
    print(f"zoo {kind} K={k}: first-round AL {float(acc.float().mean()) + 1:.2f}")
    assert float(acc.float().mean()) > 0.3  # a trained drafter: drafts are accepted
    assert not check(f"zoo {kind} K={k} full top_k=6", run.tokens, oracle)


@pytest.mark.slow
def test_trained_dspark_drafter_joint_distribution(preset_run):
    """The `dspark` preset's export (shortened recipe), loaded from disk: its Markov-chained q
    under full-distribution verification at K = 4 (a block of 4 slots, the anchor's drafting),
    top-k 6, matches the zoo target's joint distribution, and its drafts are accepted."""
    from draftinfer.files.checkpoint import load_drafter

    zoo_dir = str(resolve_path("zoo:llama-tiny"))
    prompt, k = zoo_prompt(), 4
    summary = preset_run("dspark")
    target = load_native_target(zoo_dir, max_batch=N, max_seq_len=len(prompt) + k + 4)
    drafter, _ = load_drafter(summary["export_dir"], target.shared_weights())
    assert drafter.markov_head is not None and drafter.config.sample_from_anchor
    oracle = enumerate_oracle(zoo_dir, prompt, ZOO_SETTING)
    params = [replace(ZOO_SETTING, seed=6 * 10**6 + i) for i in range(N)]
    run = speculative_samples(target, drafter, k, "full", params, prompt)
    acc = run.accepted_first_round
    print(f"zoo dspark K={k}: first-round AL {float(acc.float().mean()) + 1:.2f}")
    assert float(acc.float().mean()) > 0.3
    assert not check(f"zoo dspark K={k} full top_k=6", run.tokens, oracle)


# ---- the same seed gives the same tokens in any batch (T4), steered drafts included --------
@pytest.mark.parametrize("kind,k", [(kind, harness_ks(kind)[1]) for kind in KINDS])
def test_same_tokens_solo_and_inside_other_batches(oracles, kind, k):
    """Harness requests (each setting, close and adversarial drafts) give the same tokens
    together, one at a time, and interleaved with other requests (greedy, other prompts,
    other sampling) under continuous batching in reverse order."""
    names = list(SETTINGS)
    mine = [
        (replace(SETTINGS[names[i % 3]], seed=90 + i), (i % 3, [CLOSE, ADVERSARIAL][i % 2]))
        for i in range(12)
    ]
    others = [
        (SamplingParams(0.0), (0, OWN)),
        (SamplingParams(1.0, seed=5), (0, CLOSE)),
        (SamplingParams(0.7, top_k=3, seed=6), (1, OWN)),
    ] * 3
    drafter = harness_drafter(kind, k)

    def run(entries, prompts, max_batch):
        dec = HarnessDecoder(
            harness_target(max_batch),
            drafter,
            k,
            max_batch=max_batch,
            max_model_len=16,
            verify="full",
            oracles=[oracles[s] for s in names],
            steer=[steer for _, steer in entries],
        )
        reqs = [
            Request(list(p), params, max_tokens=k + 3) for p, (params, _) in zip(prompts, entries)
        ]
        return [o.token_ids for o in dec.generate(reqs)[0]]

    together = run(mine, [HARNESS_PROMPT] * len(mine), len(mine))
    solo = [run([e], [HARNESS_PROMPT], 1)[0] for e in mine]
    # Interleave: other, mine, other, mine, ... with prompts of 2-5 tokens for the others.
    entries, prompts, is_mine = [], [], []
    for i, e in enumerate(mine):
        if i < len(others):
            entries.append(others[i])
            prompts.append([3, 1, 4, 1, 5][: 2 + i % 4])
            is_mine.append(False)
        entries.append(e)
        prompts.append(HARNESS_PROMPT)
        is_mine.append(True)
    mixed = run(entries[::-1], prompts[::-1], 5)[::-1]
    inside = [t for t, m in zip(mixed, is_mine) if m]
    assert together == solo == inside


# ---- the harness has power against correlated draft noise ----------------------------------
class SharedDraftNoise(Verifier):
    """A deliberately wrong verifier: every draft step (or parallel slot) of a round reads the
    noise of step 0, so later drafts are not fresh samples of their q."""

    def draft_chooser(self, t, L):
        choose = super().draft_chooser(t, L)
        return lambda logits, step: choose(logits, 0)


@pytest.mark.parametrize("kind,k", [(kind, harness_ks(kind)[1]) for kind in KINDS])
def test_harness_detects_draft_noise_shared_across_steps(oracles, kind, k, monkeypatch):
    """Sharing the draft noise across steps leaves the round's first token exact (position 2)
    and biases the next (position 3 / the joint): the harness must see it."""
    import tests.support.sampling_harness as harness

    class Mutant(harness.SteeredVerifier, SharedDraftNoise):
        pass

    monkeypatch.setattr(harness, "SteeredVerifier", Mutant)
    n = N
    params = [SamplingParams(1.0, seed=3 * 10**6 + i) for i in range(n)]
    run = speculative_samples(
        harness_target(n),
        harness_drafter(kind, k),
        k,
        "full",
        params,
        HARNESS_PROMPT,
        oracles=[oracles["t1"]],
        steer=[(0, CLOSE)] * n,
    )
    f = fits(run.tokens, oracles["t1"])
    print({name: str(fit) for name, fit in f.items()})
    assert f["pos2"].pvalue > ALPHA  # the first token of the round is still exact
    assert min(f["joint"].pvalue, f["pos3"].pvalue) < ALPHA
