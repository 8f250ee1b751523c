"""The MTP runner against vLLM Model Runner V2's multi-module contract (REFERENCES C, points
1-5), and training against it (S7 extended, S9 per module under the window shift), for both
layouts: `mrv2` (module m at the window position p itself) and `deepseek` (p + m).

Each test states the contract point it pins; the oracle is the contract's own wording
("module m computes position p's KV from token p+m+1", "at RoPE position p", "the last
max(0, r-1) positions are re-run"), written out here, not our proposer's helpers."""

from __future__ import annotations

import pytest
import torch

from draftinfer.decoding.proposer import FirstPass
from draftinfer.kinds.mtp.proposer import cached_mtp_forward, mtp_window_module
from draftinfer.registry import drafter_spec
from drafttrain.registry import train_spec
from tests.support.kind_factories import small_drafter
from tests.support.mtp_rounds import MTPSequence, assert_kv_equal, hist_rows_run

N = 3
LAYOUTS = ["mrv2", "deepseek"]


def _drafter(layout: str, rope: str = "1d", **kw):
    return small_drafter("mtp", rope, n_predict=N, layout=layout, **kw)


def _shift(layout: str, m: int) -> int:
    """RoPE offset of module m's rows: MRv2 runs module m "at RoPE position p"; the DeepSeek
    layout keeps Megatron's depth-advanced positions."""
    return 0 if layout == "mrv2" else m


# ---- points 1-3: window shift, RoPE position, hidden chaining, sampling position ----------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rope", ["1d", "mrope"])
def test_window_shift_positions_and_chaining(layout, rope):
    """Step m runs module m over every window row p with the token t_{p+m+1} (past the last
    row: the bonus token's successors are the drafts of steps < m), at RoPE position p (mrv2),
    with module m-1's output at p as its hidden input; draft m comes from the last row."""
    d = _drafter(layout, rope)
    seq = MTPSequence(d, rope=rope)
    prop = seq.proposer(record=True)
    P = 9
    prop.propose(prop.admit(seq.rows(0, P)), torch.tensor([0]), N)  # rows 0..P-1 committed
    seq.calls.clear()
    fp = seq.rows(P, P + 1)  # the round's first pass: row P consumes the bonus t_{P+1}
    seen = []

    def choose(logits, step):
        seen.append(logits.clone())
        return logits.argmax(-1), None

    drafts, _ = prop.propose(fp, torch.tensor([N]), N, choose)
    drafts = drafts[0].tolist()
    assert [c[0] for c in seq.calls] == list(range(N))
    carried = None
    for m, ids, h_in, rope_pos, cache_pos, carry in seq.calls:
        live = cache_pos[0] >= 0
        p = cache_pos[0][live]  # the window's positions (= cache indices = row numbers)
        assert int(p[-1]) == P
        known = torch.cat([seq.tok[: P + 2], torch.tensor(drafts)])  # t_0..t_{P+1}, drafts
        torch.testing.assert_close(ids[0][live], known[p + m + 1], rtol=0, atol=0)
        want_pos = seq.pos[..., p] + _shift(layout, m)
        assert torch.equal(rope_pos[..., 0, :][..., live], want_pos)
        if m == 0:
            assert torch.equal(h_in[0][live], seq.feat[p])  # the target's feature at p
        else:
            assert torch.equal(h_in[0][live], carried)  # module m-1's output at p
        carried = carry[0][live]
    # Draft m predicts t_{e+m+2} from module m's last row e = P: the logits we were shown are
    # module m's at the last live row.
    assert len(seen) == N


# ---- point 4: prefill lookahead --------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split", [2, 5, 8])
def test_prefill_lookahead_writes_exact_kv(layout, split):
    """A prompt chunk admitted with the next prompt tokens as lookahead leaves every module's
    KV exact at every chunk row at once (the continuation re-prefills nothing); without
    lookahead only the pending token is known and N-2 rows wait for the re-prefill."""
    d = _drafter(layout)
    seq = MTPSequence(d)
    P = 12
    for lookahead, rerun in ((seq.tok[split + 1 : split + N][None], 0), (None, N - 2)):
        prop = seq.proposer(record=True)
        seq.calls.clear()
        prop.admit(seq.rows(0, split), lookahead=lookahead)
        if lookahead is not None:
            # Rows 0..split-2 are admitted; module m's rows consume up to t_{split-1+m}.
            got = prop.kv_snapshot(0, split + N - 1)
            want = seq.fresh_kv(split + N - 1)
            for m in range(N):
                n = split - 1  # rows the admit wrote
                assert_kv_equal(
                    [got[2 * m][:n], got[2 * m + 1][:n]],
                    [want[2 * m][:n], want[2 * m + 1][:n]],
                    f"module {m} after admit",
                )
        seq.calls.clear()
        prop.propose(seq.rows(split - 1, P), torch.tensor([0]), N)  # the next chunk
        assert hist_rows_run(seq.calls, N) == min(rerun, split - 1)
        assert_kv_equal(prop.kv_snapshot(0, P), seq.fresh_kv(P), "after the next chunk")


# ---- point 5 and S7 extended: forced rejections r = 1..N at every chunk boundary -----------
def _forced_rejection_rounds(layout: str, r: int, splits) -> None:
    """A prompt prefilled in two chunks (split at `splits`), then rounds of K = N drafts of
    which r are rejected: each round re-prefills exactly max(0, r-1) history rows, and after
    every round each module's KV at committed rows equals a fresh prefill."""
    d = _drafter(layout)
    seq = MTPSequence(d)
    P, accept = 10, N - r
    for split in splits:
        prop = seq.proposer(record=True)
        prop.admit(seq.rows(0, split))
        prop.propose(seq.rows(split - 1, P), torch.tensor([0]), N)  # continued prefill
        assert_kv_equal(prop.kv_snapshot(0, P), seq.fresh_kv(P), f"split {split}: prefill")
        a, b = P, P + 1  # the bonus of the prefill round
        for i in range(3):
            seq.calls.clear()
            end = seq.round(prop, a, b, N, accept)
            if i > 0:
                assert hist_rows_run(seq.calls, N) == max(0, r - 1), (split, i)
            assert_kv_equal(prop.kv_snapshot(0, b), seq.fresh_kv(b), f"split {split} round {i}")
            a, b = b, end


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("r", range(1, N + 1))
def test_reprefill_after_forced_rejections_equals_fresh_prefill(layout, r):
    _forced_rejection_rounds(layout, r, [4])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("r", range(1, N + 1))
def test_reprefill_at_every_chunk_boundary(layout, r):
    """The same at every position of the chunk boundary (split = 1 .. P-1)."""
    _forced_rejection_rounds(layout, r, range(1, 10))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_rows_write_nothing(layout):
    """History rows that are not stale are padding: the round leaves their KV untouched,
    bit for bit; it writes only the stale rows and the first pass (padding slots write into
    the cache's scratch column, index max_seq_len, which no query reads: vLLM's
    PAD_SLOT_ID)."""
    d = _drafter(layout)
    seq = MTPSequence(d)
    prop = seq.proposer(record=True)
    P = 10
    prop.propose(prop.admit(seq.rows(0, P)), torch.tensor([0]), N)
    a, b = P, P + 1
    for accept in (N, 1, 0, N):  # r = 0, N-1, N, 0
        before = [x.clone() for x in (*prop.cache.k, *prop.cache.v)]
        seq.calls.clear()
        end = seq.round(prop, a, b, N, accept)
        ran = set(seq.calls[0][4][0][seq.calls[0][4][0] >= 0].tolist()) | {64}  # + scratch
        after = (*prop.cache.k, *prop.cache.v)
        for x, y in zip(before, after):
            changed = (x[0] != y[0]).flatten(1).any(1).nonzero().flatten().tolist()
            assert set(changed) <= ran, (accept, changed, ran)
        a, b = b, end


# ---- S9 per module under the window shift ----------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rope", ["1d", "mrope"])
@pytest.mark.parametrize("anchor", [0, 4, 9])
def test_s9_each_module_trained_as_served(layout, rope, anchor):
    """Module m trained at row p on (h^{m-1}_p, t_{p+m+1}) with label t_{p+m+2}: the trainer's
    logits of module m at row `anchor` equal the runner's draft m after committed row
    `anchor`, for every m (teacher-forced drafts, so both sides see one window)."""
    d = _drafter(layout, rope)
    tspec = train_spec("mtp")
    obj = tspec.objective(d, tspec.config_class(layout=layout), "eager")
    seq = MTPSequence(d, rope=rope)
    T = 15
    ids, feats, pos = seq.tok[:T][None], seq.feat[:T][None], seq.pos[..., :T].unsqueeze(-2)
    with torch.no_grad():
        train_logits = obj.anchor_logits(ids, feats, pos, anchor, N)
    prop = seq.proposer()
    n = anchor + 1
    fp = FirstPass(
        torch.tensor([0]), ids[:, 1 : n + 1], feats[:, :n], torch.arange(n)[None], pos[..., :n]
    )
    seen = []

    def teacher(logits, step):
        seen.append(logits.clone())
        return ids[:, anchor + 2 + step], None

    prop.propose(prop.admit(fp), torch.tensor([N]), N, teacher)
    for m in range(N):
        torch.testing.assert_close(seen[m], train_logits[m : m + 1], rtol=1e-5, atol=1e-5)


def test_mrv2_layout_refuses_module_reuse():
    from draftinfer.files.errors import CheckpointError

    d = _drafter("mrv2")
    with pytest.raises(CheckpointError, match="mrv2 layout") as e:
        drafter_spec("mtp").check_k(d.config, 2 * N)
    assert "\n" not in str(e.value)


# ---- lossless greedy with forced rejections, KV refreshed after every round -----------------
@pytest.fixture(scope="module")
def mrv2_zoo(tmp_path_factory, zoo_target):
    """The zoo recipe's MTP trained in the mrv2 layout, loaded from its export."""
    from draftinfer.files.checkpoint import load_drafter
    from drafttrain.jobs.job import run_job
    from tests.conftest import ZOO_RECIPE
    from tests.support.presets import compose_preset

    out = tmp_path_factory.mktemp("mtp_mrv2")
    s = run_job(
        compose_preset(
            "mtp3",
            [f"output_dir={out}", *ZOO_RECIPE, "drafter.layout=mrv2", "export.verify=false"],
        )
    )
    return load_drafter(s["export_dir"], zoo_target.shared_weights())[0]


def _forced_engine_rounds(target, d, r: int) -> None:
    """The engine with K = N whose drafts from step N-r on are the drafter's least likely
    token (so r of them are rejected): greedy output equals plain greedy, drafts were
    accepted, and after
    every round every module's KV at committed rows equals a fresh prefill with the target's
    features."""
    from draftinfer.conventions.slots import Slots
    from draftinfer.decoding.baseline import greedy_generate
    from draftinfer.decoding.engine import Request, SpecDecoder, _Active
    from draftinfer.decoding.sampling import SamplingParams
    from tests.support.prompts import zoo_prompts

    dec = SpecDecoder(target, d, N, max_batch=1, max_model_len=256)
    propose = dec.proposer.propose
    states = []

    def forced(fp, num_drafts, k, choose, attn_len=None):
        def bad(logits, step):
            c, q = choose(logits, step)
            return (logits.argmin(-1) if step >= N - r else c), q

        out = propose(fp, num_drafts, k, bad, attn_len)
        states.append((len(slot.tokens), dec.proposer.kv_snapshot(0, len(slot.tokens) - 1)))
        return out

    dec.proposer.propose = forced
    p = zoo_prompts(1, seed=21)[0]
    slot = _Active(0, Request(p, SamplingParams(0.0, seed=0), max_tokens=40), 0, list(p))
    dec._admit([slot])
    while slot.finish is None:
        dec._round([slot])
    assert slot.out and slot.out == greedy_generate(target, [p], 40)[0][: len(slot.out)]
    assert max(slot.accepted) <= N - r  # every corrupted draft was rejected
    if r < N:
        assert sum(slot.accepted) > 0
    for L, got in states[1:]:
        tokens = slot.tokens[:L]
        out = target(
            torch.tensor([tokens[:-1]]),
            Slots(torch.tensor([1]), torch.arange(L - 1)[None]),
            d.config.features,
        )
        fresh = drafter_spec("mtp").proposer_class(d, 2, 256, torch.device("cpu"), torch.float32)
        fp = FirstPass(
            torch.tensor([0]),
            torch.tensor([tokens[1:]]),
            out.features,
            torch.arange(L - 1)[None],
            out.rope_pos,
        )
        fresh.propose(fresh.admit(fp), torch.tensor([0]), N)
        assert_kv_equal(got, fresh.kv_snapshot(0, L - 1), f"r={r}, {L} committed")


@pytest.mark.slow
@pytest.mark.parametrize("r", range(1, N + 1))
def test_lossless_with_forced_rejections_deepseek(kind_env, r):
    env = kind_env("mtp")
    _forced_engine_rounds(env["target"], env["drafter"], r)


@pytest.mark.slow
@pytest.mark.parametrize("r", range(1, N + 1))
def test_lossless_with_forced_rejections_mrv2(mrv2_zoo, zoo_target, r):
    _forced_engine_rounds(zoo_target, mrv2_zoo, r)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_window_drafts_and_writes_what_the_eager_one_does(layout):
    """The runner compiles each module's window step in one piece (`mtp_window_module`: token
    shift, module, head). Traced by dynamo (`aot_eager`: the trace without code generation, so
    the CPU needs no compiler), three rounds draft the same tokens and leave the same KV in
    every module's cache as the eager window. Compiled as the engine compiles it
    (`dynamic=True`), from a fresh dynamo: hitting the recompile limit (a silent eager
    fallback) fails the test."""
    d = _drafter(layout)
    seq = MTPSequence(d)
    runs = []
    torch._dynamo.reset()
    for compile_it in (False, True):
        prop = seq.proposer()
        if compile_it:
            prop.compile(backend="aot_eager", dynamic=True)
        P, drafts = 9, []
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            prop.propose(prop.admit(seq.rows(0, P)), torch.tensor([0]), N)
            for a, b in ((P, P + 1), (P + 1, P + 3), (P + 3, P + 4)):
                drafts.append(prop.propose(seq.rows(a, b), torch.tensor([N]), N)[0])
        runs.append((torch.cat(drafts), [k.clone() for k in prop.cache.k]))
    assert torch.equal(runs[0][0], runs[1][0])
    for eager, traced in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(traced, eager, atol=1e-6, rtol=0)


def _rounds_state(seq: MTPSequence, prop, plan) -> tuple[list, list, list]:
    """A prompt prefilled in two chunks, then rounds `(k, cap, accept)` (k drafts, at most
    `cap` live, the first `accept` right), every first pass with an idle second row; attention
    length given, as the engine gives it (no host sync). -> (the draft logits of every step,
    the drafts and the per-request cache after every round)."""
    seen, drafts, hist = [], [], []
    P, split, L = 9, 4, prop.max_seq_len
    prop.admit(seq.rows(0, split, idle=True), L)
    prop.propose(seq.rows(split - 1, P, idle=True), torch.tensor([0, 0]), N, attn_len=L)
    a, b = P, P + 1
    for k, cap, accept in plan:
        forced = seq.forced(b, accept)

        def choose(logits, step, forced=forced):
            seen.append(logits.clone())
            return forced(logits, step)

        fp = seq.rows(a, b, idle=True)
        drafts.append(prop.propose(fp, torch.tensor([cap, 0]), k, choose, L)[0])
        h = prop.hist
        hist.append([x.clone() for x in (h.ids, h.features, h.cache_pos, h.rope_pos)])
        hist[-1].append(prop.hist_ext.clone())
        a, b = b, b + accept + 1
    return seen, drafts, hist


@pytest.mark.parametrize(
    "whole", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["glue", "whole"]
)
def test_compiled_round_drafts_and_keeps_what_the_eager_one_does(whole):
    """`compile()` runs the glue of a round as compiled pieces too: the window's inputs
    (`mtp_window_inputs`: the history rows, the stale ones to re-run, the last live row, the
    draft buffer) and the per-request cache update (`mtp_keep_history`, in place). With the
    engine's options (dynamic shapes) and no graph break or silent eager fallback (fullgraph,
    the recompile limit an error), traced by dynamo (`aot_eager`: no compiler needed), rounds
    with all, none and some drafts accepted, a draft cap, module reuse (K = 2N) and an idle row
    see the same draft logits, draft the same tokens and leave the same `hist` / `hist_ext` and
    KV as the eager proposer. `glue`: the module pieces stay eager (tracing the drafter under
    dynamic shapes costs seconds per module; the test above traces them); `whole`: all."""
    d = _drafter("deepseek")
    seq = MTPSequence(d)
    plan = [(N, N, N), (N, N, 0), (N, 2, 2), (N, N, 1), (2 * N, 2 * N, 4), (N, N, 2)]
    runs = []
    # Static-shape traces of earlier tests count against the same code objects' limit.
    torch._dynamo.reset()
    for compile_it in (False, True):
        prop = seq.proposer()
        if compile_it:
            prop.compile(backend="aot_eager", dynamic=True, fullgraph=True)
            if not whole:
                prop._module, prop._fwd = mtp_window_module, cached_mtp_forward
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            runs.append((*_rounds_state(seq, prop, plan), [*prop.cache.k, *prop.cache.v]))
    (seen, drafts, hist, kv), (seen_c, drafts_c, hist_c, kv_c) = runs
    assert len(seen) == len(seen_c) == sum(k for k, _, _ in plan)
    for eager, traced in zip(seen, seen_c):
        torch.testing.assert_close(traced, eager, atol=1e-6, rtol=0)
    assert [x.tolist() for x in drafts] == [x.tolist() for x in drafts_c]
    assert any(x[0, 2] == 0 for x in drafts)  # the capped round's last draft
    for eager, traced in zip(hist, hist_c):
        for x, y in zip(eager, traced):
            assert torch.equal(x, y)
    for x, y in zip(kv, kv_c):
        torch.testing.assert_close(y, x, atol=1e-6, rtol=0)
