"""The training-time AL that predicts the runner's (`sim_walk_al` in a job's summary).

Why the simulated AL of training (`sim_al`: per-position top-1 agreement on the data's own
responses, multiplied out) and the runner's part, measured (`python -m draftbench.al_gap`,
docs/results.md "Why the simulated AL and the runner's differ"): the runner starts a round only
where the previous one ended, so a stretch the drafter gets right is crossed in few rounds and
a hard stretch in many (its rounds over-sample hard positions), and it drafts the target's own
continuation, not the data's response. So this metric drafts what the runner drafts and walks
as it walks, with the trainer's own forward:

1. the held-out prompts the runner's check reads (`export.verify_prompts` of the eval split,
   rendered as the runner renders them, `draftinfer.evaluation.run.runner_prompts`), and the
   target's greedy continuation of each (the native target, `greedy_generate`: the runner's
   lossless reference), generated past end-of-sequence by K tokens so that drafts past it
   can be checked as the runner's verify pass checks them; cached in the run directory
   (`walk_continuations.json`) and reused when the prompts and settings match;
2. the frozen target's features over prompt + continuation (one forward per sequence, as
   training computes them);
3. the walk (`draftinfer.conventions.metrics.walk_rounds`): from the round after the prefill's
   token, each round's drafts are the objective's `anchor_logits` after the committed row
   (the S9 contract: what the runner's K draft steps give), their argmax in the target's
   vocabulary, accepted while they equal the continuation; the next round starts after them.
   Kinds whose training layout holds many anchors (`anchors_logits`: all four) score every
   start in one forward per sequence and the walk reads them; else one forward a round.

AL = 1 + the mean accepted drafts over rounds (the runner's micro AL). The multimodal
targets' prompts carry images that this first version does not feed: it says so and skips.
"""

from __future__ import annotations

import hashlib
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from draftinfer.conventions.metrics import acceptance_length, walk_rounds
from draftinfer.conventions.window import TokenEmbeds

CONTINUATIONS_FILE = "walk_continuations.json"


def held_out_continuations(
    icfg, device: torch.device, extra: int, cache: Path | None
) -> list[dict[str, Any]] | str:
    """`[{"prompt", "tokens", "n", "stopped"}]` for the runner check's prompts (`icfg`: the
    job's verification `InferConfig`): `tokens` the target's greedy continuation generated
    `extra` tokens past its end (end-of-sequence or the budget), `n` the continuation's length
    as the runner serves it, `stopped` whether it ended at end-of-sequence. A string: why
    there is none (image prompts)."""
    from draftinfer.decoding.baseline import greedy_generate
    from draftinfer.evaluation.run import runner_prompts
    from draftinfer.files.loading import load_native_target
    from draftinfer.files.paths import resolve_path

    path = resolve_path(icfg.target)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = load_native_target(
        path, device, dtype, max_batch=icfg.batch_size, max_seq_len=icfg.max_model_len + extra
    )
    prompts, _ = runner_prompts(icfg, target, path)
    if any(getattr(p, "mm_inputs", None) for p in prompts):
        return "image prompts: not fed to the walk yet"
    ids = [list(p.ids) for p in prompts]
    key = hashlib.sha256(
        json.dumps([ids, icfg.max_new_tokens, extra, str(dtype)]).encode()
    ).hexdigest()
    if cache is not None and cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            return saved["sequences"]
    eos = set(target.config.eos_token_ids)
    full = greedy_generate(target, ids, icfg.max_new_tokens + extra)  # past end-of-sequence
    seqs = []
    for p, toks in zip(ids, full):
        stop = next((i for i, t in enumerate(toks[: icfg.max_new_tokens]) if t in eos), None)
        n = icfg.max_new_tokens if stop is None else stop + 1
        seqs.append({"prompt": p, "tokens": toks, "n": n, "stopped": stop is not None})
    if cache is not None:
        cache.write_text(json.dumps({"key": key, "sequences": seqs}))
    return seqs


def accepted_after(objective, vocab, ids, tgt, mm, P: int, toks: list[int], k: int, s: int) -> int:
    """The drafts the round after continuation token `s` accepts: committed are the prompt
    (`P` tokens) and continuation tokens 0..s, so the drafts predict tokens s + 1 ...; the
    committed row is the one before the last committed token (row i consumes token i + 1:
    S9's `anchor`)."""
    truth = toks[s + 1 : s + 1 + k]
    logits = objective.anchor_logits(ids, tgt.features, tgt.rope_pos, P + s - 1, k, mm)
    drafts = vocab[logits[: len(truth)].argmax(-1)].tolist()
    a = 0
    while a < len(truth) and drafts[a] == truth[a]:
        a += 1
    return a


def every_start(objective, vocab, ids, tgt, mm, P: int, toks: list[int], n: int, k: int):
    """`accepted_after(s)` for every start s < n - 1 from one `anchors_logits` forward (the
    kind's training layout holds many anchors at once) -> list of ints."""
    starts = list(range(max(n - 1, 0)))
    if not starts:
        return []
    logits = objective.anchors_logits(
        ids, tgt.features, tgt.rope_pos, [P + s - 1 for s in starts], k, mm
    )
    drafts = vocab[logits.argmax(-1)]  # [A, k]
    truth = torch.tensor([toks[s + 1 : s + 1 + k] for s in starts], device=drafts.device)
    run = (drafts == truth).int().cumprod(1)  # the leading accepted run
    return run.sum(1).tolist()


@torch.no_grad()
def walk_al(objective, target, seqs: list[dict[str, Any]], k: int, device) -> dict[str, Any]:
    """The runner's walk over `seqs` (`held_out_continuations`) at `k` drafts a round, each
    round's drafts from `objective.anchor_logits` over the frozen `target`'s features (module
    docstring) -> `{"sim_walk_al", "sim_walk_rounds", "sim_walk_pos_j"...}`."""
    t0 = time.perf_counter()
    d = objective.drafter
    vocab = d.draft_vocab_ids().to(device)
    features = d.config.features
    rounds: list[int] = []
    for seq in seqs:
        prompt, toks, n = seq["prompt"], seq["tokens"], seq["n"]
        ids = torch.tensor([prompt + toks], device=device)
        ones = torch.ones_like(ids)
        pos = torch.arange(ids.shape[1], device=device)[None]
        batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones, "position_ids": pos}
        tgt = target.batch_output(batch, features)
        mm = TokenEmbeds.of(tgt)
        if hasattr(objective, "anchors_logits"):  # every start in one forward, then the walk
            a = every_start(objective, vocab, ids, tgt, mm, len(prompt), toks, n, k)
            rounds += walk_rounds(a.__getitem__, n, seq["stopped"])
        else:  # one forward per round
            ctx = (objective, vocab, ids, tgt, mm, len(prompt), toks, k)
            rounds += walk_rounds(partial(accepted_after, *ctx), n, seq["stopped"])
    out: dict[str, Any] = {
        "sim_walk_al": acceptance_length(rounds),
        "sim_walk_rounds": len(rounds),
        "sim_walk_k": k,
        "sim_walk_seconds": round(time.perf_counter() - t0, 2),
    }
    for j in range(1, k + 1):
        out[f"sim_walk_pos_{j}"] = sum(a >= j for a in rounds) / max(len(rounds), 1)
    return out
