"""The optimizer loop every training of the project runs: a drafter (`drafttrain.jobs.train`) and
the zoo's target models (`drafttrain.zoo.target_train`). Nothing here knows what is trained.

    for step in start..max_steps:
        grad_accum micro-batches: forward (autocast, the job's forward context) -> backward
        clip to trainer.grad_clip -> optimizer step -> schedule step -> zero grads
        every trainer.log_every steps (and the last): window means -> logger, progress bar
        every hook.every_n_steps steps (and the last): hook -> logger, progress bar
        every trainer.save_every steps (not the last): checkpoint(step)

What a job hands it (`run_loop`):
- the accelerator (`drafttrain.trainer.distributed.make_accelerator`) and what it prepared: a module
  whose `forward(batch) -> (loss, metrics)` gives the micro-batch's loss and its metrics as
  device tensors, with at least `loss` and `tokens` (tokens scored, for tokens/s), and the
  optimizer; the schedule (`warmup_cosine`) built on the optimizer before `prepare`;
- `batches.next()`: the next micro-batch, on the device, this rank's rows (`DeviceBatches`);
  its cursor is what a checkpoint stores of the data (`state()` / `restore()`);
- `checkpoint(step)`: called on every rank at `save_every` (collective under sharding);
- `hooks`: periodic callbacks (`LoopHook`), e.g. the runner's AL during training or a held-out
  probe; their time is not counted in tokens/s.

Resume: the job restores the optimizer, the schedule and the batch cursor from a checkpoint
and passes `start_step`; the loop itself keeps no other state, so a resumed run continues the
uninterrupted one exactly (tests/train/test_train.py::test_resume_after_sigkill_is_exact).

Metrics stay device tensors (float64, the same arithmetic a host loop would do) until a log
step reads them all at once: the loop never waits for the device between log steps. A log
row holds the window's mean of each metric over its optimizer steps (each step's metric is
the mean over its micro-batches), `lr` (after the step) and `tokens_per_s`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from drafttrain.jobs.config import TrainerConfig
from drafttrain.objectives.losses import metric_values
from drafttrain.trainer.loggers import NullLogger


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup, then cosine from 1 to `min_ratio` at `total` optimizer steps."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def warmup_cosine(optimizer: torch.optim.Optimizer, tc: TrainerConfig):
    """The trainer's schedule: every param group's lr is its own base lr times `lr_lambda`."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    )


class Batches(Protocol):
    def next(self) -> dict[str, torch.Tensor]: ...


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on the training device; from pinned memory without a host wait on CUDA."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class DeviceBatches:
    """A host batch stream's micro-batches as the loop consumes them: this rank's rows
    (`shard(batch)`, e.g. `drafttrain.trainer.distributed.shard_batch`), on `device`. `state()` /
    `restore()` are the stream's cursor."""

    def __init__(self, stream, device: torch.device, shard: Callable[[dict], dict] = lambda b: b):
        self.stream, self.device, self.shard = stream, device, shard

    def next(self) -> dict[str, torch.Tensor]:
        batch = self.shard(self.stream.next())
        return {k: to_device(v, self.device) for k, v in batch.items()}

    def state(self) -> dict[str, Any]:
        return self.stream.state()

    def restore(self, st: dict[str, Any]) -> None:
        self.stream.restore(st)


def loop_state(scheduler, batches) -> dict[str, Any]:
    """What a checkpoint stores of the loop besides the weights and the optimizer: the schedule
    and the data cursor (with the step, the job's checkpoint writes it into `state.json`)."""
    return {"scheduler": scheduler.state_dict(), "data": batches.state()}


def restore_loop(state: dict[str, Any], scheduler, batches) -> int:
    """Resume: the schedule and the data cursor of a checkpoint's `state`; its step, where the
    loop starts again."""
    scheduler.load_state_dict(state["scheduler"])
    batches.restore(state["data"])
    return state["step"]


class LoopHook:
    """A periodic callback: called on every rank after optimizer step `step` when `step` is a
    multiple of `every_n_steps` (0: never) and after the last step, with the latest log row.
    Returns metrics to log at `step` (and to show: `postfix`)."""

    every_n_steps: int = 0

    def due(self, step: int, max_steps: int) -> bool:
        n = self.every_n_steps
        return n > 0 and (step % n == 0 or step == max_steps)

    def __call__(self, step: int, last_log: dict[str, float]) -> dict[str, float]:
        raise NotImplementedError

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """What the progress bar shows of this hook's metrics."""
        return {}


def postfix_of(row: dict[str, float]) -> dict[str, str]:
    """The progress bar's view of a log row: loss, per-draft-step accuracy and simulated AL
    when the objective reports them, tokens/s."""
    out = {"loss": f"{row['loss']:.3f}"}
    accs = sorted((k for k in row if k.startswith("acc_")), key=lambda k: int(k[4:]))
    if accs:
        out["acc"] = "/".join(f"{row[k]:.2f}" for k in accs)  # per draft step / depth / module
    if "sim_al" in row:
        out["sim_al"] = f"{row['sim_al']:.2f}"
    out["tok_s"] = f"{row['tokens_per_s']:.0f}"
    return out


@dataclass
class LoopResult:
    losses: list[float]  # per optimizer step run here (golden-loss and rank-match tests)
    last_log: dict[str, float] = field(default_factory=dict)  # the latest log row
    seconds: float = 0.0  # wall time of the loop


def run_loop(
    accelerator,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    batches: Batches,
    tc: TrainerConfig,
    *,
    start_step: int = 0,
    logger=None,
    desc: str = "train",
    checkpoint: Callable[[int], None] | None = None,
    hooks: Sequence[LoopHook] = (),
    forward_context: Callable[[], AbstractContextManager] = nullcontext,
) -> LoopResult:
    """Optimizer steps `start_step .. tc.max_steps` (module docstring). Only the main process
    shows progress; `logger` (default: none) logs the rows."""
    from tqdm.auto import tqdm

    logger = logger or NullLogger()
    bar = tqdm(
        total=tc.max_steps,
        initial=start_step,
        disable=not (tc.progress and accelerator.is_main_process),
        desc=desc,
        unit="step",
        dynamic_ncols=True,
    )
    window: dict[str, torch.Tensor | float] = {}
    n_window, tok_window, t_window = 0, 0.0, time.perf_counter()
    step_losses: list[torch.Tensor] = []  # per optimizer step, read at log steps
    result, postfix = LoopResult([]), {}
    t_loop = time.perf_counter()
    for step in range(start_step, tc.max_steps):
        model.train()
        step_metrics: dict[str, torch.Tensor | float] = {}
        for _ in range(tc.grad_accum):
            batch = batches.next()
            with accelerator.accumulate(model), accelerator.autocast():
                with forward_context():
                    loss, m = model(batch)
                accelerator.backward(loss)
            for k, v in m.items():
                step_metrics[k] = step_metrics.get(k, 0.0) + v / tc.grad_accum
        if tc.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_losses.append(step_metrics["loss"])
        for k, v in step_metrics.items():
            window[k] = window.get(k, 0.0) + v
        n_window += 1
        tok_window = tok_window + step_metrics["tokens"] * tc.grad_accum
        done = step + 1
        if done % tc.log_every == 0 or done == tc.max_steps:
            losses = {f"_loss_{i}": v for i, v in enumerate(step_losses)}
            values = metric_values({**window, "_tokens": tok_window, **losses})
            result.losses += [values.pop(f"_loss_{i}") for i in range(len(step_losses))]
            step_losses = []
            tok = values.pop("_tokens")
            dt = time.perf_counter() - t_window
            row = {k: v / n_window for k, v in values.items() if k != "tokens"}
            row["lr"] = scheduler.get_last_lr()[0]
            row["tokens_per_s"] = tok / max(dt, 1e-9)
            logger.log(row, done)
            result.last_log = row
            postfix.update(postfix_of(row))
            bar.set_postfix(postfix)
            window, n_window, tok_window, t_window = {}, 0, 0.0, time.perf_counter()
        for hook in hooks:
            if hook.due(done, tc.max_steps):
                t_hook = time.perf_counter()
                metrics = hook(done, result.last_log)
                if metrics:
                    logger.log(metrics, done)
                    postfix.update(hook.postfix(metrics))
                    bar.set_postfix(postfix)
                t_window += time.perf_counter() - t_hook  # tokens/s counts training only
        bar.update(1)
        if checkpoint and tc.save_every > 0 and done % tc.save_every == 0 and done != tc.max_steps:
            checkpoint(done)
    bar.close()
    result.seconds = time.perf_counter() - t_loop
    return result
