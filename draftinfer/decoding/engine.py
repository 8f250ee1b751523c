"""The speculative decoding loop (DESIGN section 2), for every drafter kind.

Vocabulary: a *round* = the proposer drafts up to K *drafts* per request -> the target scores
`[pending, d_1..d_K]` in one forward -> verification accepts `a` drafts and emits one more
token (the *recovered* token at the first rejection, or the *bonus* token when all K are
accepted) -> commit `a + 1` tokens -> the committed rows become the drafter's next first pass.

Invariants per request (length `L` = committed tokens, prompt included):
- the target KV holds cache indices `0..L-2`; the last committed token `t_{L-1}` is *pending*:
  it is the first slot of the next verify forward;
- the drafter state holds rows `0..L-2` built from target features once the round's first
  pass ran (convention 6); the first pass of a round is exactly the rows the last commit added.

Static shapes, one readback. The round works on all `max_batch` cache rows at once (batch row
b is cache row b; a row with no live request is all padding), with a first pass of fixed width
K + 1 and an attention length bucketed on the host (`attn_bucket`), so its shapes depend on
(max_batch, K, bucket) only. The host uploads the per-row lengths once per round (pinned,
asynchronous) and reads back once per round (the emitted tokens and accepted counts, for stop
checks and scheduling); the round's tensor work in between makes no host-device sync
(`sync_check=True` enforces it on CUDA with `torch.cuda.set_sync_debug_mode("error")`).

One round ahead (`pipeline=True`, the CUDA default). The round also leaves each row's next
(length, remaining tokens, live) on the device (`carry`): a row that is not stopped commits
`a + 1` tokens, and one that reaches `max_tokens` or `max_model_len` stops there (the host's
stop rules imply both, so the device never stops a row the host keeps). So the host launches
round i+1 before it reads round i back: its upload sets only the rows it knows (admitted,
finished, free; `set` = 1) and leaves the rows of the unread round to the carry. The device
never waits for the host's readback, Python and launch (0.1-0.4 ms a round at 8B shapes).
A request the host stops on reading round i (EOS, a stop string) has run round i+1 as well:
its results are dropped, and its stale KV is overwritten as a rejected draft's is. Outputs
are the same with and without it (tested).

Prefill inputs come from the target (`target.prefill_plan`, per chunk): text targets feed
the ids; a multimodal target (Qwen3-VL) feeds each chunk its vision rows and its own `[3, N]`
position table from the request's `mm_inputs` and records the request's `mrope_delta`, after
which every decode, verify and draft slot sits at `target.rope_positions(cache_pos, rows)`.
The engine names no family.

Drafter updates (`update_drafter`, `draftinfer.decoding.swap`): a versioned, weights-only update
is checked when it is given and copied into the running drafter between two rounds, at the top
of the loop (after the callback `between_rounds`, before admissions and the next launch), on
the round's stream: a round already launched finishes on the old weights, every later one
(and every later admission's drafter prefill) runs the new ones. Requests in flight continue;
nothing is recompiled or recaptured. Each round records the version that drafted it
(`RequestOutput.versions`; the stats' `al_by_version`).

Confidence-driven verification (`verify_threshold=tau`, `draftinfer.decoding.confidence`): after
drafting, each request's block is cut at the first slot whose cumulative confidence (the
product of the proposer's per-draft `confidences()`) falls below `tau`; only the drafts before
the cut are verified (the rest are padding rows of the verify forward: no KV write, never
accepted), and the token after the last verified one is the target's recovered or bonus
token as in any round. The cut is a `[B]` tensor folded into `num_drafts`: no host sync, the
same static shapes, so the round is captured as before. The table's draft count (and so
`RequestOutput.proposed`) is then the verified count. `record_confidence=True` also copies
each round's per-draft confidences back (`RequestOutput.confidences`, the calibration
report of `draftinfer.evaluation.calibration`).

Rejected drafts leave stale KV past the committed length in both caches; it is never read
(see `draftinfer.models.kv_cache`). Randomness is keyed by (request seed, position), so a request's
output does not depend on the rest of the batch (convention 12).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace

import torch
from draftkernels.chain_inputs import prepare_chain_inputs

from draftinfer.conventions.metrics import al_by_version
from draftinfer.conventions.slots import Slots, attn_bucket
from draftinfer.conventions.window import TokenEmbeds
from draftinfer.decoding.compiled import compiled, runner_compile_options, target_forward
from draftinfer.decoding.confidence import check_threshold, cut_lengths
from draftinfer.decoding.graphs import GraphedFunction
from draftinfer.decoding.proposer import FirstPass
from draftinfer.decoding.requests import Request, RequestOutput, apply_stops, finalize_text
from draftinfer.decoding.sampling import SamplingState, with_seed
from draftinfer.decoding.swap import DrafterUpdate, Staged, apply_staged, stage_update
from draftinfer.decoding.verify import Verifier
from draftinfer.registry import spec_of


@contextlib.contextmanager
def no_host_sync(enabled: bool, device: torch.device):
    """Within the block, any host-device sync on CUDA raises (the round's contract)."""
    if not enabled or device.type != "cuda":
        yield
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


@dataclass
class _Active:
    """A request bound to a cache row."""

    idx: int
    req: Request
    row: int
    tokens: list[int]  # committed tokens, prompt included
    out: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # emitted chunks, in order
    confidences: list[list[float]] = field(default_factory=list)  # per round, K each
    finish: str | None = None


@dataclass
class _Launched:
    """A round on the device: the requests it was launched for, the host buffer its
    `[B, K + 3]` table is copied into, the event that says it has been, and the launch time."""

    slots: list[_Active]
    table: torch.Tensor
    done: torch.cuda.Event | None
    start: float
    version: int = 0  # the drafter version the round drafted with
    features: torch.Tensor | None = None  # [B, K + 1, F]: the verify forward's (emit_features)
    confidence: torch.Tensor | None = None  # [B, K]: per-draft confidences (record_confidence)


class SpecDecoder:
    """Speculative decoding of a batch of requests with a native target and a drafter.

    `compile="all"` (or True) wraps the target's verify forward and the proposer's drafter
    forward(s) in `torch.compile` from here (STYLE rule 3; `"target"`: the verify forward only);
    `cuda_graphs=True` (CUDA only) replays each round's tensor work from a CUDA graph captured
    per (attention-length bucket, all-greedy) on its second use (`draftinfer.decoding.graphs`); the
    first use of a bucket runs as is and compiles. `sync_check=True` makes any host sync
    inside a round an error (CUDA only). `pipeline` launches each round before reading the
    previous one back (module docstring; None: on for CUDA, where it hides the host's part of
    a round, off on the CPU, where a launch is the work itself). `drafter_version` names the
    weights the drafter starts with (`update_drafter` moves it on). `emit_features=True`
    hands each request's committed tokens' target features back (`RequestOutput.features`):
    the ones the round's verify forward and the prefill computed anyway (the next first pass),
    plus the head input (`emit_spec`), copied out on the device once per round, so an online
    trainer needs no second target pass (`drafttrain.cache.emitted`). `verify_threshold`
    (None: off, the whole block) cuts each request's block by cumulative confidence (module
    docstring); `record_confidence=True` hands each round's per-draft confidences back
    (`RequestOutput.confidences`).
    """

    def __init__(
        self,
        target,
        drafter,
        k: int,
        max_batch: int = 8,
        max_model_len: int = 1024,
        verify: str = "onehot",
        prefill_chunk: int = 512,
        tokenizer=None,
        compile: bool | str = False,
        sync_check: bool = False,
        cuda_graphs: bool = False,
        compile_options: dict | None = None,
        pipeline: bool | None = None,
        drafter_version: int = 0,
        emit_features: bool = False,
        verify_threshold: float | None = None,
        record_confidence: bool = False,
    ):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if max_model_len > target.max_seq_len or max_batch > target.max_batch:
            raise ValueError(
                f"max_batch={max_batch} / max_model_len={max_model_len} exceed the target's "
                f"cache ({target.max_batch} rows x {target.max_seq_len})"
            )
        self.target, self.drafter, self.k = target, drafter, k
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.prefill_chunk, self.tokenizer, self.sync_check = prefill_chunk, tokenizer, sync_check
        self.device = next(target.parameters()).device
        self.features = drafter.config.features
        # What the target is asked for: the drafter's features, plus (emit_features) the head
        # input, appended last, so the drafter's columns are the first `width`.
        self.emit_spec = self.features.with_head_input() if emit_features else self.features
        spec_of(drafter).check_k(drafter.config, k)
        dtype = next(drafter.parameters()).dtype
        self.proposer = spec_of(drafter).proposer_class(
            drafter, max_batch, max_model_len, self.device, dtype
        )
        self.verifier = Verifier(verify, target.info.vocab_size)
        self.verify_threshold = check_threshold(verify_threshold)
        self.record_confidence = record_confidence
        self.proposer.track_confidence = self.verify_threshold is not None or record_confidence
        self.sampling = SamplingState(max_batch, self.device)
        self.rows = torch.arange(max_batch, device=self.device)
        # Per-row device state: the pending first pass (width K + 1) and the pending token.
        B, W, dev = max_batch, k + 1, self.device
        width = self.features.width(target.info.hidden_size)
        fdtype = next(target.parameters()).dtype
        axes = () if target.info.rope_axes == 1 else (target.info.rope_axes,)
        self.fp = FirstPass(
            self.rows,
            torch.zeros(B, W, dtype=torch.long, device=dev),
            torch.zeros(B, W, width, dtype=fdtype, device=dev),
            torch.full((B, W), -1, dtype=torch.long, device=dev),
            torch.zeros(*axes, B, W, dtype=torch.long, device=dev),
        )
        self.pending_token = torch.zeros(B, dtype=torch.long, device=dev)
        # Each row's (L, remaining, live) as the last round left them (module docstring).
        self.carry = torch.zeros(3, B, dtype=torch.long, device=dev)
        self.pipeline = dev.type == "cuda" if pipeline is None else bool(pipeline)
        pin = dev.type == "cuda"
        # Two of each host buffer: with a round in flight, the next launch writes the other
        # one (the one before it was read back and its upload consumed).
        # Upload rows: L, remaining, live, set (1: the host's values; 0: the carry's).
        self._uploads = [torch.zeros(4, B, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._tables = [torch.zeros(B, k + 3, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._launches = 0
        self.drafter_version = drafter_version
        self._staged: tuple[int, Staged] | None = None
        self._generating = False
        self.emit_features = emit_features
        self._target_fwd = target_forward
        mode = {False: "none", True: "all"}.get(compile, compile)
        if mode not in ("none", "target", "all"):
            raise ValueError(f"compile must be none, target or all, got {compile!r}")
        options = runner_compile_options(compile_options, self.device)
        opts = {"options": options} if options else {}
        if mode != "none":
            self._target_fwd = compiled(target_forward, dynamic=True, **opts)
        if mode == "all":
            self.proposer.compile(dynamic=True, **opts)
        self._graphed = None
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError(f"cuda_graphs=True needs a CUDA target, not {self.device}")
            self._graphed = GraphedFunction(self._round_tensors)

    # -- drafter updates ------------------------------------------------------------------
    def update_drafter(self, update: DrafterUpdate) -> None:
        """Take a weights-only drafter update (`draftinfer.decoding.swap`): checked and staged
        on the device now (a bad one is a one-line `SwapError`, nothing staged or copied),
        copied in place between two rounds: at once outside `generate`, else at the top of
        its next loop iteration. A later update given before that replaces a staged one."""
        running = self.drafter_version if self._staged is None else self._staged[0]
        staged = stage_update(self.drafter, update, running)
        self._staged = (update.version, staged)
        if not self._generating:
            self._apply_staged()

    def target_weights_updated(self) -> None:
        """The target's weights were replaced in place (a policy step): copy the target weights
        the drafter shares (its embedding, its head) into it again (`attach_shared`), as an
        engine whose draft shares the target's tensors sees them. Call between rounds."""
        spec_of(self.drafter).attach_shared(self.drafter, self.target.shared_weights())

    def _apply_staged(self) -> bool:
        """Copy the staged update into the drafter (queued on the current stream, after the
        round in flight). True if there was one."""
        if self._staged is None:
            return False
        version, staged = self._staged
        apply_staged(self.drafter, staged)
        self.proposer.weights_updated()
        self.drafter_version, self._staged = version, None
        return True

    # -- target passes ------------------------------------------------------------------
    def _admit(self, slots: list[_Active]) -> None:
        """Admit requests together: one chunked prefill of their left-padded prompts (every
        prompt ends in the last column), the first token of each sampled from the target
        alone, the prompt rows handed to the proposer, and the rows it returns kept as the
        pending first pass. Runs between rounds (host syncs allowed)."""
        if not slots:
            return
        dev, n = self.device, len(slots)
        lens = torch.tensor([len(s.tokens) for s in slots], device=dev)
        P = int(lens.max())
        col = torch.arange(P, device=dev)[None]
        cache_pos = col - (P - lens)[:, None]  # [n, P]: -1.. left padding, then 0..P_b-1
        cache_pos = torch.where(cache_pos >= 0, cache_pos, -1)
        ids = torch.zeros(n, P, dtype=torch.long, device=dev)
        for b, s in enumerate(slots):
            ids[b, P - len(s.tokens) :] = torch.tensor(s.tokens, device=dev)
        rows = torch.tensor([s.row for s in slots], device=dev)
        # The target says what each chunk feeds (text: the ids; Qwen3-VL: vision rows of the
        # chunk's image slots and its [3, n, P] table, the request's mrope_delta recorded).
        plan = self.target.prefill_plan(ids, cache_pos, rows, [s.req.mm_inputs for s in slots])
        outs = []
        for c in range(0, P, self.prefill_chunk):
            cols = slice(c, c + self.prefill_chunk)
            inputs, rope = plan.chunk(cols)
            # Only the last column's logits are read (every prompt ends there): the head over
            # every prompt row would cost [n, P, V] fp32 for nothing.
            last = torch.full((n, 1), min(P - c, self.prefill_chunk) - 1, device=dev)
            slots_c = Slots(rows, cache_pos[:, cols], rope)
            outs.append(self.target(inputs, slots_c, self.emit_spec, logit_index=last))
        logits = outs[-1].logits
        self.sampling.set_rows([s.row for s in slots], [s.req.sampling for s in slots])
        t = {name: x[rows] for name, x in self.sampling.tensors.items()}
        first = self.verifier.sample_next(logits[:, -1], t, lens).tolist()
        if self.emit_features:  # f_0..f_{P_b - 1}: the prompt's rows (left padding cut)
            feats = torch.cat([o.features for o in outs], dim=1)
            for b, s in enumerate(slots):
                s.features = [feats[b, P - len(s.tokens) :].cpu()]
        for s, tok in zip(slots, first):
            s.out, s.finish = apply_stops(
                s.req, [], [tok], len(s.tokens), self.max_model_len, self.tokenizer
            )
            s.tokens.append(tok)
        keep = [b for b, s in enumerate(slots) if s.finish is None]
        if not keep:
            return
        # Row i consumes (t_{i+1}, f_i) at pos_i for i = 0..P_b-1 (convention 1): the ids
        # (and multimodal input embeddings) shift left by one, positions do not, and the
        # sampled token fills the last column.
        k = torch.tensor(keep, device=dev)
        next_ids = torch.cat([ids[:, 1:], torch.tensor(first, device=dev)[:, None]], dim=1)
        mm = TokenEmbeds.concat(outs)
        first_pass = FirstPass(
            rows[k],
            next_ids[k],
            torch.cat([o.features for o in outs], dim=1)[k][..., : self.fp.features.shape[-1]],
            cache_pos[k],
            torch.cat([o.rope_pos for o in outs], dim=-1)[..., k, :],
            None if mm is None else mm.shifted(1).batch(k),
        )
        pending = self.proposer.admit(first_pass, attn_bucket(P, self.max_model_len))
        w = pending.width
        if w > self.k + 1:
            raise RuntimeError(f"{type(self.proposer).__name__}.admit kept {w} rows > K + 1")
        r = rows[k]
        self.fp.ids[r], self.fp.cache_pos[r] = 0, -1
        self.fp.ids[r, :w] = pending.ids
        self.fp.features[r, :w] = pending.features
        self.fp.cache_pos[r, :w] = pending.cache_pos
        self.fp.rope_pos[..., r, :w] = pending.rope_pos
        self.pending_token[r] = torch.tensor(first, device=dev)[k]

    def _round(self, live: list[_Active]) -> None:
        """One round for every live request, read back before returning."""
        self._process(self._launch(live))

    def _launch(self, live: list[_Active], in_flight: frozenset[int] = frozenset()) -> _Launched:
        """Queue one round for `live` (tensor work with no host sync) and the copy of its table
        to the host. Rows in `in_flight` belong to a round launched and not read back yet:
        the device's carry holds their state, and their lengths are bounded by K + 1 more."""
        K, start = self.k, time.perf_counter()
        n, self._launches = self._launches, self._launches + 1
        up_t, table = self._uploads[n % 2], self._tables[n % 2]
        up = up_t.numpy()  # numpy writes: 3 us a round where torch ops took 16 (batch 1)
        up[:3], up[3] = 0, 1  # rows with no live request: set, not live
        top = 0
        for s in live:
            L = len(s.tokens)
            if s.row in in_flight:
                up[3, s.row] = 0
                L += K + 1
            else:
                up[0, s.row], up[1, s.row], up[2, s.row] = L, s.req.max_tokens - len(s.out), 1
            top = max(top, L)
        # Keys the verify forward reads: up to cache index L - 1 + K.
        attn_len = attn_bucket(min(top + K, self.max_model_len), self.max_model_len)
        all_greedy = all(self.sampling.greedy[s.row] for s in live)
        host = up_t.to(self.device, non_blocking=True, copy=True)
        state = (*self.fp.tensors(), self.pending_token, self.carry, host)
        if self._graphed is not None:
            out = self._graphed(state, attn_len, all_greedy)
        else:
            out = self._round_tensors(*state, attn_len, all_greedy)
        *fp, self.pending_token, self.carry, packed, v_feat, conf = out
        self.fp = FirstPass.of_tensors(fp)
        table.copy_(packed, non_blocking=True)
        # The verify forward's features at cache indices L-1..L-1+K, head input included (a
        # graph's output is overwritten by its next replay: copied here, on the round's stream).
        feats = v_feat.clone() if self.emit_features else None
        conf = conf.clone() if self.record_confidence else None
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return _Launched(list(live), table, done, start, self.drafter_version, feats, conf)

    def _process(self, launched: _Launched) -> bool:
        """Read a launched round back and commit it for its requests that are still running
        (one the host stopped after the launch ran ahead: dropped). True if any was."""
        if launched.done is not None:
            launched.done.synchronize()
        K = self.k
        table = launched.table.tolist()  # the round's one readback: [B, K + 3]
        # The round has finished (synchronized above): no wait.
        conf = None if launched.confidence is None else launched.confidence.cpu().tolist()
        running = [s for s in launched.slots if s.finish is None]
        for s in running:
            a = table[s.row][K + 1]
            emitted = table[s.row][: a + 1]
            s.accepted.append(a)
            s.proposed.append(table[s.row][K + 2])
            s.versions.append(launched.version)
            if conf is not None:
                s.confidences.append(conf[s.row])
            L, n_before = len(s.tokens), len(s.out)
            s.out, s.finish = apply_stops(
                s.req, s.out, emitted, L, self.max_model_len, self.tokenizer
            )
            s.tokens.extend(s.out[n_before:])
            if launched.features is not None:
                # n new tokens committed: the features of t_{L-1} (the pending token) and of
                # the first n - 1 of them are final (the last one's comes next round).
                n = len(s.out) - n_before
                s.features.append(launched.features[s.row, :n].cpu())
        return bool(running)

    def _round_tensors(
        self,
        fp_rows: torch.Tensor,
        fp_ids: torch.Tensor,
        fp_features: torch.Tensor,
        fp_cache_pos: torch.Tensor,
        fp_rope_pos: torch.Tensor,
        pending: torch.Tensor,
        carry: torch.Tensor,
        host: torch.Tensor,
        attn_len: int,
        all_greedy: bool,
    ) -> tuple[torch.Tensor, ...]:
        """The round's tensor work, a function of the round state alone (so it can be replayed
        from a CUDA graph, `draftinfer.decoding.graphs`): propose, verify forward, verify, next first
        pass. In: the pending first pass (`FirstPass.tensors()`), the pending token `[B]`, the
        carry `[3, B]` (L, remaining, live) and the uploaded `[4, B]` (the same and `set`: rows
        whose values the host sets). Out: the next first pass's tensors, the next pending
        token, the next carry, `[B, K + 3]`: emitted tokens (-1 padded), the accepted count
        and the number of drafts verified, the verify forward's features `[B, K + 1, F]` in the
        columns of `emit_spec` (what `emit_features` copies out) and the per-draft
        confidences `[B, K]` fp32 (zeros unless tracked; what `record_confidence` copies out)."""
        K = self.k
        with no_host_sync(self.sync_check, self.device):
            now = torch.where(host[3].bool(), host[:3], carry)
            L, remaining, live = now[0], now[1], now[2].bool()
            # Draft cap (see `draft_cap`), 0 for rows with no live request.
            cap = torch.clamp(torch.minimum(self.max_model_len - L, remaining) - 1, 0, K)
            num_drafts = torch.where(live, cap, 0)
            fp = FirstPass(
                fp_rows,
                fp_ids,
                fp_features,
                torch.where(live[:, None], fp_cache_pos, -1),
                fp_rope_pos,
            )
            t = self.sampling.tensors
            choose = self.verifier.draft_chooser(t, L)
            drafts, q = self.proposer.propose(fp, num_drafts, K, choose, attn_len)
            conf = self.proposer.confidences()
            conf = drafts.new_zeros(drafts.shape, dtype=torch.float32) if conf is None else conf
            conf = conf[:, :K].float()
            if self.verify_threshold is not None:
                # The confidence cut (module docstring): fewer verified drafts, the same shapes;
                # everything below (verify rows, bonus slot, commit) reads the cut count.
                num_drafts = torch.minimum(num_drafts, cut_lengths(conf, self.verify_threshold))
            # Verify forward over [t_{L-1}, d_1..d_n] at cache indices L-1..L-1+n.
            j = torch.arange(K + 1, device=self.device)
            v_ids = torch.cat([pending[:, None], drafts], 1)  # [B, K + 1]
            v_live = live[:, None] & (j[None] <= num_drafts[:, None])
            v_cache = torch.where(v_live, (L - 1)[:, None] + j[None], -1)
            v_rope = self.target.rope_positions(v_cache, self.rows)
            f = self.emit_spec
            logits, v_feat = self._target_fwd(
                self.target,
                v_ids,
                self.rows,
                v_cache,
                v_rope,
                attn_len,
                f.layer_inputs,
                f.final_hidden,
            )
            out_ids, n_acc = self.verifier.verify(
                logits, drafts, q, self.proposer.draft_vocab_ids(), num_drafts, t, L, all_greedy
            )
            # Next first pass: rows L-1..L-1+a consume the emitted tokens with the verify
            # forward's target features (the KV refresh of convention 6); the last emitted
            # token is the next pending token. Built on the device for the whole batch. The RoPE
            # table is made dense (an M-RoPE target returns an expanded view): it is state
            # the next round reads, and a graph's static input.
            fp_ids, fp_cache, _, next_pending = prepare_chain_inputs(out_ids, n_acc, L)
            packed = torch.cat([out_ids, n_acc[:, None], num_drafts[:, None]], dim=1)
            # The carry: a row that is not stopped commits a + 1 tokens; one at max_tokens or
            # max_model_len is stopped (the host stops it there too, or earlier).
            L_next, left = L + n_acc + 1, remaining - n_acc - 1
            going = live & (L_next < self.max_model_len) & (left > 0)
            carry = torch.stack([L_next, left, going.long()])
            v_rope = v_rope.contiguous()
            # The drafter's columns (all of them unless emit_spec adds the head input).
            fp_feat = v_feat[..., : fp_features.shape[-1]].contiguous()
            out = (fp_rows, fp_ids, fp_feat, fp_cache, v_rope, next_pending, carry, packed)
            return (*out, v_feat, conf)

    def generate(
        self, requests: list[Request], on_finish=None, between_rounds=None
    ) -> tuple[list[RequestOutput], dict]:
        """Continuous batching over `max_batch` cache rows; outputs in request order.
        `on_finish()` is called as each request completes (progress bars);
        `between_rounds(decoder)` at the top of every loop iteration, before the next launch
        (where a caller polls for drafter updates and calls `update_drafter`). The stats hold
        the wall time of every round (`round_seconds`; each round ends in its readback), the
        swaps (`swaps`: (rounds read back before it, version)) and the AL of each drafter
        version (`al_by_version`: version -> {"al", "rounds"})."""
        for r in requests:
            if len(r.prompt_ids) >= self.max_model_len:
                raise ValueError(
                    f"prompt of {len(r.prompt_ids)} tokens does not fit "
                    f"max_model_len {self.max_model_len}"
                )
            if not r.prompt_ids:
                raise ValueError("every prompt needs at least one token")
        pending = list(enumerate(requests))[::-1]
        free_rows = list(range(self.max_batch))[::-1]
        active: list[_Active] = []
        results: dict[int, RequestOutput] = {}
        round_seconds: list[float] = []
        t0 = time.perf_counter()
        in_flight: _Launched | None = None
        last_read = t0
        swaps: list[tuple[int, int]] = []
        self._generating = True
        try:
            while pending or active or in_flight is not None:
                # Between rounds: a drafter update given by now is copied in here, queued
                # after the round in flight and before the admissions' prefill and the launch.
                if between_rounds is not None:
                    between_rounds(self)
                if self._apply_staged():
                    swaps.append((len(round_seconds), self.drafter_version))
                admitted = []
                while pending and free_rows:
                    idx, req = pending.pop()
                    slot = _Active(
                        idx,
                        replace(req, sampling=with_seed(req.sampling)),
                        free_rows.pop(),
                        list(req.prompt_ids),
                    )
                    admitted.append(slot)
                self._admit(admitted)
                active.extend(admitted)
                live = [s for s in active if s.finish is None]
                launched = None
                if live:
                    ahead = frozenset()
                    if in_flight is not None:
                        ahead = frozenset(s.row for s in in_flight.slots if s.finish is None)
                    launched = self._launch(live, ahead)
                # A round's time: from its launch or the previous readback, whichever is
                # later, to its own readback (with a round in flight: the device's time).
                read = [r for r in (in_flight, None if self.pipeline else launched) if r]
                for r in read:
                    if self._process(r):
                        now = time.perf_counter()
                        round_seconds.append(now - max(r.start, last_read))
                        last_read = now
                in_flight = launched if self.pipeline else None
                for s in active:
                    if s.finish is None:
                        continue
                    res = RequestOutput(
                        s.out,
                        s.finish,
                        accepted=s.accepted,
                        proposed=s.proposed,
                        versions=s.versions,
                        features=torch.cat(s.features) if s.features else None,
                        confidences=s.confidences,
                    )
                    finalize_text(s.req, res, self.tokenizer)
                    results[s.idx] = res
                    self.proposer.release(s.row)
                    free_rows.append(s.row)
                    if on_finish is not None:
                        on_finish()
                active = [s for s in active if s.finish is None]
        finally:
            self._generating = False
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        outs = [results[i] for i in range(len(requests))]
        return outs, {
            "seconds": elapsed,
            "rounds": len(round_seconds),
            "round_seconds": round_seconds,
            "tokens": sum(len(o.token_ids) for o in outs),
            "swaps": swaps,
            "al_by_version": al_by_version(outs),
        }
