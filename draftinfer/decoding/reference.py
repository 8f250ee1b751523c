"""Reference speculative decoding: a readable loop with no state carried between rounds.

Every round recomputes the target over the whole committed sequence and the drafter from
scratch over all its rows (causal attention over the concatenation, no KV cache), then
verifies with the same `Verifier` as the fast path. The fast path (`SpecDecoder`) must
match it token for token; any stale-cache, pairing, position or refresh bug in the fast
path shows up as a difference. Works for every registered kind through its proposer's
`reference_drafts`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from draftinfer.conventions.slots import Slots
from draftinfer.conventions.window import TokenEmbeds
from draftinfer.decoding.requests import (
    Request,
    RequestOutput,
    apply_stops,
    draft_cap,
    finalize_text,
)
from draftinfer.decoding.sampling import SamplingState, with_seed
from draftinfer.decoding.verify import Verifier
from draftinfer.registry import spec_of


@torch.no_grad()
def reference_generate(
    target,
    drafter,
    requests: list[Request],
    k: int,
    max_model_len: int = 1024,
    verify: str = "onehot",
    tokenizer=None,
) -> list[RequestOutput]:
    verifier = Verifier(verify, target.info.vocab_size)
    reference_drafts = spec_of(drafter).proposer_class.reference_drafts
    features = drafter.config.features
    vocab_ids = drafter.draft_vocab_ids()
    dev = next(target.parameters()).device
    row0 = torch.zeros(1, dtype=torch.long, device=dev)

    def full_target(tokens: list[int], mm_inputs: dict | None):
        """Target over tokens[0..n-1] from cache index 0, fed by its `prefill_plan` (the
        prompt's images, the rest text): logits `[n, V]`, features `[n, F]`, RoPE positions
        `[n]` / `[3, n]`, multimodal input embeddings `[1, n]` (`TokenEmbeds` or None)."""
        ids = torch.tensor(tokens, device=dev)[None]
        cache_pos = torch.arange(len(tokens), device=dev)[None]
        inputs, rope = target.prefill_plan(ids, cache_pos, row0, [mm_inputs]).chunk(slice(None))
        out = target(inputs, Slots(row0, cache_pos, rope), features)
        return out.logits[0], out.features[0], out.rope_pos[..., 0, :], TokenEmbeds.of(out)

    outputs = []
    for req in requests:
        req = replace(req, sampling=with_seed(req.sampling))
        t = SamplingState.of([req.sampling], dev).tensors
        tokens = list(req.prompt_ids)
        logits, *_ = full_target(tokens, req.mm_inputs)
        P = len(tokens)
        first = int(verifier.sample_next(logits[-1:], t, torch.tensor([P], device=dev))[0])
        out, finish = apply_stops(req, [], [first], P, max_model_len, tokenizer)
        tokens.append(first)
        accepted, proposed = [], []
        while finish is None:
            L = len(tokens)
            n = draft_cap(max_model_len, L, req.max_tokens - len(out), k)
            Lt = torch.tensor([L], device=dev)
            _, feats, rope, mm = full_target(tokens[:-1], req.mm_inputs)  # f_0..f_{L-2}
            # Drafter rows 0..L-2: row i consumes (t_{i+1}, f_i) at position pos_i, with the
            # input embedding of t_{i+1} where the target scattered a vision embedding in.
            ids = torch.tensor(tokens[1:], device=dev)
            choose = verifier.draft_chooser(t, Lt)
            rows_mm = None if mm is None else mm.shifted(1).batch(0)  # rows [L-1]
            drafts, qs = reference_drafts(drafter, ids, feats, rope, n, choose, rows_mm)
            v_logits, *_ = full_target(tokens + drafts, req.mm_inputs)
            v_logits = v_logits[L - 1 : L + n]  # [n+1, V]: scores for d_1..d_n and the bonus token
            V = v_logits.shape[-1]
            pad = torch.zeros(k + 1, V, device=dev, dtype=v_logits.dtype)
            pad[: n + 1] = v_logits
            d_t = torch.zeros(1, k, dtype=torch.long, device=dev)
            d_t[0, :n] = torch.tensor(drafts, dtype=torch.long, device=dev)
            q_t = None
            if qs and qs[0] is not None:
                q_t = torch.zeros(1, k, qs[0].shape[-1], device=dev, dtype=qs[0].dtype)
                q_t[0, :n] = torch.cat(qs)
            out_ids, n_acc = verifier.verify(
                pad[None], d_t, q_t, vocab_ids, torch.tensor([n], device=dev), t, Lt
            )
            a = int(n_acc[0])
            accepted.append(a)
            proposed.append(n)
            before = len(out)
            out, finish = apply_stops(
                req, out, out_ids[0, : a + 1].tolist(), L, max_model_len, tokenizer
            )
            tokens.extend(out[before:])
        res = RequestOutput(out, finish, accepted=accepted, proposed=proposed)
        finalize_text(req, res, tokenizer)
        outputs.append(res)
    return outputs
