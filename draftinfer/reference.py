"""Reference speculative decoding: a readable loop with no state carried between rounds.

Every round recomputes the target over the whole committed sequence and the drafter from
scratch over all its rows (causal attention over the concatenation, no KV cache), then
verifies with the same `Verifier` as the fast path. The fast path (`SpecDecoder`) must
match it token for token; any stale-cache, pairing, position or refresh bug in the fast
path shows up as a difference.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from draftinfer.engine import Request, RequestOutput, apply_stops, finalize_text
from draftinfer.proposers import PROPOSERS
from draftinfer.verify import Verifier, with_seed


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
    verifier = Verifier(verify, drafter)
    dev = next(target.parameters()).device
    aux_ids = list(drafter.config.aux_layer_ids)
    row0 = torch.zeros(1, dtype=torch.long, device=dev)

    def full_target(tokens: list[int]):
        """Target over tokens[0..n-1] from position 0: (logits [n, V], aux taps [n, 3H])."""
        ids = torch.tensor(tokens, device=dev)[None]
        pos = torch.arange(len(tokens), device=dev)[None]
        logits, aux = target(ids, pos, row0, aux_ids)
        return logits[0], aux[0]

    outputs = []
    for req in requests:
        req = replace(req, sampling=with_seed(req.sampling))
        tokens = list(req.prompt_ids)
        logits, _ = full_target(tokens)
        P = len(tokens)
        first = int(verifier.sample_next(logits[-1:], [req.sampling], [P])[0])
        out, finish = apply_stops(req, [], [first], P, max_model_len, tokenizer)
        tokens.append(first)
        accepted, proposed = [], []
        while finish is None:
            L = len(tokens)
            n = max(0, min(k, min(max_model_len - L, req.max_tokens - len(out)) - 1))
            Lt = torch.tensor([L], device=dev)
            _, aux = full_target(tokens[:-1])  # features f_0..f_{L-2}
            # Drafter rows 0..L-2: row i consumes (t_{i+1}, f_i) at position i.
            ids = torch.tensor(tokens[1:], device=dev)
            feats = drafter.project_aux(aux.to(drafter.fc.weight.dtype))
            pos = torch.arange(L - 1, device=dev)
            choose = verifier.draft_chooser([req.sampling], Lt)
            drafts, qs = PROPOSERS[drafter.config.kind].reference_drafts(
                drafter, ids, feats, pos, n, choose
            )
            v_logits, _ = full_target(tokens + drafts)
            v_logits = v_logits[L - 1 : L + n]  # [n+1, V]: scores for d_1..d_n and the bonus
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
                pad[None], d_t, q_t, torch.tensor([n], device=dev), [req.sampling], Lt
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
