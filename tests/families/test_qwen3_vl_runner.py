"""Qwen3-VL through the runner (issue 9): M1, M2, M3, T1 and S9 on image+text prompts, and
wrong conventions injected to show that each check can fail.

A tiny random Qwen3-VL (`tests/support/vl_fixtures.py`) runs as the native target on four prompts:
text only; one `[1, 4, 6]` image (6 tokens, positions advance by `max(4, 6) // 2 = 3`); two
images; an image in the first slots. The prefill is chunked by 5 so images straddle chunk
boundaries. Every position check is against convention 3 written out by hand here (and that
oracle against transformers' `get_rope_index`); vision embeddings against the tower run
independently.

Drafters that accept: eagle3 and ptd drafters built by their `TrainSpec.init_drafter` against
the native target and trained for a few dozen steps by their real objectives on the target's
own greedy continuations of these prompts (a random tiny target repeats tokens, so the drafter
learns its outputs quickly). The AL floors are on those prompts: a mechanics check that drafts
are accepted (and rejected), not a quality number.

Also: plain greedy with images == transformers' `generate`; fast path == reference loop with
sampling; `run_eval` (`python -m draftinfer`) on image+text `messages` data through a target
that ships a processor (`tests/support/vl_data_fixtures.py`); one-line errors for bad `mm_inputs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from draftinfer.conventions.metrics import acceptance_length
from draftinfer.conventions.window import TokenEmbeds
from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.proposer import FirstPass
from draftinfer.decoding.reference import reference_generate
from draftinfer.decoding.sampling import SamplingParams
from draftinfer.files.loading import load_native_target
from draftinfer.registry import drafter_spec, family_spec
from tests.support.kind_factories import kinds_for_family, randomized, servable
from tests.support.round_logits import compare_round_logits, record_fast, record_reference
from tests.support.utils import assert_close
from tests.support.vl_drafters import build_drafter, target_window, train
from tests.support.vl_fixtures import IMG, MERGE, image_tokens, mm_inputs, save_tiny_vl

# Every registered kind that fits the family (the kind x family pairs), and the kinds whose
# proposer the recording spies below understand (`_run(ids, feature, rope_pos, rows, ...)`).
KINDS = kinds_for_family("qwen3_vl")
RECORDED_KINDS = ("eagle3", "ptd")
MAX_LEN = 96
N_NEW = 24
CHUNK = 5  # prefill chunk: images straddle chunk boundaries in the left-padded batch

GRIDS = [[], [[1, 4, 6]], [[1, 4, 4], [1, 6, 4]], [[1, 4, 4]]]
# Greedy continuations of these (the fixture's random target) repeat a token and switch once.
PROMPTS = [
    [103, 217, 183, 137],
    [28, 216, 69, 20, *image_tokens([1, 4, 6]), 21],
    [125, 94, 152, *image_tokens([1, 4, 4]), 132, *image_tokens([1, 6, 4]), 75],
    [*image_tokens([1, 4, 4]), 51, 80, 75, 153],
]
MM = [mm_inputs(p, g, seed=10 + b) for b, (p, g) in enumerate(zip(PROMPTS, GRIDS))]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return save_tiny_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def target(vl_dir):
    return load_native_target(vl_dir, "cpu", torch.float32, len(PROMPTS), MAX_LEN)


@pytest.fixture(scope="module")
def plain(target):
    """Plain greedy decoding of the target alone (the lossless reference)."""
    return greedy_generate(target, PROMPTS, N_NEW, mm_inputs=MM)


@pytest.fixture(scope="module")
def drafters(target, plain, tmp_path_factory):
    """`drafters(kind)`: a drafter of `kind` trained on the target's continuations (once)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(kind: str) -> torch.nn.Module:
        if kind not in cache:
            spec, cfg, d = build_drafter(kind, target, tmp_path_factory.mktemp(kind))
            seqs = [p + c for p, c in zip(PROMPTS, plain)]
            cache[kind] = train(spec, cfg, d, target, seqs, MM)
        return cache[kind]

    return get


# ---- conventions written out (the oracles) ------------------------------------------------
def convention3(ids: list[int], grids: list[list[int]]) -> tuple[torch.Tensor, int]:
    """DESIGN 3.3 by hand: ([3, len(ids)] positions, mrope_delta). A text token sits at
    `current` on all axes (then current + 1); an image at `(current + t, current + h/merge,
    current + w/merge)` over its merged grid, after which current advances by
    `max(h, w) // merge`."""
    pos, cur, grid_iter, i = [], 0, iter(grids), 0
    while i < len(ids):
        if ids[i] != IMG:
            pos.append((cur, cur, cur))
            cur, i = cur + 1, i + 1
            continue
        t, h, w = next(grid_iter)
        assert t == 1
        pos += [(cur, cur + y, cur + x) for y in range(h // MERGE) for x in range(w // MERGE)]
        i += h * w // MERGE**2
        cur += max(h, w) // MERGE
    table = torch.tensor(pos).T
    return table, int(table.max()) + 1 - len(ids)


ORACLE = [convention3(p, g) for p, g in zip(PROMPTS, GRIDS)]


def expected_positions(req_of_row: dict[int, int], rows, cache_pos) -> torch.Tensor:
    """`[3, B, T]`: where the slot at cache index c of each row's request must sit: the
    prompt's table for c < P, `c + mrope_delta` on every axis after (decode, verify, draft
    and mask slots alike)."""
    out = torch.full((3, *cache_pos.shape), -1, dtype=torch.long)
    for b, row in enumerate(rows.tolist()):
        table, delta = ORACLE[req_of_row[row]]
        for t, c in enumerate(cache_pos[b].tolist()):
            if c >= 0:
                out[:, b, t] = table[:, c] if c < table.shape[1] else c + delta
    return out


def image_spans(ids: list[int]) -> list[tuple[int, int]]:
    """(first, last) slot of each image's run of placeholders."""
    spans: list[list[int]] = []
    for i, t in enumerate(ids):
        if t == IMG and i > 0 and ids[i - 1] == IMG:
            spans[-1][1] = i
        elif t == IMG:
            spans.append([i, i])
    return [(a, b) for a, b in spans]


def vision_embeds(target, req: int) -> torch.Tensor:
    """The tower's merged embeddings of request `req`'s images, run independently `[N, H]`."""
    m = MM[req]
    return target.encode_images(m["pixel_values"], m["image_grid_thw"])[0]


# ---- recording what the target and the drafter receive ---------------------------------
@dataclass
class Call:
    who: str  # "target" | "drafter"
    phase: str  # "admit" (prefill, drafter admission) | "round"
    req_of_row: dict[int, int]  # cache row -> request index at the time of the call
    rows: torch.Tensor  # [B]
    cache_pos: torch.Tensor  # [B, T]
    rope: torch.Tensor  # the positions used, cloned: [3, B, T] expected
    ids: torch.Tensor  # [B, T]
    embeds: torch.Tensor | None = None  # drafter: the input embeddings layer 0 received
    rope_ref: torch.Tensor | None = None  # target: the tensor it returned (not cloned)


def record(dec: SpecDecoder, mp, inject=None) -> tuple[list[Call], dict]:
    """Wrap the target forward and the proposer's drafter forward of `dec`. `inject(ids,
    rope_pos, cache_pos, mm) -> (ids, rope_pos, mm)` alters what the drafter gets (a wrong
    convention). Also checks, per round, that proposing leaves the first pass's positions
    and the target's `mrope_delta` untouched."""
    calls: list[Call] = []
    state: dict = {"map": {}, "phase": "round", "admissions": 0, "checked": 0, "changed": 0}
    target, prop, drafter = dec.target, dec.proposer, dec.drafter
    forward, run, propose, admit = target.forward, prop._run, prop.propose, dec._admit

    def call(who, rows, cache_pos, rope, ids, **kw) -> Call:
        c = Call(
            who,
            state["phase"],
            dict(state["map"]),
            rows.clone(),
            cache_pos.clone(),
            rope.clone(),
            ids.clone(),
            **kw,
        )
        calls.append(c)
        return c

    def admit_spy(slots):
        state["map"] = {**state["map"], **{s.row: s.idx for s in slots}}
        state["admissions"] += bool(slots)
        state["phase"] = "admit"
        try:
            admit(slots)
        finally:
            state["phase"] = "round"

    def target_spy(inputs, slots, features=None, **kw):
        out = forward(inputs, slots, features, **kw)
        ids = inputs.input_ids if hasattr(inputs, "input_ids") else inputs
        call("target", slots.rows, slots.cache_pos, out.rope_pos, ids, rope_ref=out.rope_pos)
        return out

    def drafter_spy(ids, feature, rope_pos, rows, cache_pos, attn_len, mm=None):
        if inject is not None:
            ids, rope_pos, mm = inject(ids, rope_pos, cache_pos, mm)
        seen = []
        hook = drafter.layers[0].register_forward_pre_hook(
            lambda _m, args: seen.append(args[0].clone())
        )
        try:
            out = run(ids, feature, rope_pos, rows, cache_pos, attn_len, mm)
        finally:
            hook.remove()
        call("drafter", rows, cache_pos, rope_pos, ids, embeds=seen[0])
        return out

    def propose_spy(fp, *a, **kw):
        before, delta = fp.rope_pos.clone(), target.mrope_delta.clone()
        out = propose(fp, *a, **kw)
        state["checked"] += 1
        unchanged = torch.equal(fp.rope_pos, before) and torch.equal(target.mrope_delta, delta)
        state["changed"] += not unchanged
        return out

    mp.setattr(dec, "_admit", admit_spy)
    mp.setattr(target, "forward", target_spy)
    mp.setattr(prop, "_run", drafter_spy)
    mp.setattr(prop, "propose", propose_spy)
    return calls, state


def requests(max_tokens: int = N_NEW, sampling=None) -> list[Request]:
    sampling = sampling or (lambda i: SamplingParams(temperature=0.0))
    return [
        Request(p, sampling(i), max_tokens=max_tokens, mm_inputs=m)
        for i, (p, m) in enumerate(zip(PROMPTS, MM))
    ]


def run_recorded(target, drafter, k, mp, inject=None, max_tokens=N_NEW, max_batch=2):
    """Generate all prompts through a recorded `SpecDecoder` (by default 2 rows, so later
    requests are admitted into rows freed mid-run)."""
    dec = SpecDecoder(
        target, drafter, k, max_batch=max_batch, max_model_len=MAX_LEN, prefill_chunk=CHUNK
    )
    calls, state = record(dec, mp, inject)
    outs, _ = dec.generate(requests(max_tokens))
    return calls, state, outs


# ---- the checks (each one is shown to fail on a wrong convention below) ------------------
def check_m1(calls: list[Call], who: tuple[str, ...]) -> None:
    """Every call's positions are `[3, B, T]` and every live slot sits where convention 3
    puts the token at its cache index."""
    for c in calls:
        if c.who not in who:
            continue
        assert c.rope.dim() == 3 and c.rope.shape[0] == 3, f"{c.who}: {tuple(c.rope.shape)}"
        live = c.cache_pos >= 0
        exp = expected_positions(c.req_of_row, c.rows, c.cache_pos)
        assert torch.equal(c.rope[:, live], exp[:, live]), f"{c.who} positions differ"


def check_m2(calls: list[Call], target) -> int:
    """The drafter rows of every admission: row i of a request consumes prompt token i+1 with
    the target's input embedding of it (the vision embedding of that placeholder, else the
    token embedding). Returns how many image rows were checked."""
    table = target.embed_tokens.weight
    n_image = 0
    for c in calls:
        if c.who != "drafter" or c.phase != "admit":
            continue
        for b, row in enumerate(c.rows.tolist()):
            req = c.req_of_row[row]
            prompt = PROMPTS[req]
            vis = vision_embeds(target, req) if GRIDS[req] else None
            for t, i in enumerate(c.cache_pos[b].tolist()):
                if i < 0:
                    continue
                tok = prompt[i + 1]
                assert int(c.ids[b, t]) == tok  # pairing: row i consumes t_{i+1}
                if tok == IMG:
                    expected = vis[prompt[: i + 1].count(IMG)]
                    n_image += 1
                else:
                    expected = table[tok]
                assert_close(c.embeds[b, t], expected)
    return n_image


def s9_compare(kind: str, target, plain, cache_dir, inject=None) -> None:
    """S9 on image rows: for anchors at the last placeholder of each image of request 2 (the
    rows before consumed image tokens), the trainer's `anchor_logits` over the target's window
    (`TokenEmbeds.of` its prefill output, its `[3, 1, T]` positions) equal the runner's first
    pass and k-th steps on the same weights."""
    spec, cfg, d = build_drafter(kind, target, cache_dir)
    randomized(d)  # O(1) weights: differences are not lost among tiny numbers
    seq = PROMPTS[2] + plain[2][:6]
    ids, _, out = target_window(target, [seq], [MM[2]], d.config.features)
    mm, pos, feats = TokenEmbeds.of(out), out.rope_pos, out.features
    assert mm is not None and pos.shape == (3, 1, len(seq))
    obj = spec.objective(d, cfg, "eager")
    k = 3
    for _, anchor in image_spans(seq):
        with torch.no_grad():
            train_logits = obj.anchor_logits(ids, feats, pos, anchor, k, mm)
        prop = drafter_spec(kind).proposer_class(d, 2, 64, torch.device("cpu"), torch.float32)
        if inject is not None:
            run = prop._run

            def patched(ids_, feature, rope_pos, rows, cache_pos, attn_len, mm_=None, run=run):
                ids_, rope_pos, mm_ = inject(ids_, rope_pos, cache_pos, mm_)
                return run(ids_, feature, rope_pos, rows, cache_pos, attn_len, mm_)

            prop._run = patched
        n = anchor + 1
        fp = FirstPass(
            torch.tensor([1]),
            ids[:, 1 : n + 1],
            feats[:, :n],
            torch.arange(n)[None],
            pos[..., :n],
            mm.shifted(1).rows(slice(0, n)),
        )
        seen = []

        def teacher(logits, step, anchor=anchor, seen=seen):
            seen.append(logits.clone())
            return ids[:, anchor + 2 + step], None

        prop.propose(prop.admit(fp), torch.tensor([k]), k, teacher)
        # fp32 policy on the logits' own scale (O(1) weights give logits ~10; the two sides
        # reduce in different orders).
        scale = train_logits.abs().max()
        assert_close(torch.cat(seen) / scale, train_logits / scale)


# ---- the tests ---------------------------------------------------------------------------
def test_oracle_is_transformers_get_rope_index(target, vl_dir):
    """The hand-written convention 3 equals transformers' own `get_rope_index` (a weightless
    `Qwen3VLModel` of the saved config), incl. the `[1, 4, 6]` grid advancing by 3 not 6."""
    from transformers import AutoConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    with torch.device("meta"):
        hf = Qwen3VLModel(AutoConfig.from_pretrained(vl_dir))
    for b, (prompt, grids) in enumerate(zip(PROMPTS, GRIDS)):
        ids = torch.tensor([prompt])
        grid = torch.tensor(grids) if grids else None
        pos, delta = hf.get_rope_index(ids, (ids == IMG).int(), grid)
        table, d = ORACLE[b]
        assert torch.equal(pos[:, 0], table) and int(delta) == d
    # Request 1: vision start at 4, its 2x3 merged grid at T 5, H 5..6, W 5..7, then the
    # vision end at 5 + max(4, 6) // 2 = 8 (not 5 + 6).
    table = ORACLE[1][0]
    assert table[:, 5:11].tolist() == [[5] * 6, [5, 5, 5, 6, 6, 6], [5, 6, 7, 5, 6, 7]]
    assert table[:, 11].tolist() == [8, 8, 8]
    assert [d for _, d in ORACLE] == [0, -3, -5, -2]


def test_plain_greedy_with_images_equals_transformers(target, plain, vl_dir):
    """The baseline the lossless check compares against: `greedy_generate` through the
    target's `prefill_plan` equals HF `generate` with the same pixels."""
    from transformers import Qwen3VLForConditionalGeneration as HFQwen3VL

    hf = HFQwen3VL.from_pretrained(str(vl_dir), dtype=torch.float32).eval()
    for b in (1, 2, 3):
        ids = torch.tensor([PROMPTS[b]])
        m = MM[b]
        kw = {"pixel_values": m["pixel_values"], "image_grid_thw": m["image_grid_thw"]}
        hf.model.rope_deltas = None
        ref = hf.generate(
            ids,
            mm_token_type_ids=torch.tensor([m["mm_token_type_ids"]]),
            max_new_tokens=8,
            do_sample=False,
            **kw,
        )
        assert plain[b][:8] == ref[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("kind", RECORDED_KINDS)
def test_m1_positions_everywhere(target, drafters, kind, monkeypatch):
    """`[3, N]` positions with the values of convention 3 in the chunked prefills, the verify
    forwards, the drafter's admission rows, its first passes, and its chain steps (eagle3) or
    mask slots at `p_last + m` (ptd); two cache rows, so requests are admitted mid-run."""
    d = drafters(kind)
    calls, state, outs = run_recorded(target, d, 3, monkeypatch)
    assert sum(a for o in outs for a in o.accepted) > 0 and state["admissions"] >= 2
    check_m1(calls, ("target", "drafter"))
    # What was checked: chunked prefills, verify forwards, drafter admissions and draft slots.
    prefill = [c for c in calls if c.who == "target" and c.phase == "admit"]
    verify = [c for c in calls if c.who == "target" and c.phase == "round"]
    assert len(prefill) > 2 and all(c.cache_pos.shape[1] <= CHUNK for c in prefill)
    assert verify and all(c.cache_pos.shape[1] == 4 for c in verify)
    drafted = [c for c in calls if c.who == "drafter" and c.phase == "round"]
    assert any(c.phase == "admit" for c in calls if c.who == "drafter")

    def past_prompt(c: Call) -> bool:
        lens = torch.tensor([len(PROMPTS[c.req_of_row[r]]) for r in c.rows.tolist()])
        return bool((c.cache_pos >= lens[:, None]).any())

    assert any(past_prompt(c) for c in drafted)
    if kind == "eagle3":  # chain steps: one slot per row, past the first pass
        assert any(c.cache_pos.shape[1] == 1 and past_prompt(c) for c in drafted)
    else:  # mask slots at live cache indices
        mask_id = d.config.mask_token_id
        assert any(bool(((c.ids == mask_id) & (c.cache_pos >= 0)).any()) for c in drafted)


@pytest.mark.parametrize("kind", RECORDED_KINDS)
def test_m2_shifted_vision_embeddings_and_untouched_positions(target, drafters, kind, monkeypatch):
    """Drafter rows consuming an image placeholder get that placeholder's vision embedding
    (the shifted window), including images cut by a prefill chunk boundary; proposing never
    changes the first pass's positions or the target's mrope_delta, and the position tensors
    the target returned are unchanged after the whole run (admissions mid-run included)."""
    calls, state, _ = run_recorded(target, drafters(kind), 3, monkeypatch)
    # Images straddle chunk boundaries of each left-padded prefill (column = P - P_b + i).
    straddling = 0
    for c in calls:
        if c.who == "target" and c.phase == "admit" and c.cache_pos[:, 0].max() <= 0:
            group = [PROMPTS[c.req_of_row[r]] for r in c.rows.tolist()]
            P = max(map(len, group))
            straddling += sum(
                (P - len(p) + first) // CHUNK != (P - len(p) + last) // CHUNK
                for p in group
                for first, last in image_spans(p)
            )
    assert straddling >= 2
    assert check_m2(calls, target) == sum(p[1:].count(IMG) for p in PROMPTS)
    assert state["checked"] > 0 and state["changed"] == 0
    for c in calls:
        if c.rope_ref is not None:
            assert torch.equal(c.rope_ref, c.rope)


# AL floors on the training prompts (measured: K=1 1.92 both kinds, eagle3 K=3 3.54, ptd K=4
# 4.0; drafts are rejected at each continuation's switch).
AL_FLOOR = {1: 1.5, 3: 2.5, 4: 2.5}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", ["min", "max"])
@pytest.mark.parametrize("max_batch", [2, 4])
@pytest.mark.parametrize("ahead", [False, True], ids=["one-at-a-time", "one-ahead"])
def test_m3_t1_lossless_greedy_with_images(target, plain, drafters, kind, k, max_batch, ahead):
    """Speculative greedy == plain greedy on image+text prompts (chunked prefill; batch 4, and
    batch 2 so rows are reused with a new request's mrope_delta), with drafts accepted, for
    every kind that fits the family, at the smallest and the largest K <= 4 it serves; each
    round read back before the next launch, and one round ahead (`pipeline`: a row is
    refilled, its mrope_delta rewritten, while a round that ran its old request is in flight)."""
    d = drafters(kind)
    ks = [k for k in (1, 2, 3, 4) if servable(kind, d.config, k)]
    k = ks[0] if k == "min" else ks[-1]
    dec = SpecDecoder(
        target,
        d,
        k,
        max_batch=max_batch,
        max_model_len=MAX_LEN,
        prefill_chunk=CHUNK,
        pipeline=ahead,
    )
    outs, _ = dec.generate(requests())
    assert [o.token_ids for o in outs] == plain
    accepted = [a for o in outs for a in o.accepted]
    print(
        kind,
        k,
        max_batch,
        acceptance_length(accepted),
        sum(o.proposed[i] - o.accepted[i] for o in outs for i in range(len(o.accepted))),
    )
    assert acceptance_length(accepted) > AL_FLOOR[k]


@pytest.mark.parametrize("kind", KINDS)
def test_fast_path_equals_reference_with_images(target, drafters, kind, monkeypatch):
    """Sampling (temperature 1, full-q verification): the fast path equals the reference
    loop, which recomputes the target (with its images) and the drafter (with the vision
    embeddings of its rows) from scratch each round: the same tokens, and the same drafter
    logits in every round and step. The reference loop's drafter inputs are checked against
    convention 3 as the fast path's are (M1, M2): row i consumes prompt token i+1 (its vision
    embedding at placeholders) at the target's `[3]` position of token i; it leaves them, and
    the position tables the target returned (it holds views of them), unchanged."""
    reqs = requests(10, lambda i: SamplingParams(1.0, seed=i))
    d = drafters(kind)
    dec = SpecDecoder(
        target,
        d,
        3,
        max_batch=len(PROMPTS),
        max_model_len=MAX_LEN,
        verify="full",
        prefill_chunk=CHUNK,
    )
    fast_logits = record_fast(dec, monkeypatch)
    fast = dec.generate(reqs)[0]
    ref_calls = record_reference(drafter_spec(kind).proposer_class, monkeypatch)
    returned: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = target.forward

    def target_spy(*a, **kw):
        out = forward(*a, **kw)
        returned.append((out.rope_pos, out.rope_pos.clone()))
        return out

    monkeypatch.setattr(target, "forward", target_spy)
    ref = reference_generate(target, d, reqs, 3, MAX_LEN, "full")
    for f, r in zip(fast, ref):
        assert f.token_ids == r.token_ids
        assert f.accepted == r.accepted and f.proposed == r.proposed
    assert sum(a for o in fast for a in o.accepted) > 0
    assert compare_round_logits(fast_logits, ref_calls, fast) > 10
    assert all(c.unchanged for c in ref_calls)
    assert returned and all(torch.equal(t, before) for t, before in returned)
    # Convention 3 on every reference round's drafter rows.
    calls = iter(ref_calls)
    n_image = 0
    for req, out in enumerate(ref):
        table, delta = ORACLE[req]
        prompt, P = PROMPTS[req], len(PROMPTS[req])
        vis = vision_embeds(target, req) if GRIDS[req] else None
        for _ in out.accepted:
            c = next(calls)
            R = c.ids.shape[0]
            exp = torch.stack(
                [table[:, i] if i < P else torch.full((3,), i + delta) for i in range(R)], 1
            )
            assert c.rope_pos.shape == (3, R) and torch.equal(c.rope_pos, exp)
            assert c.ids[: P - 1].tolist() == prompt[1:]  # row i consumes t_{i+1}
            mask, embeds = c.mm if c.mm is not None else (torch.zeros(R, dtype=torch.bool), None)
            want = torch.tensor([i + 1 < P and prompt[i + 1] == IMG for i in range(R)])
            assert torch.equal(mask, want)
            for i in torch.nonzero(mask).flatten().tolist():
                assert_close(embeds[i], vis[prompt[: i + 1].count(IMG)])
                n_image += 1
    assert n_image > 0


@pytest.mark.parametrize("kind", KINDS)
def test_s9_trainer_equals_runner_on_image_rows(target, plain, kind, tmp_path):
    s9_compare(kind, target, plain, tmp_path)


def _one_d(ids, rope, cache_pos, mm):
    """speculators' convention: the token index on every axis (no image grid, no delta)."""
    return ids, cache_pos.clamp(min=0)[None].expand(3, *cache_pos.shape), mm


def _shifted(ids, rope, cache_pos, mm):
    """Row i at the position of token i+1 (the window's token side shift applied to
    positions too, vLLM's multimodal-pruning bug)."""
    return ids, torch.cat([rope[..., 1:], rope[..., -1:] + 1], dim=-1), mm


def _no_vision(ids, rope, cache_pos, mm):
    """The drafter's text embedding of the placeholder id at image rows."""
    return ids, rope, None


def test_wrong_conventions_fail_the_checks(target, plain, drafters, monkeypatch, tmp_path):
    """Each injected wrong convention makes its check fail (M1 for positions, M2 for vision
    embeddings, S9 for all three), and the same checks pass without the injection (above)."""
    d = drafters("eagle3")
    # A bare [B, T] position tensor is refused by the drafter's M-RoPE rotary outright.
    with pytest.raises(ValueError, match=r"M-RoPE positions must be \[3"):
        d.rotary(torch.zeros(1, 4, dtype=torch.long))
    for inject in (_one_d, _shifted):
        with monkeypatch.context() as mp:
            calls, _, _ = run_recorded(target, d, 3, mp, inject, max_tokens=6)
        check_m1(calls, ("target",))  # the target's own positions stay right
        with pytest.raises(AssertionError, match="drafter positions differ"):
            check_m1(calls, ("drafter",))
        with pytest.raises(AssertionError):
            s9_compare("eagle3", target, plain, tmp_path, inject)
    with monkeypatch.context() as mp:
        calls, _, _ = run_recorded(target, d, 3, mp, _no_vision, max_tokens=6)
    check_m1(calls, ("target", "drafter"))
    with pytest.raises(AssertionError):
        check_m2(calls, target)
    with pytest.raises(AssertionError):
        s9_compare("eagle3", target, plain, tmp_path, _no_vision)


def test_run_eval_with_image_prompts(tmp_path):
    """`run_eval` (`python -m draftinfer`, and drafttrain's verify step) on image+text
    `messages` data with a Qwen3-VL target that ships a processor: prompts rendered through
    it, the exported drafter read from disk, lossless against plain greedy and the reference
    loop, drafts accepted."""
    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.prompts import load_prompts
    from draftinfer.evaluation.run import format_report, run_eval
    from draftinfer.files.checkpoint import write_drafter
    from tests.support.vl_data_fixtures import make_vl_target, write_vl_chat

    tdir = make_vl_target(tmp_path / "target")
    data = write_vl_chat(tmp_path / "data", n_train=1, n_test=6)
    target = load_native_target(tdir, "cpu", torch.float32, 6, 256)
    prompts, _ = load_prompts(str(data), "test", 6, family_spec("qwen3_vl"), str(tdir), 254)
    mm = [p.mm_inputs for p in prompts]
    assert sum(m is not None for m in mm) == 5  # one text-only row
    eos = target.config.eos_token_ids
    cont = greedy_generate(target, [p.ids for p in prompts], 16, eos, mm_inputs=mm)
    spec, cfg, d = build_drafter("eagle3", target, tmp_path / "vocab")
    train(spec, cfg, d, target, [p.ids + c for p, c in zip(prompts, cont)], mm)
    write_drafter(tmp_path / "export", d, {"target": str(tdir)}, dtype=torch.float32)
    cfg = InferConfig(
        drafter=str(tmp_path / "export"),
        prompts=str(data),
        num_prompts=6,
        k=3,
        batch_size=4,
        max_new_tokens=16,
        max_model_len=256,
        prefill_chunk=16,
        dtype="float32",
        device="cpu",
        check_reference=True,
        progress=False,
    )
    report = run_eval(cfg)
    assert report.lossless and report.image_prompts == 5, report
    assert report.acceptance_length > 1.3  # measured 1.84
    assert "(5 with images)" in format_report(report)


def test_bad_multimodal_inputs_are_one_line_errors(target):
    from tests.support.kind_factories import small_target_dir

    ids = torch.tensor([PROMPTS[1]])
    cache_pos = torch.arange(ids.shape[1])[None]
    rows = torch.tensor([0])
    good = MM[1]
    cases = [
        ({k: v for k, v in good.items() if k != "image_grid_thw"}, "'image_grid_thw' missing"),
        ({**good, "input_ids": ids}, "unknown key 'input_ids'"),
        ({**good, "image_grid_thw": torch.tensor([[1, 4, 4]])}, r"runs of \[6\] tokens.*\[4\]"),
        ({**good, "mm_token_type_ids": [2 * t for t in good["mm_token_type_ids"]]}, "video"),
        ({**good, "mm_token_type_ids": good["mm_token_type_ids"] * 2}, "26 entries for 13"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            target.prefill_plan(ids, cache_pos, rows, [bad])
        assert "\n" not in str(e.value) and str(e.value).startswith("request 0:")
    text = load_native_target(small_target_dir("1d"), "cpu", torch.float32, 1, 32)
    with pytest.raises(ValueError, match="is a text target"):
        text.prefill_plan(ids % 90, cache_pos, rows, [good])
    with pytest.raises(ValueError, match="is a text target"):
        greedy_generate(text, [PROMPTS[0]], 2, mm_inputs=[good])
