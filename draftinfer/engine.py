"""The speculative decoding loop (DESIGN section 2).

Vocabulary: a *round* = drafter proposes up to K *drafts* per request -> the target scores
`[bonus, d_1..d_K]` in one forward -> verification accepts `a` drafts and emits one more
token (the *recovered* token at the first rejection, or the *bonus* token when all K are
accepted) -> commit `a + 1` tokens -> the committed rows become the drafter's next first pass.

Invariants per request (length `L` = committed tokens, prompt included):
- the target KV holds positions `0..L-2`; the last committed token `t_{L-1}` is *pending*:
  it is the first slot of the next verify forward;
- the drafter KV holds rows `0..L-2` built from target features once the round's first pass
  ran (convention 6); the first pass of a round is exactly the rows the last commit added.

Rejected drafts leave stale KV past the committed length in both caches; it is never read
(see `draftinfer.kv_cache`). Randomness is keyed by (request seed, position), so a request's
output does not depend on the rest of the batch (convention 12).

The loop syncs with the host once per round (stop checks, scheduling); the round's tensor
work (`_round`) is free of data-dependent host control flow besides that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from draftkernels.chain_inputs import prepare_chain_inputs

from draftinfer.proposers import PROPOSERS
from draftinfer.sampling import SamplingParams
from draftinfer.verify import Verifier, with_seed


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclass
class RequestOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    text: str | None = None
    accepted: list[int] = field(default_factory=list)  # per round
    proposed: list[int] = field(default_factory=list)  # per round


def apply_stops(
    req: Request, out: list[int], new: list[int], total_len: int, max_model_len: int, tokenizer=None
) -> tuple[list[int], str | None]:
    """Append `new` to `out` token by token, stopping exactly at EOS/stop ids, a stop string,
    `max_tokens` or `max_model_len`. Returns (out, finish reason or None). Shared by the
    speculative loop, the reference loop and the plain baseline so they stop identically."""
    for tok in new:
        out.append(tok)
        total_len += 1
        if tok in req.stop_token_ids:
            return out, "stop"
        if req.stop_strings and tokenizer is not None:
            text = tokenizer.decode(out, skip_special_tokens=False)
            if any(s in text for s in req.stop_strings):
                return out, "stop"
        if len(out) >= req.max_tokens or total_len >= max_model_len:
            return out, "length"
    return out, None


def finalize_text(req: Request, out: RequestOutput, tokenizer) -> None:
    if tokenizer is None:
        return
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    for s in req.stop_strings:
        if s in text:
            text = text[: text.index(s)]
    out.text = text


@dataclass
class _Slot:
    """An active request bound to a cache row."""

    idx: int
    req: Request
    row: int
    tokens: list[int]  # committed tokens, prompt included
    out: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    # Pending drafter first pass: ids `[n]`, aux `[n, A]`, positions `[n]`.
    fp_ids: torch.Tensor | None = None
    fp_aux: torch.Tensor | None = None
    fp_pos: torch.Tensor | None = None
    finish: str | None = None


class SpecDecoder:
    """Speculative decoding of a batch of requests with a native target and a drafter."""

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
    ):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.target, self.drafter, self.k = target, drafter, k
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.prefill_chunk, self.tokenizer = prefill_chunk, tokenizer
        self.device = next(target.parameters()).device
        self.aux_ids = list(drafter.config.aux_layer_ids)
        dtype = next(drafter.parameters()).dtype
        self.proposer = PROPOSERS[drafter.config.kind](
            drafter, max_batch, max_model_len, self.device, dtype
        )
        self.verifier = Verifier(verify, drafter)

    # -- target passes ------------------------------------------------------------------
    def _prefill(self, slot: _Slot) -> None:
        """Target over the whole prompt (in chunks); sample the first token from the target
        alone; the prompt rows become the drafter's first pass."""
        P = len(slot.tokens)
        ids = torch.tensor(slot.tokens, device=self.device)
        aux_parts, logits = [], None
        row = torch.tensor([slot.row], device=self.device)
        for s in range(0, P, self.prefill_chunk):
            chunk = ids[s : s + self.prefill_chunk]
            pos = torch.arange(s, s + chunk.numel(), device=self.device)
            logits, aux = self.target(chunk[None], pos[None], row, self.aux_ids)
            aux_parts.append(aux[0])
        first = self.verifier.sample_next(logits[0, -1:], [slot.req.sampling], [P])
        tok = int(first[0])
        slot.out, reason = apply_stops(slot.req, [], [tok], P, self.max_model_len, self.tokenizer)
        slot.tokens.append(tok)
        # Row i consumes (t_{i+1}, f_i) at pos_i for i = 0..P-1 (convention 1).
        slot.fp_ids = torch.tensor(slot.tokens[1:], device=self.device)
        slot.fp_aux = torch.cat(aux_parts)
        slot.fp_pos = torch.arange(P, device=self.device)
        slot.finish = reason

    def _pad_first_pass(self, slots: list[_Slot]):
        T = max(s.fp_ids.numel() for s in slots)
        B, A = len(slots), slots[0].fp_aux.shape[-1]
        ids = torch.zeros(B, T, dtype=torch.long, device=self.device)
        aux = torch.zeros(B, T, A, dtype=slots[0].fp_aux.dtype, device=self.device)
        pos = torch.full((B, T), -1, dtype=torch.long, device=self.device)
        for b, s in enumerate(slots):
            n = s.fp_ids.numel()
            ids[b, :n], aux[b, :n], pos[b, :n] = s.fp_ids, s.fp_aux, s.fp_pos
        return ids, aux, pos

    def _round(self, slots: list[_Slot]) -> None:
        dev, K = self.device, self.k
        rows = torch.tensor([s.row for s in slots], device=dev)
        L = torch.tensor([len(s.tokens) for s in slots], device=dev)
        # Draft cap: the round emits up to n+1 tokens, so n <= max_model_len - L - 1 and
        # n <= max_tokens - produced - 1 (never wrap, never overshoot).
        remaining = torch.tensor([s.req.max_tokens - len(s.out) for s in slots], device=dev)
        num_drafts = torch.clamp(torch.minimum(self.max_model_len - L, remaining) - 1, 0, K)
        ids, aux, pos = self._pad_first_pass(slots)
        params = [s.req.sampling for s in slots]
        choose = self.verifier.draft_chooser(params, L)
        drafts, q = self.proposer.propose(rows, ids, aux, pos, num_drafts, K, choose)
        # Verify forward over [t_{L-1}, d_1..d_n] at positions L-1..L-1+n.
        last = torch.tensor([s.tokens[-1] for s in slots], device=dev)
        v_ids = torch.cat([last[:, None], drafts], 1)  # [B, K+1]
        j = torch.arange(K + 1, device=dev)
        v_pos = torch.where(j[None] <= num_drafts[:, None], (L - 1)[:, None] + j[None], -1)
        logits, v_aux = self.target(v_ids, v_pos, rows, self.aux_ids)
        out_ids, n_acc = self.verifier.verify(logits, drafts, q, num_drafts, params, L)
        # Next first pass (shift: rows L-1..L-1+a consume the emitted tokens; positions; the
        # last emitted token is the next bonus slot), built on device for the whole batch.
        fp_ids, fp_pos, _, _ = prepare_chain_inputs(out_ids, n_acc, L)
        n_acc_l, out_l = n_acc.tolist(), out_ids.tolist()
        for b, s in enumerate(slots):
            a = n_acc_l[b]
            emitted = out_l[b][: a + 1]
            s.accepted.append(a)
            s.proposed.append(int(num_drafts[b]))
            Lb, n_before = len(s.tokens), len(s.out)
            s.out, s.finish = apply_stops(
                s.req, s.out, emitted, Lb, self.max_model_len, self.tokenizer
            )
            s.tokens.extend(s.out[n_before:])
            # With the verify forward's target features: the KV refresh of convention 6.
            s.fp_ids, s.fp_pos = fp_ids[b, : a + 1], fp_pos[b, : a + 1]
            s.fp_aux = v_aux[b, : a + 1]

    def generate(self, requests: list[Request], on_finish=None) -> tuple[list[RequestOutput], dict]:
        """Continuous batching over `max_batch` cache rows; outputs in request order.
        `on_finish()` is called as each request completes (progress bars)."""
        for r in requests:
            if len(r.prompt_ids) >= self.max_model_len:
                raise ValueError(
                    f"prompt of {len(r.prompt_ids)} tokens does not fit "
                    f"max_model_len {self.max_model_len}"
                )
        pending = list(enumerate(requests))[::-1]
        free_rows = list(range(self.max_batch))[::-1]
        active: list[_Slot] = []
        results: dict[int, RequestOutput] = {}
        t0 = time.perf_counter()
        rounds = 0
        while pending or active:
            while pending and free_rows:
                idx, req = pending.pop()
                req = replace(req, sampling=with_seed(req.sampling))
                slot = _Slot(idx, req, free_rows.pop(), list(req.prompt_ids))
                self._prefill(slot)
                active.append(slot)
            live = [s for s in active if s.finish is None]
            if live:
                self._round(live)
                rounds += 1
            for s in [s for s in active if s.finish is not None]:
                res = RequestOutput(s.out, s.finish, accepted=s.accepted, proposed=s.proposed)
                finalize_text(s.req, res, self.tokenizer)
                results[s.idx] = res
                free_rows.append(s.row)
                active.remove(s)
                if on_finish is not None:
                    on_finish()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        outs = [results[i] for i in range(len(requests))]
        return outs, {
            "seconds": elapsed,
            "rounds": rounds,
            "tokens": sum(len(o.token_ids) for o in outs),
        }
