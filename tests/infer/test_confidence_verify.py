"""Confidence-driven verification (`SpecDecoder(verify_threshold=)`, `draftinfer.decoding.confidence`)
and the calibration report (`draftinfer.evaluation.calibration`).

- the cut: cumulative confidence below tau stops the block, hand-computed; a cut at slot c
  makes the verify forward score exactly c + 1 live rows and the round verify c drafts;
- the seam: DSpark's head gives the confidences, every other kind the derived one;
- lossless at T = 0: tokens equal plain greedy decoding at three thresholds, on a trained zoo
  drafter whose drafts are accepted, with cuts happening;
- lossless at T = 1: the joint distribution of three emitted tokens (the sampling harness)
  with cuts at every slot;
- the metrics (events, ECE, AUROC, Brier, round cost, sweep) against hand-computed values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import pytest
import torch

from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.confidence import check_threshold, cut_lengths, derived_confidence
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.sampling import SamplingParams
from draftinfer.evaluation.calibration import (
    auroc,
    brier_score,
    calibration_report,
    confidence_events,
    expected_calibration_error,
    round_cost_at,
    threshold_sweep,
)
from draftinfer.files.loading import load_native_target
from draftinfer.files.paths import resolve_path
from draftinfer.registry import registered_kinds
from tests.support.prompts import zoo_prompts
from tests.support.tiny_models import untrained_drafter

MAX_LEN = 384


# ---- the cut ------------------------------------------------------------------------------
def test_cut_stops_at_the_first_cumulative_confidence_below_tau():
    conf = torch.tensor(
        [
            [0.9, 0.9, 0.9, 0.9],  # cumulative 0.9 0.81 0.729 0.656
            [0.5, 1.0, 1.0, 1.0],  # 0.5 from the first slot on
            [1.0, 1.0, 1.0, 1.0],
            [0.6, 0.9, 0.1, 1.0],  # 0.6 0.54 0.054 0.054
        ]
    )
    assert cut_lengths(conf, 0.7).tolist() == [3, 0, 4, 0]
    assert cut_lengths(conf, 0.5).tolist() == [4, 4, 4, 2]
    assert cut_lengths(conf, 0.05).tolist() == [4, 4, 4, 4]
    # Once below, always cut: a later confidence cannot reopen the block (NaN counts below).
    assert cut_lengths(torch.tensor([[0.4, float("nan"), 1.0]]), 0.3).tolist() == [1]


def test_derived_confidence_is_the_drafters_top_probability():
    """The argmax draft's probability (what a greedy / one-hot drafter drafts), whatever token
    a sampling chooser then picks."""
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 3.0, 1.0]]])  # [1, 3, 3]
    e = torch.exp(torch.tensor([2.0, 3.0, 1.0]))
    want = torch.tensor([[e[0] / (e[0] + 2), 1 / 3, e[1] / (e[1] + e[2] + 1)]])
    torch.testing.assert_close(derived_confidence(logits), want)


def test_threshold_out_of_range_is_a_one_line_error():
    assert check_threshold(None) is None and check_threshold(1) == 1.0
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"verify_threshold must be in \(0, 1\]"):
            check_threshold(bad)


class FixedConfidence:
    """Stands in for `proposer.confidences`: the same `[B, K]` every round."""

    def __init__(self, conf: torch.Tensor):
        self.conf = conf

    def __call__(self) -> torch.Tensor:
        return self.conf


@pytest.mark.parametrize("c", [0, 1, 2])
def test_a_cut_at_slot_c_verifies_exactly_c_drafts(zoo_target, c):
    """Confidence 1 up to slot c and 0 from there: every round verifies c drafts (fewer only
    where the length cap is smaller), the verify forward scores exactly c + 1 live rows of its
    K + 1 (the rest are padding: cache index -1) and the tokens are plain greedy's."""
    k, ps = 4, zoo_prompts(3, seed=41)
    d = untrained_drafter("eagle3", resolve_path("zoo:llama-tiny"), zoo_target)
    dec = SpecDecoder(zoo_target, d, k, max_batch=3, max_model_len=MAX_LEN, verify_threshold=0.5)
    conf = torch.zeros(3, k)
    conf[:, :c] = 1.0
    dec.proposer.confidences = FixedConfidence(conf)
    live_rows = []
    fwd = dec._target_fwd

    def spy(target, ids, rows, cache_pos, *rest):
        live_rows.append((cache_pos >= 0).sum(1).tolist())
        return fwd(target, ids, rows, cache_pos, *rest)

    dec._target_fwd = spy
    outs, _ = dec.generate([Request(p, max_tokens=12) for p in ps])
    assert [o.token_ids for o in outs] == greedy_generate(zoo_target, ps, 12)
    for o in outs:
        assert o.proposed and all(p <= c for p in o.proposed)
        assert o.proposed[0] == c  # the first round is far from any cap
        assert all(a <= p for a, p in zip(o.accepted, o.proposed))
    # Every live row of every round: the pending token plus at most c drafts.
    assert live_rows and all(n <= c + 1 for rnd in live_rows for n in rnd)
    assert any(n == c + 1 for n in live_rows[0])


@pytest.mark.parametrize("kind", registered_kinds())
def test_every_kind_is_lossless_with_mixed_cuts_in_a_batch(zoo_target, kind):
    """Each kind's proposer state after a cut round (KV past the cut, MTP's re-prefill cache,
    DFlash's block) is what a rejection there leaves: rows cut at 0, 1, 2 and 3 of K = 3 in one
    batch, greedy tokens equal to plain decoding, each row verifying its cut."""
    from tests.support.kind_factories import servable

    d = untrained_drafter(kind, resolve_path("zoo:llama-tiny"), zoo_target)
    k = 3 if servable(kind, d.config, 3) else 2
    ps = zoo_prompts(4, seed=45)
    dec = SpecDecoder(zoo_target, d, k, max_batch=4, max_model_len=MAX_LEN, verify_threshold=0.5)
    conf = (torch.arange(k)[None] < torch.tensor([0, 1, 2, 3])[:, None]).float()  # [4, k]
    dec.proposer.confidences = FixedConfidence(conf)
    outs, _ = dec.generate([Request(p, max_tokens=10) for p in ps])
    assert [o.token_ids for o in outs] == greedy_generate(zoo_target, ps, 10)
    assert [o.proposed[0] for o in outs] == [min(c, k) for c in range(4)]


def test_dspark_head_gives_the_confidences():
    """The seam: a DSpark drafter's `confidences()` is its head's sigmoid, recorded per round,
    and no derived confidence is computed beside it."""
    from tests.support.dflash import variant_drafter
    from tests.support.kind_factories import small_embeddings, small_target_dir

    d = variant_drafter("dspark")
    target = load_native_target(small_target_dir("1d"), max_batch=2, max_seq_len=64)
    from draftinfer.registry import drafter_spec

    drafter_spec("dflash").attach_shared(d, small_embeddings(d))
    dec = SpecDecoder(target, d, 3, max_batch=2, max_model_len=64, record_confidence=True)
    outs, _ = dec.generate([Request([3, 5, 7, 9, 11], max_tokens=8)])
    head = dec.proposer.confidence
    assert head is not None and dec.proposer.confidences() is head
    assert dec.proposer._derived is None  # no derived confidence computed beside the head
    assert outs[0].confidences and all(len(c) == 3 for c in outs[0].confidences)


@pytest.mark.parametrize("kind", registered_kinds())
def test_every_kind_records_a_derived_confidence(zoo_target, kind):
    """Without a head of its own, a kind's `confidences()` is the derived one: K values in
    (0, 1] per round, the drafter's top probability, recorded per round."""
    from tests.support.kind_factories import servable

    d = untrained_drafter(kind, resolve_path("zoo:llama-tiny"), zoo_target)
    k = 3 if servable(kind, d.config, 3) else 2
    dec = SpecDecoder(zoo_target, d, k, max_batch=2, max_model_len=MAX_LEN, record_confidence=True)
    outs, _ = dec.generate([Request(zoo_prompts(1, seed=42)[0], max_tokens=8)])
    assert dec.proposer.confidence is None and dec.proposer._derived is not None
    assert outs[0].confidences and all(len(c) == k for c in outs[0].confidences)
    conf = [c for rnd in outs[0].confidences for c in rnd]
    assert all(0.0 < c <= 1.0 for c in conf), conf


# ---- lossless at T = 0 with a trained drafter ---------------------------------------------
@pytest.mark.parametrize("tau", [0.05, 0.3, 0.7])
def test_greedy_tokens_equal_plain_decoding_with_cuts(kind_env, tau):
    """A trained zoo eagle3 drafter (derived confidence), K = 4, batch 6: the same tokens as
    plain greedy decoding; the cut happened (rounds verified fewer drafts than their cap) and
    the drafter's drafts were accepted."""
    env = kind_env("eagle3")
    target, k, ps = env["target"], 4, zoo_prompts(6, seed=43)
    plain = greedy_generate(target, ps, 32)
    full = SpecDecoder(target, env["drafter"], k, max_batch=6, max_model_len=MAX_LEN)
    full_outs, _ = full.generate([Request(p, max_tokens=32) for p in ps])
    dec = SpecDecoder(
        target, env["drafter"], k, max_batch=6, max_model_len=MAX_LEN, verify_threshold=tau
    )
    outs, _ = dec.generate([Request(p, max_tokens=32) for p in ps])
    assert [o.token_ids for o in outs] == plain
    assert [o.token_ids for o in full_outs] == plain
    proposed = [p for o in outs for p in o.proposed]
    accepted = [a for o in outs for a in o.accepted]
    # Rounds with at least 5 tokens left to the cap draft K; fewer verified means a cut.
    assert sum(p < k for p in proposed) >= 5, proposed
    full_acc = [a for o in full_outs for a in o.accepted]
    assert sum(full_acc) / len(full_acc) > 0.5, full_acc  # AL floor of the whole block: 1.5
    assert sum(accepted) >= 20, accepted  # the cut rounds accept drafts too
    rows = sum(p + 1 for p in proposed) / len(proposed)
    full_rows = sum(p + 1 for o in full_outs for p in o.proposed) / len(full_acc)
    print(
        f"tau={tau}: AL {1 + sum(accepted) / len(accepted):.2f}, verified rows/round "
        f"{rows:.2f} (whole block: AL {1 + sum(full_acc) / len(full_acc):.2f}, {full_rows:.2f})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("tau", [0.1, 0.3, 0.6])
def test_dspark_head_cut_is_lossless_at_t0(preset_run, zoo_target, tau):
    """The `dspark` preset's export (its confidence head drives the cut): plain greedy tokens."""
    from draftinfer.files.checkpoint import load_drafter

    d, _ = load_drafter(preset_run("dspark")["export_dir"], zoo_target.shared_weights())
    assert d.confidence_head is not None
    ps = zoo_prompts(6, seed=44)
    dec = SpecDecoder(zoo_target, d, 4, max_batch=6, max_model_len=MAX_LEN, verify_threshold=tau)
    outs, _ = dec.generate([Request(p, max_tokens=32) for p in ps])
    assert [o.token_ids for o in outs] == greedy_generate(zoo_target, ps, 32)
    proposed = [p for o in outs for p in o.proposed]
    assert any(p < 4 for p in proposed) and sum(a for o in outs for a in o.accepted) > 0


# ---- lossless at T = 1: the joint distribution with cuts ----------------------------------
@pytest.fixture
def torch_reference_kernels(monkeypatch):
    """The engine's kernels as their torch references (as tests/infer/test_lossless_sampling.py
    runs them): the CPU Triton interpreter is far too slow for 10^4-request batches."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def cut_joint_run(tau: float, n: int = 11_000, seed0: int = 7 * 10**7):
    """The sampling harness (tests/support/sampling_harness.py): eagle3 at K = 3, close drafts
    sampled from q under full-q verification at temperature 1, the block cut at `tau`; ->
    (the run, its fits against the target's exact distribution)."""
    from tests.support.kind_factories import drafter_for
    from tests.support.sampling_harness import (
        CLOSE,
        HARNESS_PROMPT,
        enumerate_oracle,
        fits,
        harness_target_dir,
        speculative_samples,
    )

    oracle = enumerate_oracle(harness_target_dir(), HARNESS_PROMPT, SamplingParams(1.0))
    target = load_native_target(harness_target_dir(), max_batch=n, max_seq_len=16)
    drafter = drafter_for("eagle3", harness_target_dir(), seed=3, n_predict=3)
    params = [replace(SamplingParams(1.0), seed=seed0 + i) for i in range(n)]
    start = time.perf_counter()
    run = speculative_samples(
        target,
        drafter,
        3,
        "full",
        params,
        HARNESS_PROMPT,
        oracles=[oracle],
        steer=[(0, CLOSE)] * n,
        verify_threshold=tau,
    )
    print(f"{n} requests in {time.perf_counter() - start:.1f} s")
    return run, fits(run.tokens, oracle)


def test_joint_distribution_with_confidence_cuts(torch_reference_kernels):
    """The derived confidence cuts rounds at every slot (0, 1 and 2 drafts verified of 3) and
    cut rounds accept drafts, while the first three emitted tokens' joint distribution (and
    each position's) is the target's, with power >= 0.9 against a 3-point shift."""
    from tests.support.sampling_harness import ALPHA, POWER

    run, fit = cut_joint_run(0.2)
    prop, acc = run.proposed_first_round, run.accepted_first_round
    share = {c: float((prop == c).float().mean()) for c in range(4)}
    print("first-round verified drafts:", share, "AL", float(acc.float().mean()) + 1)
    assert all(share[c] > 0.05 for c in range(3)), share  # cuts at slots 0, 1 and 2
    assert float(((acc >= 1) & (prop < 3)).float().mean()) > 0.2  # cut rounds accept
    failures = []
    for name, f in fit.items():
        print(f"confidence cut {name:9s} {f}")
        if name in ("joint", "joint_all", "pos1", "pos2", "pos3") and not f.pvalue > ALPHA:
            failures.append(f"{name}: {f}")
        if name in ("joint", "pos1", "pos2", "pos3") and f.power < POWER:
            failures.append(f"{name}: power {f.power:.3f} < {POWER}")
    assert not failures, "\n".join(failures)


def test_harness_detects_a_cut_that_reads_the_sampled_draft(torch_reference_kernels, monkeypatch):
    """The control: a confidence that depends on the *value* of the sampled draft (here
    1/3, 2/3 or 1 by token id) selects which sampled drafts are verified, which is not
    lossless (`draftinfer.decoding.confidence`); the same harness must see it."""
    from draftinfer.registry import drafter_spec
    from tests.support.sampling_harness import ALPHA

    cls = drafter_spec("eagle3").proposer_class
    propose = cls.propose

    def by_value(self, *args, **kw):
        drafts, q = propose(self, *args, **kw)
        self.confidence = ((drafts % 3 + 1) / 3).float()  # [B, K] from the sampled ids
        return drafts, q

    monkeypatch.setattr(cls, "propose", by_value)
    _, fit = cut_joint_run(0.5, seed0=8 * 10**7)
    assert min(fit["joint"].pvalue, fit["pos2"].pvalue, fit["pos3"].pvalue) < ALPHA


# ---- the calibration metrics, hand-computed -----------------------------------------------
def test_confidence_events_count_only_reached_drafts():
    conf, event = confidence_events(
        [[0.9, 0.8, 0.3], [0.6, 0.5, 0.4], [0.7, 0.2, 0.1], [0.5, 0.5, 0.5]],
        accepted=[1, 3, 0, 2],
        verified=[3, 3, 1, 2],  # round 3 cut after one draft, round 4 after two
    )
    # Round 1: draft 1 accepted, 2 rejected, 3 unreached; round 2: all three accepted;
    # round 3: its one verified draft rejected; round 4: both verified accepted (3 cut).
    assert conf == [0.9, 0.8, 0.6, 0.5, 0.4, 0.7, 0.5, 0.5]
    assert event == [1, 0, 1, 1, 1, 0, 1, 1]
    with pytest.raises(ValueError, match="accepted <= verified <= K"):
        confidence_events([[0.5]], [1], [0])


def test_ece_ten_equal_width_bins():
    # One draft per bin: |0.95 - 1|, |0.85 - 0|, |0.15 - 0|, |0.05 - 0|, averaged.
    assert expected_calibration_error([0.95, 0.85, 0.15, 0.05], [1, 0, 0, 0]) == pytest.approx(
        0.275
    )
    # Two drafts in bin 6: mean confidence 0.65 against rate 0.5; 1.0 falls in the last bin.
    assert expected_calibration_error([0.61, 0.69], [1, 0]) == pytest.approx(0.15)
    assert expected_calibration_error([1.0, 0.9], [1, 1]) == pytest.approx(0.05)
    assert expected_calibration_error([], []) != expected_calibration_error([], [])  # NaN


def test_auroc_by_ranks_with_ties():
    # Pairs (pos, neg): 0.9>0.8, 0.9>0.6, 0.7<0.8, 0.7>0.6 -> 3/4.
    assert auroc([0.9, 0.8, 0.7, 0.6], [1, 0, 1, 0]) == pytest.approx(0.75)
    # A tie counts one half: pos {0.5, 0.9} vs neg {0.3, 0.5} -> (1 + 0.5 + 2) / 4.
    assert auroc([0.3, 0.5, 0.5, 0.9], [0, 1, 0, 1]) == pytest.approx(0.875)
    assert auroc([0.1, 0.2], [0, 1]) == 1.0 and auroc([0.1, 0.2], [1, 0]) == 0.0
    assert auroc([0.4, 0.5], [1, 1]) != auroc([0.4, 0.5], [1, 1])  # NaN: one class


def test_brier_score():
    assert brier_score([0.9, 0.2], [1, 1]) == pytest.approx((0.01 + 0.64) / 2)
    assert brier_score([0.5] * 4, [1, 0, 1, 0]) == pytest.approx(0.25)


def test_round_cost_interpolates_between_measured_ks():
    cost = {"1": 1.1, "3": 1.3, "4": 1.5}
    assert round_cost_at(cost, 0) == pytest.approx(1.1)  # below: the smallest measured K
    assert round_cost_at(cost, 2) == pytest.approx(1.2)
    assert round_cost_at(cost, 4) == pytest.approx(1.5)
    assert round_cost_at(cost, 7) == pytest.approx(1.5)


@dataclass
class _Out:
    accepted: list[int]
    proposed: list[int]
    confidences: list[list[float]] = field(default_factory=list)


def test_threshold_sweep_replays_whole_block_rounds():
    """Two whole-block rounds at K = 3: (conf 0.9, 0.9, 0.2; accepted 3) and (0.5, 0.9, 0.9;
    accepted 0). tau 0.6 cuts them at 2 and 0 drafts: tokens min(3, 2) + 1 + min(0, 0) + 1 = 4,
    rows 3 + 1; costs {1: 1.0, 3: 1.4} give 1.2 + 1.0: 4 / 2.2 beats the whole block's 5 / 2.8."""
    outs = [_Out([3, 0], [3, 3], [[0.9, 0.9, 0.2], [0.5, 0.9, 0.9]])]
    sweep = threshold_sweep(outs, [0.6], {1: 1.0, 3: 1.4})
    full, cut = sweep["by_tau"]["full"], sweep["by_tau"]["0.6"]
    assert full == pytest.approx(
        {"al": 2.5, "verified_rows_per_round": 4.0, "round_cost": 1.4, "expected_speedup": 5 / 2.8}
    )
    assert cut == pytest.approx(
        {"al": 2.0, "verified_rows_per_round": 2.0, "round_cost": 1.1, "expected_speedup": 4 / 2.2}
    )
    assert sweep["best"] == "0.6" and sweep["rounds"] == 2
    cal = calibration_report(outs)
    # Reached: 0.9, 0.9, 0.2 (all accepted) and 0.5 (rejected).
    assert cal["drafts"] == 4 and cal["accept_rate"] == 0.75
    assert cal["brier"] == pytest.approx((0.01 + 0.01 + 0.64 + 0.25) / 4)
    assert cal["auroc"] == pytest.approx(2 / 3)


def test_runner_threshold_options_are_one_line_errors():
    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.run import check_infer_config
    from draftinfer.files.errors import ConfigError

    ok = InferConfig(drafter="/x", verify_threshold=0.3, confidence_report=True)
    check_infer_config(ok)
    cases = [
        (dict(verify_threshold=1.5), r"verify_threshold must be in \(0, 1\]"),
        (dict(verify_threshold=0.3, mode="reference"), "need mode=fast"),
        (dict(threshold_sweep=[0.0, 0.5]), "threshold_sweep values must be in"),
    ]
    for kw, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            check_infer_config(InferConfig(drafter="/x", **kw))
