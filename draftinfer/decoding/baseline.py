"""The plain decode loop: the baseline speculative decoding must reproduce token for token
(greedy) or match in distribution (sampled), and the speed baseline of the runner's report.

    outs = greedy_generate(model, [[1, 2, 3], [1, 5]], max_new_tokens=64, eos_ids=model.config.eos_token_ids)
    outs = sample_generate(model, prompts, 64, eos_ids, [SamplingParams(0.7, top_p=0.9, seed=1)] * 2)
    step = PlainStep(model, compile=True, cuda_graphs=True)   # the best plain step (CUDA)
    outs = greedy_generate(model, prompts, 64, eos_ids, step_fn=step, stats=stats)

`PlainStep` is the plain decoding a user could run instead of speculative decoding, at its
best on this project's code: the one-token step compiled as the speculative round's verify
forward is (`draftinfer.decoding.compiled`, the runner's inductor settings) and, on CUDA,
replayed from a CUDA graph per attention bucket (`draftinfer.decoding.graphs`), under the
serving transforms the round runs with. The runner's report measures speculative decoding
against it (`InferConfig.baseline`), not against the eager loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch

from draftinfer.conventions.slots import Slots, attn_bucket
from draftinfer.decoding.compiled import compiled, runner_compile_options, target_forward
from draftinfer.decoding.graphs import GraphedFunction
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

# step_fn(input_ids [B, 1], cache_pos [B, 1], cache_rows [B], attn_len) -> logits [B, 1, V];
# attn_len: the keys a step reads, bucketed on the host (`attn_bucket`).
StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
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
    stats: dict | None = None,
) -> list[list[int]]:
    """Greedy (argmax) continuation of each prompt: a padded, ragged batch through the cache.

    Returns the new tokens of each request (not the prompt). A request stops after emitting
    one of `eos_ids` (kept, as HF `generate` keeps it), after `max_new_tokens`, or when its
    length reaches `model.max_seq_len`. Prompts beyond `model.max_batch` run in successive
    groups. `step_fn` replaces the one-token decode step (e.g. `PlainStep`); prefill always
    runs `model.forward`, fed by the target's `prefill_plan` (`mm_inputs[b]`: request b's
    multimodal inputs or None, as `draftinfer.decoding.engine.Request.mm_inputs`). `stats`,
    when given, gathers the decode part's wall time and steps (`decode_seconds`, `steps`;
    prefill excluded, each group's time ended by a device sync): the runner's plain step time.
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
        out.extend(
            _greedy_group(
                model, prompts[group], max_new_tokens, eos, step_fn, mm[group], stats=stats
            )
        )
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
    step_fn: StepFn | None = None,
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
        out.extend(
            _greedy_group(model, prompts[group], max_new_tokens, eos, step_fn, mm[group], pick)
        )
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
    stats: dict | None = None,
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
    _sync(device)
    t0, ran = time.perf_counter(), 0
    stop = _StopFlag(device) if eos else None
    for s in range(1, steps):
        # Feed token index lens+s-1 (emitted last step) at that position; finished rows are
        # padding slots, so they write nothing and stay within max_seq_len.
        feed_pos = torch.where(done, -1, lens_t + s - 1)[:, None]  # [B, 1]
        # The bound on live positions is known on the host: no per-step sync or check;
        # bucketed so attention shapes change only at powers of two.
        attn_len = attn_bucket(min(T + s, model.max_seq_len), model.max_seq_len)
        if step_fn is None:
            logits = model(tok[:, None], Slots(rows, feed_pos, attn_len=attn_len)).logits
        else:
            logits = step_fn(tok[:, None], feed_pos, rows, attn_len)
        tok = pick(logits[:, -1], lens_t + s)
        generated.append(tok)
        ran += 1
        done = done | torch.isin(tok, eos_t) | (budget_t <= s + 1)
        if stop is not None and stop.check(done):  # every row stopped (one step late at most)
            break
    _sync(device)
    if stats is not None:
        stats["decode_seconds"] = stats.get("decode_seconds", 0.0) + time.perf_counter() - t0
        stats["steps"] = stats.get("steps", 0) + ran
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _StopFlag:
    """Whether every row has stopped, read without stalling the device each step: on CUDA the
    flag of step s is copied to pinned memory behind an event and read at step s + 1 if it has
    landed (so the host keeps queueing steps; at most one step runs past the last stop, its
    tokens dropped by the budget and EOS trimming); on the CPU it is read at once."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.zeros((), dtype=torch.bool, pin_memory=True)
            self.event: torch.cuda.Event | None = None

    def check(self, done: torch.Tensor) -> bool:
        if not self.cuda:
            return bool(done.all())
        if self.event is not None and self.event.query() and bool(self.host):
            return True
        self.host.copy_(done.all(), non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()
        return False


class PlainStep:
    """The best plain decode step of `target` on its device (a `StepFn` for `greedy_generate`):
    `target_forward` compiled with dynamic shapes (`compile`, the runner's inductor settings
    `compile_options`, as `SpecDecoder` compiles its verify forward) and, on CUDA, replayed
    from a CUDA graph captured per attention bucket (`cuda_graphs`; `GraphedFunction`: the
    first use of a bucket runs as is, the second captures). `compile=False, cuda_graphs=False`
    is the eager step. Calls: `step(ids [B, 1], cache_pos [B, 1], rows [B], attn_len)`."""

    def __init__(
        self,
        target: NativeCausalLM,
        compile: bool = True,
        cuda_graphs: bool = False,
        compile_options: dict | None = None,
    ):
        self.target = target
        self.device = next(target.parameters()).device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA target, not {self.device}")
        self.compile, self.cuda_graphs = compile, cuda_graphs
        self._fwd = target_forward
        if compile:
            options = runner_compile_options(compile_options, self.device)
            self._fwd = compiled(
                target_forward, dynamic=True, **({"options": options} if options else {})
            )
        # One graph per (batch, attention bucket): successive groups of `greedy_generate`
        # may hold fewer rows than the first.
        self._graphed = GraphedFunction(self._graph_step) if cuda_graphs else None
        self.calls = 0

    @property
    def name(self) -> str:
        """`compiled+graphs`, `compiled` or `eager`: what the report names as its baseline."""
        if not self.compile:
            return "eager+graphs" if self.cuda_graphs else "eager"
        return "compiled+graphs" if self.cuda_graphs else "compiled"

    def _step(self, ids, cache_pos, rows, attn_len: int) -> tuple[torch.Tensor]:
        rope = self.target.rope_positions(cache_pos, rows)  # M-RoPE: + the row's delta, 3 axes
        logits, _ = self._fwd(self.target, ids, rows, cache_pos, rope, attn_len, (), None)
        return (logits,)

    def _graph_step(self, ids, cache_pos, rows, batch: int, attn_len: int):
        return self._step(ids, cache_pos, rows, attn_len)

    def __call__(self, ids, cache_pos, rows, attn_len: int) -> torch.Tensor:
        self.calls += 1
        if self._graphed is None:
            return self._step(ids, cache_pos, rows, attn_len)[0]
        # The graph's output buffer is overwritten by the next replay: the loop only reads
        # this step's logits before it calls again.
        return self._graphed((ids, cache_pos, rows), ids.shape[0], attn_len)[0]
