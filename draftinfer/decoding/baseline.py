"""The plain decode loop: the baseline speculative decoding must reproduce token for token
(greedy) or match in distribution (sampled), and the speed baseline of the runner's report.

    outs = greedy_generate(model, [[1, 2, 3], [1, 5]], max_new_tokens=64, eos_ids=model.config.eos_token_ids)
    outs = sample_generate(model, prompts, 64, eos_ids, [SamplingParams(0.7, top_p=0.9, seed=1)] * 2)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from draftinfer.conventions.slots import Slots, attn_bucket
from draftinfer.decoding.sampling import (
    RoundKeys,
    SamplingParams,
    argmax_ids,
    exponential_noise,
    logits_to_probs,
    sample_from_probs,
    sampling_tensors,
    with_seed,
)
from draftinfer.models.decoder import NativeCausalLM

# step_fn(input_ids [B, 1], cache_pos [B, 1], cache_rows [B]) -> logits [B, 1, V]
StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# pick(logits [B, V], positions [B]) -> next token [B]; positions: where the token will sit
PickFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def greedy_generate(
    model: NativeCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: Iterable[int] = (),
    *,
    step_fn: StepFn | None = None,
    mm_inputs: Sequence[dict | None] | None = None,
) -> list[list[int]]:
    """Greedy (argmax) continuation of each prompt: a padded, ragged batch through the cache.

    Returns the new tokens of each request (not the prompt). A request stops after emitting
    one of `eos_ids` (kept, as HF `generate` keeps it), after `max_new_tokens`, or when its
    length reaches `model.max_seq_len`. Prompts beyond `model.max_batch` run in successive
    groups. `step_fn` replaces the one-token decode step (e.g. a `torch.compile`d
    `model.forward` with a fixed `attn_len`); prefill always runs `model.forward`, fed by the
    target's `prefill_plan` (`mm_inputs[b]`: request b's multimodal inputs or None, as
    `draftinfer.decoding.engine.Request.mm_inputs`).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    eos = list(dict.fromkeys(int(e) for e in eos_ids))
    mm = _check_mm(mm_inputs, prompts)
    out: list[list[int]] = []
    for start in range(0, len(prompts), model.max_batch):
        group = slice(start, start + model.max_batch)
        out.extend(_greedy_group(model, prompts[group], max_new_tokens, eos, step_fn, mm[group]))
    return out


def _check_mm(mm_inputs: Sequence[dict | None] | None, prompts: list) -> list[dict | None]:
    if mm_inputs is None:
        return [None] * len(prompts)
    if len(mm_inputs) != len(prompts):
        raise ValueError(f"{len(mm_inputs)} multimodal inputs for {len(prompts)} prompts")
    return list(mm_inputs)


@torch.no_grad()
def sample_generate(
    model: NativeCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: Iterable[int],
    params: Sequence[SamplingParams],
    *,
    mm_inputs: Sequence[dict | None] | None = None,
) -> list[list[int]]:
    """`greedy_generate` with per-request sampling (temperature, top-k, top-p, seed).

    The token that will sit at position `p` of a request is drawn with the noise keyed by
    `(request seed, p, STREAM_SAMPLE)` (`draftinfer.decoding.sampling`, DESIGN 3.12), so a request's
    output does not depend on the rest of the batch. Greedy requests (temperature 0) get
    exactly `greedy_generate`'s tokens. Unseeded params get a fresh seed (`with_seed`).
    """
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    eos = list(dict.fromkeys(int(e) for e in eos_ids))
    mm = _check_mm(mm_inputs, prompts)
    device = model.embed_tokens.weight.device
    out: list[list[int]] = []
    for start in range(0, len(prompts), model.max_batch):
        group = slice(start, start + model.max_batch)
        pick = _sampling_pick(params[group], device)
        out.extend(_greedy_group(model, prompts[group], max_new_tokens, eos, None, mm[group], pick))
    return out


def _sampling_pick(params: Sequence[SamplingParams], device: torch.device) -> PickFn:
    """A `PickFn` sampling row b with `params[b]` (seed resolved once, here)."""
    resolved = [with_seed(p) for p in params]
    t = sampling_tensors(resolved, device)
    seeds = torch.tensor([p.seed for p in resolved], dtype=torch.long, device=device)

    def pick(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        probs = logits_to_probs(logits, t["temperature"], t["top_k"], t["top_p"])  # [B, V]
        pos, stream = RoundKeys.sample(positions)
        noise = exponential_noise(seeds, pos, probs.shape[-1], device, stream=stream)
        return sample_from_probs(probs, noise)

    return pick


def _argmax_pick(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return argmax_ids(logits)


def _greedy_group(
    model: NativeCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: list[int],
    step_fn: StepFn | None,
    mm_inputs: list[dict | None],
    pick: PickFn = _argmax_pick,
) -> list[list[int]]:
    device = model.embed_tokens.weight.device
    B = len(prompts)
    lens = [len(p) for p in prompts]
    too_long = [n for n in lens if n > model.max_seq_len]
    if too_long:
        raise ValueError(f"prompt of {too_long[0]} tokens exceeds max_seq_len={model.max_seq_len}")
    # New tokens each request may emit: its total length stays <= max_seq_len.
    budget = [min(max_new_tokens, model.max_seq_len - n) for n in lens]
    steps = max(budget)
    if steps == 0:
        return [[] for _ in prompts]

    T = max(lens)
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.full((B, T), -1, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        pos[b, : len(p)] = torch.arange(len(p))
    rows = torch.arange(B, device=device)
    lens_t = torch.tensor(lens, device=device)
    budget_t = torch.tensor(budget, device=device)
    last = (lens_t - 1)[:, None]  # [B, 1] slot of each prompt's last token
    ids, pos = ids.to(device), pos.to(device)
    inputs, rope = model.prefill_plan(ids, pos, rows, mm_inputs).chunk(slice(None))
    logits = model(inputs, Slots(rows, pos, rope), logit_index=last).logits
    tok = pick(logits[:, -1], lens_t)  # [B]: the token at position len(prompt)
    eos_t = torch.tensor(eos, device=device, dtype=torch.long)
    done = torch.isin(tok, eos_t) | (budget_t <= 1)
    generated = [tok]
    for s in range(1, steps):
        # Feed token index lens+s-1 (emitted last step) at that position; finished rows are
        # padding slots, so they write nothing and stay within max_seq_len.
        feed_pos = torch.where(done, -1, lens_t + s - 1)[:, None]  # [B, 1]
        if step_fn is None:
            # The bound on live positions is known on the host: no per-step sync or check;
            # bucketed so attention shapes change only at powers of two.
            attn_len = attn_bucket(min(T + s, model.max_seq_len), model.max_seq_len)
            logits = model(tok[:, None], Slots(rows, feed_pos, attn_len=attn_len)).logits
        else:
            logits = step_fn(tok[:, None], feed_pos, rows)
        tok = pick(logits[:, -1], lens_t + s)
        generated.append(tok)
        done = done | torch.isin(tok, eos_t) | (budget_t <= s + 1)
        if eos and bool(done.all()):  # one sync per step, only when stopping on eos
            break
    table = torch.stack(generated, dim=1).tolist()  # [B, steps]
    out = []
    for b in range(B):
        toks = table[b][: budget[b]]
        for i, t in enumerate(toks):
            if t in eos:
                toks = toks[: i + 1]
                break
        out.append(toks)
    return out
