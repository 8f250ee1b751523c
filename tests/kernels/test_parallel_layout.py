"""Parallel-drafting input layout (S6): kernel == torch reference == a loop-by-loop oracle.

Random `(query_len, num_rejected, K, near max_model_len)` cases check ids, positions
`p_last + m`, padding slots, `feat_src`, `sample_idx` and the draft cap exactly. On a CPU-only
machine the Triton kernel runs through the interpreter (`TRITON_INTERPRET=1`, switched on
before the kernel module is imported); with CUDA it runs compiled on the GPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from draftkernels.runtime import use_triton

from tests.support.utils import (
    POISON_INT,
    import_kernel_module,
    kernel_test_device,
    poison_empty,  # noqa: F401  (fixture)
)

pl = import_kernel_module("draftkernels.parallel_layout")
DEVICE = kernel_test_device()
OUTPUTS = ("out_ids", "out_pos", "feat_src", "sample_idx", "num_drafts")


# ---------------------------------------------------------------------------------------------
# The oracle: the expansion written out slot by slot, straight from the module docstring.
# ---------------------------------------------------------------------------------------------


def oracle(token_ids, n_valid, pos_start, max_drafts, k, mask_token_id, max_model_len):
    """Python lists and loops only; returns the five outputs as CPU int64 tensors."""
    rows = token_ids.tolist()
    bsz, q = len(rows), token_ids.shape[1]
    width = q + k - 1
    out_ids = [[0] * width for _ in range(bsz)]
    out_pos = [[-1] * width for _ in range(bsz)]
    feat_src = [[-2] * width for _ in range(bsz)]
    sample_idx = [[-1] * k for _ in range(bsz)]
    num_drafts = []
    for b in range(bsz):
        nv, start = int(n_valid[b]), int(pos_start[b])
        p_last = start + nv - 1
        committed = p_last + 2  # tokens 0..p_last+1: the pending row consumes t_{p_last+1}
        # the next round verifies [pending, d_1..d_n] and commits up to n + 1 more tokens
        n = k
        n = min(n, int(max_drafts[b]))
        n = min(n, max_model_len - committed - 1)
        n = max(n, 0)
        num_drafts.append(n)

        slots = []  # (token id, position, feature source), in column order
        for j in range(nv):
            slots.append((rows[b][j], start + j, j))
        for m in range(1, k):
            if m < n:  # mask slot m yields draft m + 1
                slots.append((mask_token_id, p_last + m, -1))
        for col, (tok, pos, src) in enumerate(slots):
            if pos >= max_model_len:  # no KV write at or past the limit: stays padding
                continue
            out_ids[b][col], out_pos[b][col], feat_src[b][col] = tok, pos, src

        for draft in range(1, n + 1):  # draft 1 from the pending row, draft m + 1 from slot m
            sample_idx[b][draft - 1] = (nv - 1) + (draft - 1)

    return (
        torch.tensor(out_ids, dtype=torch.int64).reshape(bsz, width),
        torch.tensor(out_pos, dtype=torch.int64).reshape(bsz, width),
        torch.tensor(feat_src, dtype=torch.int64).reshape(bsz, width),
        torch.tensor(sample_idx, dtype=torch.int64).reshape(bsz, k),
        torch.tensor(num_drafts, dtype=torch.int64).reshape(bsz),
    )


# ---------------------------------------------------------------------------------------------
# Inputs and runners.
# ---------------------------------------------------------------------------------------------

MASK_IDS = (1, 7, 128_255, 151_669)  # 1: Triton specializes an int argument equal to 1


def random_case(rng: random.Random, bsz: int | None = None, k: int | None = None) -> dict:
    """A batch of requests with ragged `n_valid`, `p_last` swept around `max_model_len`."""
    bsz = bsz if bsz is not None else rng.choice((1, 3, 7))
    k = k if k is not None else rng.randint(1, 8)
    q = rng.choice((1, 2, k + 1, k + 1, 5, 13, 31, rng.randint(1, 40)))
    max_model_len = rng.choice((q + k + 6, 97, 4096, rng.randint(q + 4, 300)))
    n_valid, pos_start, max_drafts = [], [], []
    for _ in range(bsz):
        nv = rng.choice((1, q, rng.randint(1, q)))
        # p_last relative to the limit: exactly at the boundary (-2), one past it (a caller
        # beyond the contract: the guard pads), every value where the cap bites, or far below
        offset = rng.choice((-2, -1, 0, 1, -3, -4, rng.randint(-k - 5, -2), -10_000))
        p_last = max(max_model_len + offset, nv - 1)
        n_valid.append(nv)
        pos_start.append(p_last - nv + 1)
        max_drafts.append(rng.choice((k, k, 0, rng.randint(0, k), -3, k + 4)))
    return dict(
        # junk ids in the rejected rows must never leak into the output
        token_ids=torch.tensor(
            [[rng.randint(0, 200_000) for _ in range(q)] for _ in range(bsz)], dtype=torch.int64
        ),
        n_valid=torch.tensor(n_valid, dtype=rng.choice((torch.int32, torch.int64))),
        pos_start=torch.tensor(pos_start, dtype=torch.int64),
        max_drafts=torch.tensor(max_drafts, dtype=torch.int64),
        k=k,
        mask_token_id=rng.choice(MASK_IDS),
        max_model_len=max_model_len,
    )


def to_device(case: dict) -> dict:
    return {n: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for n, v in case.items()}


def assert_outputs_equal(got, want, what: str, case: dict):
    for name, a, e in zip(OUTPUTS, got, want):
        a = a.cpu()
        assert a.dtype == torch.int64, f"{what} {name}: dtype {a.dtype}"
        assert (a != POISON_INT).all(), f"{what} {name}: unwritten elements"
        assert torch.equal(a, e), f"{what} {name}:\n{a}\n!= oracle\n{e}\ninputs: {case}"


def run_kernel(case: dict):
    """The Triton kernel (outputs poisoned by the caller's fixture) == oracle, exactly."""
    assert use_triton(DEVICE), "the kernel would not run: TRITON_INTERPRET must be 1 on CPU"
    got = pl.parallel_layout(**to_device(case))
    assert_outputs_equal(got, oracle(**case), "kernel", case)
    return tuple(t.cpu() for t in got)


def check_invariants(case: dict, outs) -> None:
    """Properties the consumer relies on, independent of how the oracle is written."""
    out_ids, out_pos, feat_src, sample_idx, num_drafts = outs
    k, mml = case["k"], case["max_model_len"]
    for b in range(out_ids.shape[0]):
        nv = int(case["n_valid"][b])
        p_last = int(case["pos_start"][b]) + nv - 1
        n = int(num_drafts[b])
        live = out_pos[b] >= 0
        assert (out_pos[b][live] < mml).all()  # never a KV write at or past the limit
        assert (feat_src[b][~live] == -2).all() and (out_ids[b][~live] == 0).all()
        assert 0 <= n <= k and n <= max(int(case["max_drafts"][b]), 0)
        if n:  # the next round commits at most L + n + 1 = p_last + n + 3 tokens
            assert p_last + n + 3 <= mml
        if p_last >= mml - 3:
            assert n == 0
        # live columns are a prefix with consecutive positions (ids may be anything)
        num_live = int(live.sum())
        assert live[:num_live].all()
        if num_live:
            assert torch.equal(out_pos[b][:num_live], out_pos[b][0] + torch.arange(num_live))
        # the drafted columns: the pending row then the mask slots, each live, in order
        drafted = sample_idx[b][:n]
        assert torch.equal(drafted, nv - 1 + torch.arange(n))
        assert (sample_idx[b][n:] == -1).all()
        assert live[drafted].all()
        assert (feat_src[b][drafted[1:]] == -1).all()
        assert (out_ids[b][drafted[1:]] == case["mask_token_id"]).all()
        assert (feat_src[b] == -1).sum() == max(n - 1, 0)  # K-1 mask slots at most


# ---------------------------------------------------------------------------------------------
# S6: random cases.
# ---------------------------------------------------------------------------------------------


def test_reference_matches_oracle_random_cases():
    rng = random.Random(0)
    for _ in range(400):
        case = random_case(rng)
        got = pl.parallel_layout_ref(**case)
        assert_outputs_equal(got, oracle(**case), "reference", case)
        check_invariants(case, got)


@pytest.mark.parametrize("bsz", [1, 3, 7])
@pytest.mark.usefixtures("poison_empty")
def test_kernel_matches_oracle_random_cases(bsz):
    rng = random.Random(100 + bsz)
    for _ in range(24):
        case = random_case(rng, bsz=bsz)
        outs = run_kernel(case)
        check_invariants(case, outs)


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.usefixtures("poison_empty")
def test_kernel_every_k(k):
    rng = random.Random(200 + k)
    for _ in range(3):
        run_kernel(random_case(rng, bsz=3, k=k))


# ---------------------------------------------------------------------------------------------
# The layout on a worked example and on the edge cases.
# ---------------------------------------------------------------------------------------------


def make_case(rows, n_valid, pos_start, max_drafts, k, mask_token_id=99, max_model_len=4096):
    return dict(
        token_ids=torch.tensor(rows, dtype=torch.int64),
        n_valid=torch.tensor(n_valid, dtype=torch.int64),
        pos_start=torch.tensor(pos_start, dtype=torch.int64),
        max_drafts=torch.tensor(max_drafts, dtype=torch.int64),
        k=k,
        mask_token_id=mask_token_id,
        max_model_len=max_model_len,
    )


@pytest.mark.usefixtures("poison_empty")
def test_worked_example():
    """Q = 4, K = 3. Request 0: 2 committed rows at 10, 11, two rejected. Request 1: all 4
    committed at 20..23, capped to 2 drafts by the caller. Request 2: p_last = 40 with
    max_model_len 45: L = 42, so n <= 45 - 42 - 1 = 2."""
    case = make_case(
        rows=[[5, 6, 70, 71], [1, 2, 3, 4], [8, 9, 72, 73]],
        n_valid=[2, 4, 2],
        pos_start=[10, 20, 39],
        max_drafts=[3, 2, 3],
        k=3,
        max_model_len=45,
    )
    out_ids, out_pos, feat_src, sample_idx, num_drafts = run_kernel(case)
    assert out_ids.tolist() == [[5, 6, 99, 99, 0, 0], [1, 2, 3, 4, 99, 0], [8, 9, 99, 0, 0, 0]]
    assert out_pos.tolist() == [
        [10, 11, 12, 13, -1, -1],
        [20, 21, 22, 23, 24, -1],
        [39, 40, 41, -1, -1, -1],
    ]
    assert feat_src.tolist() == [
        [0, 1, -1, -1, -2, -2],
        [0, 1, 2, 3, -1, -2],
        [0, 1, -1, -2, -2, -2],
    ]
    assert sample_idx.tolist() == [[1, 2, 3], [3, 4, -1], [1, 2, -1]]
    assert num_drafts.tolist() == [3, 2, 2]


@pytest.mark.usefixtures("poison_empty")
def test_k1_has_no_mask_slots():
    case = make_case([[3, 4, 5], [6, 7, 8]], [2, 3], [0, 7], [1, 0], k=1)
    out_ids, out_pos, feat_src, sample_idx, num_drafts = run_kernel(case)
    assert out_ids.shape == (2, 3) and sample_idx.shape == (2, 1)
    assert (feat_src != -1).all()
    assert sample_idx.tolist() == [[1], [-1]] and num_drafts.tolist() == [1, 0]
    assert out_pos.tolist() == [[0, 1, -1], [7, 8, 9]]


@pytest.mark.usefixtures("poison_empty")
def test_all_valid_and_single_valid_row():
    """n_valid = Q (nothing rejected: the layout fills all Q + K - 1 columns, the buffer bound
    `Q + K - 1` per request is attained) and n_valid = 1 (only the pending row)."""
    k = 4
    case = make_case([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [5, 1], [100, 0], [k, k], k=k)
    out_ids, out_pos, feat_src, sample_idx, num_drafts = run_kernel(case)
    assert (out_pos[0] >= 0).sum() == 5 + k - 1  # sum(Q_b) + B (K - 1) is tight
    assert out_pos[0].tolist() == list(range(100, 108))
    assert out_ids[1].tolist() == [6, 99, 99, 99, 0, 0, 0, 0]
    assert out_pos[1].tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    assert sample_idx.tolist() == [[4, 5, 6, 7], [0, 1, 2, 3]]


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.usefixtures("poison_empty")
def test_boundary_sweep(k):
    """p_last from far below the limit to past it: num_drafts = clamp(mml - p_last - 3, 0, K)."""
    mml, q = 64, 3
    p_lasts = list(range(mml - k - 6, mml + 1))
    case = make_case(
        rows=[[11, 12, 13]] * len(p_lasts),
        n_valid=[q] * len(p_lasts),
        pos_start=[p - q + 1 for p in p_lasts],
        max_drafts=[k] * len(p_lasts),
        k=k,
        max_model_len=mml,
    )
    outs = run_kernel(case)
    check_invariants(case, outs)
    out_pos, num_drafts = outs[1], outs[4]
    for i, p_last in enumerate(p_lasts):
        assert num_drafts[i] == max(0, min(k, mml - p_last - 3)), p_last
    at_boundary = p_lasts.index(mml - 2)  # L = max_model_len: the sequence is full
    assert num_drafts[at_boundary] == 0
    assert out_pos[at_boundary].tolist() == [mml - 4, mml - 3, mml - 2] + [-1] * (k - 1)
    over = p_lasts.index(mml - 1)  # L = max_model_len + 1: beyond the contract, still in range
    assert num_drafts[over] == 0
    assert out_pos[over].tolist() == [mml - 3, mml - 2, mml - 1] + [-1] * (k - 1)
    past = p_lasts.index(mml)  # the pending row would sit at the limit: padding, not position 0
    assert out_pos[past].tolist() == [mml - 2, mml - 1] + [-1] * k


@pytest.mark.usefixtures("poison_empty")
def test_long_prefill_row_spans_several_blocks():
    """Q + K - 1 > the kernel's column block: the loop over column chunks."""
    rng = random.Random(7)
    q, k = 1100, 3
    case = make_case(
        rows=[[rng.randint(0, 1000) for _ in range(q)] for _ in range(2)],
        n_valid=[q, 1029],
        pos_start=[0, 5000],
        max_drafts=[k, k],
        k=k,
        max_model_len=8192,
    )
    run_kernel(case)


@pytest.mark.usefixtures("poison_empty")
def test_empty_batch():
    case = make_case([[1]], [1], [0], [1], k=2)
    case = {n: (v[:0] if isinstance(v, torch.Tensor) else v) for n, v in case.items()}
    outs = pl.parallel_layout(**to_device(case))
    assert [tuple(t.shape) for t in outs] == [(0, 2), (0, 2), (0, 2), (0, 2), (0,)]


def test_falls_back_to_reference_without_triton(monkeypatch):
    rng = random.Random(3)
    case = random_case(rng, bsz=3)
    monkeypatch.setattr(pl, "use_triton", lambda device: False)
    assert_outputs_equal(pl.parallel_layout(**case), oracle(**case), "fallback", case)


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(token_ids=torch.zeros(2, 3, dtype=torch.int32)), ValueError),
        (dict(token_ids=torch.zeros(2, 0, dtype=torch.int64)), ValueError),
        (dict(token_ids=torch.zeros(6, dtype=torch.int64)), ValueError),
        (dict(token_ids=torch.zeros(3, 2, dtype=torch.int64).t()), ValueError),
        (dict(n_valid=torch.ones(2, dtype=torch.float32)), ValueError),
        (dict(n_valid=torch.ones(3, dtype=torch.int64)), ValueError),
        (dict(pos_start=torch.zeros(2, dtype=torch.int32)), ValueError),
        (dict(max_drafts=torch.zeros(1, 2, dtype=torch.int64)), ValueError),
        (dict(k=0), ValueError),
        (dict(k=2.0), TypeError),
        (dict(mask_token_id=-1), ValueError),
        (dict(max_model_len=0), ValueError),
    ],
)
@pytest.mark.parametrize("fn", ["parallel_layout", "parallel_layout_ref"])
def test_rejects_bad_inputs(fn, change, error):
    case = make_case([[1, 2, 3], [4, 5, 6]], [1, 2], [0, 0], [2, 2], k=2)
    with pytest.raises(error):
        getattr(pl, fn)(**{**case, **change})
