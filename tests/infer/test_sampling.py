"""Sampling: parameter validation, exact top-k / top-p masks, temperature, the exponential race,
and seeded randomness keyed by (seed, position) independent of the batch (DESIGN 3.12, T4)."""

from __future__ import annotations

import math

import pytest
import torch

from draftinfer.decoding import sampling
from draftinfer.decoding.sampling import (
    STREAM_ACCEPT,
    STREAM_RECOVERY,
    STREAM_SAMPLE,
    SamplingParams,
    apply_top_k_top_p,
    exponential_noise,
    logits_to_probs,
    random_bits,
    resolve_seed,
    sample_from_probs,
    sampling_tensors,
    uniforms_for,
)
from tests.support.utils import assert_close

try:
    from scipy.stats import chisquare
except ImportError:  # pragma: no cover
    chisquare = None


def kept(masked: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row))[:, 0].tolist() for row in masked]


# --- SamplingParams -------------------------------------------------------------------------


def test_sampling_params_validation_and_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams().is_greedy
    for bad in (
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(seed=2**63),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert resolve_seed(7) == 7
    s = resolve_seed(None)
    assert 0 <= s < 2**63


def test_sampling_tensors():
    t = sampling_tensors([SamplingParams(0.0, 5, 0.9, 1), SamplingParams(0.7)])
    assert t["temperature"].tolist() == pytest.approx([0.0, 0.7])
    assert t["top_k"].tolist() == [5, 0] and t["top_k"].dtype == torch.int64
    assert t["top_p"].tolist() == pytest.approx([0.9, 1.0])
    assert t["is_greedy"].tolist() == [True, False]


# --- top-k / top-p / temperature ------------------------------------------------------------


def test_top_k_exact_and_keeps_ties():
    logits = torch.tensor(
        [
            [1.0, 5.0, 3.0, 2.0, 4.0],  # k = 2 -> {5, 4}
            [1.0, 3.0, 3.0, 0.0, 2.0],  # k = 1 -> both 3s (ties at the k-th value are kept)
            [1.0, 5.0, 3.0, 2.0, 4.0],  # k = 0: off
            [1.0, 5.0, 3.0, 2.0, 4.0],  # k = -1: off
            [1.0, 5.0, 3.0, 2.0, 4.0],  # k = V: off
        ]
    )
    top_k = torch.tensor([2, 1, 0, -1, 5])
    masked = apply_top_k_top_p(logits, top_k, torch.ones(5))
    assert kept(masked) == [[1, 4], [1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert torch.equal(masked[0, [1, 4]], logits[0, [1, 4]])  # kept logits unchanged


def test_top_k_without_top_p_equals_the_sorting_path():
    """On CPU a batch with no top-p row takes `torch.topk` instead of the full sort; any row
    gives the same mask in a batch that has a top-p row (and so sorts). Integer logits make
    ties at the k-th value common."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 6, (12, 40), generator=g).float()
    top_k = torch.tensor([0, -1, 1, 2, 3, 5, 7, 13, 39, 40, 41, 6])
    fast = apply_top_k_top_p(logits, top_k, torch.ones(12))
    sorting = apply_top_k_top_p(
        torch.cat([logits, logits[:1]]),
        torch.cat([top_k, top_k[:1]]),
        torch.tensor([1.0] * 12 + [0.5]),
    )[:12]
    assert torch.equal(fast, sorting)
    assert kept(fast)[4] == kept(sorting)[4] and len(kept(fast)[4]) >= 3


def test_top_p_exact():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5 (id 1), 0.3 (3), 0.15 (0), 0.05 (2)
    logits = probs.log().expand(5, 4).contiguous()
    top_p = torch.tensor([0.75, 0.85, 0.01, 1.0, 0.96])
    masked = apply_top_k_top_p(logits, torch.zeros(5, dtype=torch.long), top_p)
    assert kept(masked) == [[1, 3], [0, 1, 3], [1], [0, 1, 2, 3], [0, 1, 2, 3]]


def test_top_k_applies_before_top_p():
    """top-k 2 renormalizes to (0.625, 0.375); top-p 0.6 then keeps only the first token.
    (top-p first would keep two tokens: 0.5 and 0.3.)"""
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    masked = apply_top_k_top_p(probs.log()[None], torch.tensor([2]), torch.tensor([0.6]))
    assert kept(masked) == [[1]]


def test_logits_to_probs_temperature_and_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 23, generator=g)
    logits[3, [4, 9]] = 10.0  # a tie for the greedy row: lowest id wins
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.0])
    off_k, off_p = torch.zeros(4, dtype=torch.long), torch.ones(4)
    probs = logits_to_probs(logits.bfloat16(), temperature, off_k, off_p)
    assert probs.dtype == torch.float32
    lf = logits.bfloat16().float()
    for i in range(3):
        assert_close(probs[i], torch.softmax(lf[i] / temperature[i], dim=-1))
    assert torch.equal(probs[3], torch.nn.functional.one_hot(torch.tensor(4), 23).float())
    assert_close(probs.sum(-1), torch.ones(4))


def test_logits_to_probs_top_k_top_p_zero_out_and_renormalize():
    logits = torch.tensor([[1.0, 5.0, 3.0, 2.0, 4.0]])
    probs = logits_to_probs(logits, torch.tensor([1.0]), torch.tensor([3]), torch.tensor([1.0]))
    expected = torch.zeros(5)
    expected[[1, 2, 4]] = torch.softmax(torch.tensor([5.0, 3.0, 4.0]), dim=0)
    assert_close(probs[0], expected)
    assert (probs[0, [0, 3]] == 0).all()


# --- the exponential race -------------------------------------------------------------------


def test_sample_from_probs_one_hot_and_zeros():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    noise = torch.tensor([[1e-30, 5.0, 1e-30], [3.0, 1e-30, 0.1]])
    assert sample_from_probs(probs, noise).tolist() == [1, 2]


def test_sample_from_probs_distribution():
    p = torch.tensor([0.4, 0.0, 0.25, 0.2, 0.1, 0.05])
    n = 20_000
    noise = exponential_noise(torch.arange(n), torch.full((n,), 3), p.numel())
    tokens = sample_from_probs(p.expand(n, -1), noise)
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    assert counts[1] == 0
    observed, expected = counts[p > 0], p[p > 0].double() * n
    if chisquare is not None:
        assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-4
    else:  # pragma: no cover
        assert float(((observed - expected) ** 2 / expected).sum()) < 23.5  # 4 dof, alpha 1e-4


# --- seeded randomness ----------------------------------------------------------------------


def _splitmix64_py(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_random_bits_equal_reference_splitmix64():
    """int64 tensor arithmetic reproduces uint64 splitmix64 (wrap-around, logical shifts)."""
    m = (1 << 64) - 1
    seeds = [0, 1, -5, 2**62 + 7, 123456789, 2**63 - 1]
    positions = [0, 3, 100, 7, 2**40, 1]
    got = random_bits(torch.tensor(seeds), torch.tensor(positions), 3, torch.tensor(9)).tolist()
    for s, p, value in zip(seeds, positions, got):
        h = _splitmix64_py(s & m)
        h = _splitmix64_py(h ^ 3)
        h = _splitmix64_py(h ^ p)
        h = _splitmix64_py(h ^ 9)
        assert value & m == h
    # known first output of splitmix64 seeded with 0 (the reference C implementation)
    assert _splitmix64_py(0) == 0xE220A8397B1DCDAF


def test_noise_depends_only_on_seed_and_position():
    seeds = torch.tensor([11, 22, 33, 44])
    positions = torch.tensor([5, 5, 900, 0])
    batch = exponential_noise(seeds, positions, 101)
    assert batch.shape == (4, 101) and batch.dtype == torch.float32
    for i in range(4):  # alone == in the batch (scalar call returns [V])
        assert torch.equal(exponential_noise(int(seeds[i]), int(positions[i]), 101), batch[i])
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(exponential_noise(seeds[perm], positions[perm], 101), batch[perm])
    other_pos = exponential_noise(seeds, positions + 1, 101)
    other_stream = exponential_noise(seeds, positions, 101, stream=STREAM_RECOVERY)
    assert not (other_pos == batch).any(dim=1).all()
    assert not torch.equal(other_stream, batch)
    assert (batch >= 0).all() and torch.isfinite(batch).all()


def test_uniforms_keyed_by_draft_position_not_batch():
    seeds = torch.tensor([7, 8, 9])
    positions = torch.tensor([10, 20, 30])
    cu = torch.tensor([0, 3, 3, 5])
    u = uniforms_for(seeds, positions, cu, 5)
    assert u.shape == (5,) and u.dtype == torch.float32
    assert ((u > 0) & (u <= 1)).all()
    # request 2 alone gives the same two uniforms
    alone = uniforms_for(seeds[2:], positions[2:], torch.tensor([0, 2]), 2)
    assert torch.equal(alone, u[3:5])
    # a round starting one position later reuses the uniform of that position
    later = uniforms_for(seeds[:1], positions[:1] + 1, torch.tensor([0, 2]), 2)
    assert torch.equal(later, u[1:3])
    # acceptance and sampling streams are different numbers
    assert not torch.equal(u, uniforms_for(seeds, positions, cu, 5, stream=STREAM_SAMPLE))
    assert STREAM_ACCEPT != STREAM_SAMPLE


def test_randomness_is_uniform_and_exponential():
    n = 50_000
    u = uniforms_for(torch.arange(n), torch.zeros(n, dtype=torch.long), torch.arange(n + 1), n)
    counts = torch.histc(u, bins=10, min=0.0, max=1.0).double()
    stat = float(((counts - n / 10) ** 2 / (n / 10)).sum())
    assert stat < 33.7  # chi-square, 9 dof, alpha 1e-4
    e = exponential_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), n).double().flatten()
    # Exp(1): mean 1, variance 1, P(E > 3) = e^-3; standard errors ~ 1/sqrt(2n)
    assert abs(e.mean().item() - 1.0) < 0.02
    assert abs(e.var().item() - 1.0) < 0.05
    assert abs((e > 3).double().mean().item() - math.exp(-3)) < 0.005


def test_module_has_no_generator_state():
    """Same call, same numbers: nothing is drawn from torch's global RNG."""
    torch.manual_seed(0)
    a = exponential_noise(torch.tensor([3]), torch.tensor([4]), 17)
    torch.rand(100)
    b = exponential_noise(torch.tensor([3]), torch.tensor([4]), 17)
    assert torch.equal(a, b)
    assert not any(isinstance(v, torch.Generator) for v in vars(sampling).values())


@pytest.mark.parametrize("V", [128256, 151936, 32000, 4099, 65537, 8192])
def test_argmax_ids_is_torch_argmax_with_ties_and_nan(V):
    """The two-pass argmax (`argmax_ids`) against `torch.argmax` (documented: the first maximal
    index): many exact ties (a few distinct values), ties across chunk boundaries, -inf rows,
    NaN, a strided slice of a `[B, k, V]` block, leading dims."""
    from draftinfer.decoding.sampling import _argmax_chunk, argmax_ids

    g = torch.Generator().manual_seed(V)
    x = torch.randint(0, 7, (3, 4, V), generator=g).to(torch.bfloat16)  # ties everywhere
    x[0, 1] = float("-inf")
    x[1, 2, V // 3] = float("nan")
    x[1, 3, [V - 1, 5]] = 1000.0  # the max in the first and the last chunk
    x[2, 0, [V // 2, V // 2 + 1]] = 999.0  # ties on either side of a chunk boundary (or not)
    for t in (x, x[:, 2], x.float(), x[:, :, :]):
        assert torch.equal(argmax_ids(t), t.argmax(-1))
    if V >= 32000 and V != 65537:
        assert _argmax_chunk(V) is not None  # the real vocabularies take two passes


def test_record_all_picks_what_step_by_step_picks():
    """`Proposer._record_all`: the greedy chooser's one argmax over `[B, k, Dd]` writes the
    drafts `_record` writes step by step (drafts mapped to target ids, 0 past each request's
    cap), and a chooser without `all` (sampling) goes step by step with its q. The greedy
    chooser's own piece (`greedy_record`, what `Proposer.compile` compiles) writes what any
    other `GreedyChooser` writes through the generic path."""
    from types import SimpleNamespace

    from draftinfer.decoding.proposer import GreedyChooser, Proposer, greedy_chooser, greedy_record

    g = torch.Generator().manual_seed(0)
    B, k, Dd = 3, 4, 50
    logits = torch.randn(B, k, Dd, generator=g)
    logits[0, 1, 7] = logits[0, 1, 9] = logits[0, 1].max() + 1  # a tie: the lower id
    live = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    ns = SimpleNamespace(vocab_ids=torch.randperm(1000, generator=g)[:Dd])
    ns._record = lambda *a: Proposer._record(ns, *a)
    ns._greedy = greedy_record
    ns.track_confidence = False  # no confidence kept (`Proposer._keep_derived` returns at once)
    ns._keep_derived = lambda *a: Proposer._keep_derived(ns, *a)

    def sampled(x, step):  # no `all`: a q per step
        return x.argmin(-1), torch.softmax(x, -1)

    for choose in (greedy_chooser, sampled):
        want = torch.zeros(B, k, dtype=torch.long)
        q_want = None
        for step in range(k):
            q_want = Proposer._record(
                ns, want, q_want, step, logits[:, step], live[:, step], choose
            )
        got = torch.zeros(B, k, dtype=torch.long)
        q_got = Proposer._record_all(ns, got, logits, live, choose)
        assert torch.equal(got, want) and (got[~live] == 0).all()
        assert (q_got is None) == (q_want is None) == (choose is greedy_chooser)
        if q_got is not None:
            assert_close(q_got, q_want)
        else:
            assert got[0, 1] == ns.vocab_ids[7]  # the tie went to the lower id
            greedy = got
    assert hasattr(greedy_chooser, "all") and not hasattr(sampled, "all")
    generic = torch.zeros(B, k, dtype=torch.long)
    assert Proposer._record_all(ns, generic, logits, live, GreedyChooser()) is None
    assert torch.equal(generic, greedy)
