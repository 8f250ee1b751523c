"""Rejection sampler: kernel == torch reference bit-exactly (T3), the emitted token is
distributed as the target (T2), greedy rows are exact and batch-independent (T5).

On a CPU-only machine the Triton kernel runs through the interpreter (`TRITON_INTERPRET=1`,
switched on before the kernel module is imported); with CUDA it runs compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from draftkernels.runtime import use_triton

from draftinfer.decoding.sampling import (
    exponential_noise,
    logits_to_probs,
    sample_from_probs,
    uniforms_for,
)
from tests.support.utils import (
    POISON_INT,
    import_kernel_module,
    kernel_test_device,
    poison_empty,  # noqa: F401  (fixture)
)

rs = import_kernel_module("draftkernels.rejection_sampler")
DEVICE = kernel_test_device()

try:
    from scipy.stats import chisquare
except ImportError:  # pragma: no cover - scipy is optional
    chisquare = None


# ---------------------------------------------------------------------------------------------
# Inputs and an independent, loop-by-loop oracle of the documented rule.
# ---------------------------------------------------------------------------------------------


def _cu(counts: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(counts) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    return cu


def make_batch(counts, vocab, *, seed, full_q=True, greedy=None, cu_dtype=torch.int64):
    """Random ragged batch: drafts sampled from q (or from the vocab for one-hot q)."""
    g = torch.Generator().manual_seed(seed)
    b, n = len(counts), sum(counts)
    cu = _cu(counts).to(cu_dtype)
    # Peaked target and draft rows, with exact zeros (as top-k/top-p produce).
    p = torch.softmax(3 * torch.randn(n, vocab, generator=g), dim=-1)
    p = p * (torch.rand(n, vocab, generator=g) > 0.2)
    p = p / p.sum(-1, keepdim=True)
    if full_q:
        q = torch.softmax(3 * torch.randn(n, vocab, generator=g), dim=-1)
        d = torch.multinomial(q, 1, generator=g)[:, 0] if n else torch.zeros(0, dtype=torch.long)
    else:
        q = None
        d = torch.randint(0, vocab, (n,), generator=g)
        # half the drafts are the target's argmax, so greedy requests accept some
        take_argmax = torch.rand(n, generator=g) < 0.5
        d = torch.where(take_argmax, p.argmax(-1), d) if n else d
    if greedy is None:
        greedy = torch.rand(b, generator=g) < 0.4
    return dict(
        draft_token_ids=d,
        cu_num_draft=cu,
        draft_probs=q,
        target_probs=p.float(),
        bonus_token_ids=torch.randint(0, vocab, (b,), generator=g),
        is_greedy=torch.as_tensor(greedy, dtype=torch.bool),
        uniforms=1.0 - torch.rand(n, generator=g),  # (0, 1], never 0
        recovery_noise=torch.empty(b, vocab).exponential_(generator=g),
    )


def to_device(batch: dict) -> dict:
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def oracle(batch: dict, max_num_draft: int | None = None):
    """Request by request, draft by draft, straight from the module docstring."""
    cu = batch["cu_num_draft"].tolist()
    p, q, d = batch["target_probs"], batch["draft_probs"], batch["draft_token_ids"]
    u, noise = batch["uniforms"], batch["recovery_noise"]
    b = len(cu) - 1
    k = (
        max_num_draft
        if max_num_draft is not None
        else max([0] + [cu[i + 1] - cu[i] for i in range(b)])
    )
    out = torch.full((b, k + 1), -1, dtype=torch.int64)
    num_acc = torch.zeros(b, dtype=torch.int64)
    for i in range(b):
        emitted = []
        token = int(batch["bonus_token_ids"][i])
        for row in range(cu[i], cu[i + 1]):
            di = int(d[row])
            if batch["is_greedy"][i]:
                am = int(torch.argmax(p[row]))
                if am != di:
                    token = am
                    break
            else:
                qd = q[row, di] if q is not None else torch.tensor(1.0)
                if not (p[row, di] > 0 and u[row] * qd <= p[row, di]):
                    q_row = (
                        q[row]
                        if q is not None
                        else torch.nn.functional.one_hot(d[row], p.shape[1]).float()
                    )
                    res = torch.clamp_min(p[row] - q_row, 0.0)
                    score = torch.where(res > 0, res / noise[i], -1.0)
                    if score.max() < 0:
                        score = torch.where(p[row] > 0, p[row] / noise[i], -1.0)
                    token = int(torch.argmax(score))
                    break
            emitted.append(di)
        num_acc[i] = len(emitted)
        emitted.append(token)
        out[i, : len(emitted)] = torch.tensor(emitted)
    return out, num_acc


def run_both(batch: dict, max_num_draft=None, block_v=None, splits=None):
    """Kernel and reference on the same inputs (kernel outputs poisoned first); exact match."""
    assert use_triton(DEVICE), "the kernel would not run: TRITON_INTERPRET must be 1 on CPU"
    dev = to_device(batch)
    kern = rs.rejection_sample(**dev, max_num_draft=max_num_draft, block_v=block_v, splits=splits)
    ref = rs.rejection_sample_ref(**dev, max_num_draft=max_num_draft)
    for name, a, e in zip(("output_token_ids", "num_accepted"), kern, ref):
        assert a.dtype == e.dtype == torch.int64, name
        assert (a != POISON_INT).all(), f"{name}: kernel left unwritten elements"
        assert torch.equal(a.cpu(), e.cpu()), f"{name}: kernel\n{a}\n!= reference\n{e}"
    return kern[0].cpu(), kern[1].cpu()


def check_layout(out, num_acc, batch):
    """Row = accepted drafts, then exactly one token, then -1 padding."""
    cu = batch["cu_num_draft"].tolist()
    for i in range(len(cu) - 1):
        a = int(num_acc[i])
        assert 0 <= a <= cu[i + 1] - cu[i]
        assert torch.equal(out[i, :a], batch["draft_token_ids"][cu[i] : cu[i] + a])
        assert out[i, a] >= 0
        assert (out[i, a + 1 :] == -1).all()


# ---------------------------------------------------------------------------------------------
# T3: kernel == reference, bit-exactly, and both == the loop oracle.
# ---------------------------------------------------------------------------------------------

RAGGED = {1: [[3]], 3: [[2, 0, 5], [0, 0, 0]], 5: [[1, 4, 0, 3, 7]]}


@pytest.mark.parametrize("full_q", [True, False], ids=["full_q", "one_hot_q"])
@pytest.mark.parametrize("vocab,block_v", [(37, None), (101, 16)])
@pytest.mark.parametrize("counts", [c for cs in RAGGED.values() for c in cs], ids=str)
@pytest.mark.usefixtures("poison_empty")
def test_kernel_matches_reference_random_batches(counts, vocab, block_v, full_q):
    for seed in range(2):
        batch = make_batch(counts, vocab, seed=seed, full_q=full_q)
        out, num_acc = run_both(batch, block_v=block_v)
        expected = oracle(batch)
        assert torch.equal(out, expected[0]) and torch.equal(num_acc, expected[1])
        check_layout(out, num_acc, batch)


@pytest.mark.usefixtures("poison_empty")
def test_int32_offsets_and_wider_output():
    batch = make_batch([2, 0, 3], 37, seed=5, cu_dtype=torch.int32)
    out, num_acc = run_both(batch, max_num_draft=6)
    assert out.shape == (3, 7)
    assert torch.equal(out, oracle(batch, max_num_draft=6)[0])


@pytest.mark.usefixtures("poison_empty")
def test_no_drafts_at_all_emits_bonus():
    batch = make_batch([0, 0], 37, seed=1)
    out, num_acc = run_both(batch)
    assert torch.equal(num_acc, torch.zeros(2, dtype=torch.int64))
    assert torch.equal(out[:, 0], batch["bonus_token_ids"]) and out.shape == (2, 1)


@pytest.mark.parametrize("full_q", [True, False], ids=["full_q", "one_hot_q"])
@pytest.mark.usefixtures("poison_empty")
def test_all_accepted_appends_bonus(full_q):
    counts = [3, 1, 4]
    batch = make_batch(counts, 37, seed=2, full_q=full_q, greedy=[False, True, False])
    if full_q:
        batch["target_probs"] = batch["draft_probs"].clone()  # p == q: u * q(d) <= p(d) always
    else:  # p(d) = 1 = q(d)
        batch["target_probs"] = torch.nn.functional.one_hot(batch["draft_token_ids"], 37).float()
    greedy_rows = slice(3, 4)  # request 1 is greedy: its draft is the target's argmax
    batch["target_probs"][greedy_rows] = torch.nn.functional.one_hot(
        batch["draft_token_ids"][greedy_rows], 37
    ).float()
    batch["uniforms"] = torch.ones_like(batch["uniforms"])  # the hardest uniform still accepts
    out, num_acc = run_both(batch)
    assert num_acc.tolist() == counts
    for i, c in enumerate(counts):
        assert out[i, c] == batch["bonus_token_ids"][i]


@pytest.mark.parametrize("full_q", [True, False], ids=["full_q", "one_hot_q"])
@pytest.mark.usefixtures("poison_empty")
def test_reject_at_first_middle_last(full_q):
    """Request i rejects exactly at draft `reject_at[i]` (p(d) = 0 there, p(d) >= q(d) before)."""
    k, vocab = 5, 37
    reject_at = [0, 2, 4]
    batch = make_batch([k] * 3, vocab, seed=3, full_q=full_q, greedy=[False] * 3)
    p, d = batch["target_probs"], batch["draft_token_ids"]
    for i, r in enumerate(reject_at):
        for j in range(k):
            row = i * k + j
            if j < r:  # accepted: p(d) at least q(d) (<= 1 for one-hot q: make p one-hot)
                p[row] = (
                    batch["draft_probs"][row]
                    if full_q
                    else torch.nn.functional.one_hot(d[row], vocab).float()
                )
            elif j == r:  # rejected whatever u is: p(d) = 0
                p[row, d[row]] = 0.0
                p[row] /= p[row].sum()
    out, num_acc = run_both(batch)
    assert num_acc.tolist() == reject_at
    for i, r in enumerate(reject_at):
        row = i * k + r
        token = int(out[i, r])
        assert token != d[row] and p[row, token] > 0  # recovered, never the rejected draft
        assert (out[i, r + 1 :] == -1).all()


@pytest.mark.usefixtures("poison_empty")
def test_boundary_uniform_accepts_on_equality():
    """`u * q(d) <= p(d)` accepts on equality; the next float up rejects."""
    vocab = 37
    batch = make_batch([1, 1], vocab, seed=4, full_q=True, greedy=[False, False])
    q, p, d = batch["draft_probs"], batch["target_probs"], batch["draft_token_ids"]
    for row in range(2):
        q[row] = 0.0
        q[row, d[row]] = 0.5
        q[row, (d[row] + 1) % vocab] = 0.5
        p[row] = 0.75 / (vocab - 1)
        p[row, d[row]] = 0.25  # u * q(d) = 0.5 * 0.5 == p(d) exactly in fp32
    batch["uniforms"] = torch.tensor([0.5, torch.nextafter(torch.tensor(0.5), torch.tensor(1.0))])
    _, num_acc = run_both(batch)
    assert num_acc.tolist() == [1, 0]


@pytest.mark.usefixtures("poison_empty")
def test_zero_draft_prob_and_zero_target_prob():
    """q(d) = 0: accepted iff p(d) > 0. p(d) = 0 < q(d): rejected even at u = tiny."""
    vocab = 37
    batch = make_batch([1, 1, 1], vocab, seed=6, full_q=True, greedy=[False] * 3)
    q, p, d = batch["draft_probs"], batch["target_probs"], batch["draft_token_ids"]
    q[0, d[0]] = 0.0  # q = 0, p > 0 -> accept
    p[0, d[0]] = max(float(p[0, d[0]]), 0.1)
    q[1, d[1]] = 0.0  # q = 0, p = 0 -> reject: never emit a token the target forbids
    p[1, d[1]] = 0.0
    p[2, d[2]] = 0.0  # q > 0, p = 0 -> reject at the smallest uniform
    q[2, d[2]] = max(float(q[2, d[2]]), 0.1)
    batch["uniforms"] = torch.full((3,), torch.finfo(torch.float32).tiny)
    out, num_acc = run_both(batch)
    assert num_acc.tolist() == [1, 0, 0]
    for i in (1, 2):
        assert out[i, 0] != d[i] and p[i, out[i, 0]] > 0


@pytest.mark.parametrize("splits", [None, 4])
@pytest.mark.usefixtures("poison_empty")
def test_residual_excludes_rejected_token_one_hot(splits):
    """One-hot q: the rejected draft has the largest p and the smallest noise, so it would win
    any race it took part in; the residual must exclude it."""
    vocab = 101
    batch = make_batch([1] * 4, vocab, seed=7, full_q=False, greedy=[False] * 4)
    d = batch["draft_token_ids"]
    for i in range(4):
        batch["target_probs"][i] = 0.1 / (vocab - 1)
        batch["target_probs"][i, d[i]] = 0.9
        batch["recovery_noise"][i, d[i]] = 1e-30
    batch["uniforms"] = torch.ones(4)  # 1 * 1 > 0.9: rejected
    out, num_acc = run_both(batch, block_v=32, splits=splits)
    assert num_acc.tolist() == [0] * 4
    assert (out[:, 0] != d).all()


@pytest.mark.usefixtures("poison_empty")
def test_residual_only_where_p_exceeds_q():
    """Full q: the recovered token always has p(v) > q(v)."""
    batch = make_batch([1] * 5, 37, seed=8, full_q=True, greedy=[False] * 5)
    batch["uniforms"] = torch.ones(5)
    p, q = batch["target_probs"], batch["draft_probs"]
    d = batch["draft_token_ids"]
    for i in range(5):
        p[i, d[i]] = 0.0
        p[i] /= p[i].sum()
    out, num_acc = run_both(batch)
    for i in range(5):
        t = int(out[i, 0])
        assert num_acc[i] == 0 and p[i, t] > q[i, t]


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.usefixtures("poison_empty")
def test_all_zero_residual_falls_back_to_p(splits):
    """Unnormalized q >= p everywhere (p(d) < q(d)): the residual is empty, race on p."""
    vocab = 37
    batch = make_batch([1, 2], vocab, seed=9, full_q=True, greedy=[False, False])
    p, q, d = batch["target_probs"], batch["draft_probs"], batch["draft_token_ids"]
    q[0] = p[0] * 1.5
    q[0, d[0]] = max(float(q[0, d[0]]), 0.05)
    p[0, d[0]] = float(q[0, d[0]]) / 4
    batch["uniforms"][0] = 1.0
    out, num_acc = run_both(batch, block_v=8, splits=splits)
    assert num_acc[0] == 0 and p[0, out[0, 0]] > 0


@pytest.mark.parametrize("splits", [None, 3, 7], ids=["splits_default", "splits_3", "splits_7"])
@pytest.mark.usefixtures("poison_empty")
def test_greedy_argmax_ties_go_to_lowest_id_across_chunks(splits):
    """p has the same maximum at ids 5, 21 (same lane of the next 16-chunk), 40 and 90: in one
    split, in splits [0, 48) [48, 96) [96, 101) (5, 21, 40 | 90), or one split per chunk."""
    vocab = 101
    batch = make_batch([1, 1, 2], vocab, seed=10, full_q=False, greedy=[True] * 3)
    p = torch.full((4, vocab), 0.5 / (vocab - 4))
    p[:, [5, 21, 40, 90]] = 0.5 / 4
    batch["target_probs"] = p
    batch["draft_token_ids"] = torch.tensor([21, 5, 5, 90])
    out, num_acc = run_both(batch, block_v=16, splits=splits)
    assert num_acc.tolist() == [0, 1, 1]
    assert out[0, :2].tolist() == [5, -1]
    assert out[1, :2].tolist() == [5, int(batch["bonus_token_ids"][1])]
    assert out[2].tolist() == [5, 5, -1]


@pytest.mark.parametrize("splits", [None, 3, 7], ids=["splits_default", "splits_3", "splits_7"])
@pytest.mark.usefixtures("poison_empty")
def test_recovered_ties_go_to_lowest_id(splits):
    """Equal residual scores (unit noise, flat p) in several chunks and lanes: lowest id wins."""
    vocab = 101
    batch = make_batch([1, 1], vocab, seed=14, full_q=False, greedy=[False, False])
    batch["target_probs"] = torch.full((2, vocab), 1.0 / vocab)
    batch["draft_token_ids"] = torch.tensor([0, 3])
    batch["recovery_noise"] = torch.ones(2, vocab)
    batch["uniforms"] = torch.ones(2)
    out, num_acc = run_both(batch, block_v=16, splits=splits)
    assert num_acc.tolist() == [0, 0]
    assert out[:, 0].tolist() == [1, 0]  # the rejected draft is excluded, then the lowest id


@pytest.mark.usefixtures("poison_empty")
def test_mixed_batch_greedy_rows_match_all_greedy_batch():
    """T5: greedy rows of a mixed batch equal the same rows of an all-greedy batch."""
    counts = [3, 2, 4, 1, 3]
    mixed = make_batch(counts, 37, seed=11, full_q=True, greedy=[True, False, True, False, True])
    out_mixed, acc_mixed = run_both(mixed)
    all_greedy = dict(mixed, is_greedy=torch.ones(5, dtype=torch.bool))
    out_greedy, acc_greedy = run_both(all_greedy)
    for i in (0, 2, 4):
        assert torch.equal(out_mixed[i], out_greedy[i]) and acc_mixed[i] == acc_greedy[i]
    # greedy semantics: accepted drafts equal the argmax, the next token is the argmax
    cu = mixed["cu_num_draft"].tolist()
    for i in (0, 2, 4):
        a = int(acc_mixed[i])
        rows = range(cu[i], cu[i + 1])
        argmax = mixed["target_probs"].argmax(-1)
        assert all(mixed["draft_token_ids"][r] == argmax[r] for r in rows[:a])
        if a < len(rows):
            assert out_mixed[i, a] == argmax[rows[a]]


@pytest.mark.usefixtures("poison_empty")
def test_batch_order_does_not_change_outputs():
    """T4 at the sampler: with per-request noise, permuting requests permutes the outputs."""
    counts = [2, 0, 3, 1, 4]
    batch = make_batch(counts, 37, seed=12, full_q=True)
    out, acc = run_both(batch, max_num_draft=4)
    perm = [3, 0, 4, 2, 1]
    cu = batch["cu_num_draft"].tolist()
    rows = [r for i in perm for r in range(cu[i], cu[i + 1])]
    permuted = dict(
        draft_token_ids=batch["draft_token_ids"][rows],
        cu_num_draft=_cu([counts[i] for i in perm]),
        draft_probs=batch["draft_probs"][rows],
        target_probs=batch["target_probs"][rows],
        bonus_token_ids=batch["bonus_token_ids"][perm],
        is_greedy=batch["is_greedy"][perm],
        uniforms=batch["uniforms"][rows],
        recovery_noise=batch["recovery_noise"][perm],
    )
    out_p, acc_p = run_both(permuted, max_num_draft=4)
    assert torch.equal(out_p, out[perm]) and torch.equal(acc_p, acc[perm])


# ---------------------------------------------------------------------------------------------
# T3 for the vocabulary splits: every split count gives the reference's bits.
# ---------------------------------------------------------------------------------------------

SPLIT_CASES = [  # (vocab, block_v, splits asked): split counts and last-split sizes differ
    (101, 16, 1),  # one program per request: a single split of 101 ids
    (101, 16, 2),  # 64 + 37: the last split ends in a partial chunk
    (101, 16, 3),  # 48 + 48 + 5
    (101, 16, 7),  # one chunk per split, the last one 5 ids
    (37, 8, 64),  # more splits asked than chunks: 5 splits of one chunk (8 * 4 + 5)
]


def test_split_layout():
    """Split sizes are multiples of block_v, no split is empty, the count never exceeds the
    chunks; on CUDA the default fills the SMs (here a fake 132-SM device, V = 151936)."""
    cpu = torch.device("cpu")
    got = [rs._split_layout(v, 5, bv, cpu, s) for v, bv, s in SPLIT_CASES]
    assert got == [(1, 112), (2, 64), (3, 48), (7, 16), (5, 8)]
    assert rs._split_layout(151936, 64, 1024, cpu, None) == (1, 151552 + 1024)  # interpreter
    with pytest.raises(ValueError, match="splits"):
        rs._split_layout(101, 5, 16, cpu, 0)


def test_split_layout_default_fills_the_gpu(monkeypatch):
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(rs.torch.cuda, "get_device_properties", lambda device: props)
    cuda, vocab = torch.device("cuda"), 151936
    block_v = rs._launch_config(vocab)[0]
    chunks = -(-vocab // block_v)
    for batch in (1, 4, 16, 64, 256):
        s, split_v = rs._split_layout(vocab, batch, block_v, cuda, None)
        assert split_v % block_v == 0 and (s - 1) * split_v < vocab <= s * split_v
        assert split_v >= rs._MIN_CHUNKS_PER_SPLIT * block_v or s == 1
        # at least 4 programs per SM, unless splits would fall below the minimum size
        assert batch * s >= min(4 * 132, batch * (chunks // rs._MIN_CHUNKS_PER_SPLIT)), batch


@pytest.mark.parametrize("full_q", [True, False], ids=["full_q", "one_hot_q"])
@pytest.mark.parametrize("vocab,block_v,splits", SPLIT_CASES, ids=str)
@pytest.mark.usefixtures("poison_empty")
def test_split_kernel_matches_reference(vocab, block_v, splits, full_q):
    """Two ragged batches (one request without drafts) in which every request position is
    greedy once and random once."""
    mixed = [True, False, True, False, False]
    for seed, greedy in ((20, mixed), (21, [not g for g in mixed])):
        batch = make_batch([1, 4, 0, 3, 7], vocab, seed=seed, full_q=full_q, greedy=greedy)
        out, num_acc = run_both(batch, block_v=block_v, splits=splits)
        expected = oracle(batch)
        assert torch.equal(out, expected[0]) and torch.equal(num_acc, expected[1])
        check_layout(out, num_acc, batch)


@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.usefixtures("poison_empty")
def test_split_partials_of_empty_and_single_split_residuals(splits):
    """p > 0 only on ids 33..46 and 81..89 (a top-k support inside two of the 7 splits).
    Request 0: q = 1.5 p >= p, the residual is empty everywhere: the race on p, where splits
    with p == 0 report (-1, first id) without sweeping. Request 1: p == 0 everywhere
    (degenerate): every score is -1, the lowest id 0 wins. Request 3: p == q but for mass
    moved from the draft to id 70, the only residual: splits whose local residual is empty
    still race on p, and the residual's 70 must win."""
    vocab, g = 101, torch.Generator().manual_seed(24)
    batch = make_batch([1, 1, 2, 1], vocab, seed=24, full_q=True, greedy=[False] * 4)
    support = torch.cat([torch.arange(33, 47), torch.arange(81, 90)])
    p = torch.zeros(5, vocab)
    p[:, support] = torch.rand(5, len(support), generator=g) + 0.1
    p = p / p.sum(-1, keepdim=True)
    p[1] = 0.0
    q = p * 1.5
    q[1] = 1.0 / vocab
    d = torch.tensor([int(support[0]), 7, int(support[3]), int(support[5]), int(support[1])])
    q[4] = p[4]
    moved = p[4, d[4]] / 2
    p[4, d[4]] -= moved
    p[4, 70] = moved
    batch.update(target_probs=p, draft_probs=q, draft_token_ids=d, uniforms=torch.ones(5))
    out, num_acc = run_both(batch, block_v=16, splits=splits)
    assert num_acc.tolist() == [0, 0, 0, 0]
    assert int(out[0, 0]) in support.tolist() and out[1, 0] == 0 and out[3, 0] == 70
    assert torch.equal(out, oracle(batch)[0])


def test_launcher_rejects_bad_inputs():
    batch = to_device(make_batch([2, 1], 37, seed=13))
    bad = [
        dict(draft_token_ids=batch["draft_token_ids"].int()),
        dict(uniforms=batch["uniforms"].double()),
        dict(is_greedy=batch["is_greedy"].int()),
        dict(recovery_noise=batch["recovery_noise"][:, :36]),
        dict(target_probs=batch["target_probs"].t().contiguous().t()),
        dict(draft_probs=batch["draft_probs"][:, :36]),
        dict(bonus_token_ids=batch["bonus_token_ids"][:1]),
    ]
    for change in bad:
        for fn in (rs.rejection_sample, rs.rejection_sample_ref):
            with pytest.raises(ValueError):
                fn(**{**batch, **change})
    with pytest.raises(ValueError, match="power of two"):
        rs.rejection_sample(**batch, block_v=48)
    with pytest.raises(ValueError, match="splits"):
        rs.rejection_sample(**batch, splits=0)


# ---------------------------------------------------------------------------------------------
# T2: the first emitted token is distributed as the target p (chi-square).
# ---------------------------------------------------------------------------------------------

P_VALUE_FLOOR = 1e-4  # seeded runs: a correct sampler passes with these seeds deterministically
# Without scipy: the chi-square critical value at alpha = 1e-4 for <= 12 degrees of freedom
# is below 37.9 (12 dof: 37.9); we use the 12-dof value as a conservative bound.
CHI2_CRITICAL_12DOF = 37.9


def assert_distributed_as(tokens: torch.Tensor, p: torch.Tensor):
    """tokens [T] int64 ~ p [V]: never a p = 0 token, and a chi-square goodness-of-fit test."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    zero = p == 0
    assert counts[zero].sum() == 0, f"emitted p = 0 tokens: {counts[zero]}"
    observed, expected = counts[~zero], p[~zero].double() * tokens.numel()
    expected = expected * (observed.sum() / expected.sum())
    if chisquare is not None:
        pvalue = chisquare(observed.numpy(), expected.numpy()).pvalue
        assert pvalue > P_VALUE_FLOOR, f"chi-square p-value {pvalue}: {observed} vs {expected}"
    else:  # pragma: no cover
        assert observed.numel() <= 13
        stat = float(((observed - expected) ** 2 / expected).sum())
        assert stat < CHI2_CRITICAL_12DOF, f"chi-square {stat}: {observed} vs {expected}"


def target_probs_for_stats(vocab: int) -> torch.Tensor:
    """A target distribution after top-k / top-p: a few exact zeros, a long tail."""
    logits = torch.linspace(2.0, -2.0, vocab)[
        torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    ]
    probs = logits_to_probs(
        logits[None], torch.tensor([1.0]), torch.tensor([vocab - 2]), torch.tensor([0.97])
    )[0]
    assert (probs == 0).sum() >= 2
    return probs


def adversarial_q(p: torch.Tensor) -> torch.Tensor:
    """Draft mass on the tokens the target likes least, including its p = 0 tokens."""
    q = 1.0 / (p + 0.02)
    return q / q.sum()


def first_token_trials(p, q, num_trials, *, drafts_per_request, seed, one_hot_draft=None, fn=None):
    """Run `num_trials` independent requests whose draft rows all have target p (and q)."""
    vocab = p.numel()
    g = torch.Generator().manual_seed(seed)
    n = num_trials * drafts_per_request
    target = p.expand(n, vocab).contiguous()
    if q is not None:
        draft_probs = q.expand(n, vocab).contiguous()
        d = torch.multinomial(q, n, replacement=True, generator=g)  # d ~ q
    else:
        draft_probs = None
        d = torch.full((n,), one_hot_draft, dtype=torch.int64)  # a fixed (greedy) draft
    seeds = torch.randint(0, 2**62, (num_trials,), generator=g)
    positions = torch.randint(0, 4096, (num_trials,), generator=g)
    cu = torch.arange(num_trials + 1) * drafts_per_request
    batch = dict(
        draft_token_ids=d,
        cu_num_draft=cu,
        draft_probs=draft_probs,
        target_probs=target,
        bonus_token_ids=torch.zeros(num_trials, dtype=torch.int64),
        is_greedy=torch.zeros(num_trials, dtype=torch.bool),
        # the engine's own seeded randomness, keyed by (seed, position)
        uniforms=uniforms_for(seeds, positions, cu, n),
        recovery_noise=exponential_noise(seeds, positions, vocab),
    )
    out, _ = (fn or rs.rejection_sample_ref)(**to_device(batch), max_num_draft=drafts_per_request)
    return out[:, 0].cpu()


VOCAB_STATS = 13


@pytest.mark.parametrize(
    "case", ["full_q_adversarial", "full_q_uniform", "one_hot_on_p0_token", "one_hot_on_low_p"]
)
@pytest.mark.parametrize("drafts_per_request", [1, 3])
def test_first_token_matches_target_distribution(case, drafts_per_request):
    p = target_probs_for_stats(VOCAB_STATS)
    q, one_hot = None, None
    if case == "full_q_adversarial":
        q = adversarial_q(p)
    elif case == "full_q_uniform":
        q = torch.full_like(p, 1.0 / VOCAB_STATS)
    elif case == "one_hot_on_p0_token":
        one_hot = int(torch.nonzero(p == 0)[0])
    else:
        one_hot = int(torch.argmin(torch.where(p > 0, p, 2.0)))
    tokens = first_token_trials(
        p, q, 30_000, drafts_per_request=drafts_per_request, seed=100, one_hot_draft=one_hot
    )
    assert_distributed_as(tokens, p)


def test_first_token_distribution_kernel_small():
    """The same statistic on the Triton kernel (few trials: the interpreter is slow)."""
    p = torch.tensor([0.45, 0.0, 0.3, 0.15, 0.1, 0.0])
    q = torch.tensor([0.05, 0.4, 0.05, 0.1, 0.1, 0.3])  # mass on p = 0 and low-p tokens
    tokens = first_token_trials(p, q, 240, drafts_per_request=1, seed=200, fn=rs.rejection_sample)
    assert_distributed_as(tokens, p)


def test_statistics_detect_a_wrong_sampler():
    """The test has power: skipping the residual (recover from p, not max(p - q, 0)) fails."""
    p = target_probs_for_stats(VOCAB_STATS)
    q = adversarial_q(p)

    def wrong(**kw):  # right acceptance test, but the recovered token is sampled from p
        out, num_acc = rs.rejection_sample_ref(**kw)
        rejected = num_acc == 0
        out[rejected, 0] = sample_from_probs(kw["target_probs"], kw["recovery_noise"])[rejected]
        return out, num_acc

    tokens = first_token_trials(p, q, 30_000, drafts_per_request=1, seed=300, fn=wrong)
    with pytest.raises(AssertionError):
        assert_distributed_as(tokens, p)
