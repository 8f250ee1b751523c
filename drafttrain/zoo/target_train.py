"""Training the zoo's target models on the project's trainer: the optimizer loop of drafter
training (`drafttrain.trainer.loop.run_loop`, through `accelerate`), its optimizer
(`drafttrain.trainer.optim.build_optimizer`: AdamW with param groups) and its warmup + cosine schedule
(`drafttrain.trainer.loop.warmup_cosine`). What is the zoo's own is here:

- the objective, `NextTokenLM`: next-token cross-entropy on the tokens a batch's `labels`
  mark (the assistant tokens: -100 elsewhere), averaged over those tokens in the batch;
- the batches, `TokenBudgetBatches`: epochs of `make_batches` (a padded-token budget per
  batch, length-sorted within chunks, random order from one generator seeded once);
- the log, `BuildLog`: the rows the build report keeps (training rows and hook rows merged by
  step, with elapsed seconds).

`text_train` (tiny Llama) and `vl_train` (tiny Qwen3-VL: its vision tower in param groups of
its own at a tenth of the rate) describe their models, data and param groups and call
`train_target`. Full precision, one process, on the CPU unless the builder names a GPU.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from drafttrain.jobs.config import TrainerConfig
from drafttrain.trainer.distributed import make_accelerator
from drafttrain.trainer.loop import DeviceBatches, LoopHook, run_loop, warmup_cosine
from drafttrain.trainer.optim import build_optimizer

LOG_EVERY = 25  # optimizer steps per build-log row
BETAS = [0.9, 0.95]


class TargetArgs(Protocol):
    """The fields of a builder's `TrainArgs` the trainer reads."""

    steps: int
    tokens_per_batch: int
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    clip: float
    seed: int


def trainer_config(a: TargetArgs, progress: bool = True) -> TrainerConfig:
    """A builder's settings as the project's trainer config (fp32, no accumulation, no
    checkpoints: a build runs start to end)."""
    return TrainerConfig(
        max_steps=a.steps,
        lr=a.lr,
        weight_decay=a.weight_decay,
        betas=list(BETAS),
        warmup_steps=a.warmup,
        min_lr_ratio=a.min_lr_ratio,
        grad_clip=a.clip,
        grad_accum=1,
        mixed_precision="no",
        save_every=0,
        log_every=LOG_EVERY,
        progress=progress,
    )


def decay_groups(named: Sequence[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on the embedding, norms or biases, per-expert bias
    tables `[E, out]` included): two groups."""

    def decays(n: str, p: nn.Parameter) -> bool:
        return p.ndim >= 2 and "embed" not in n and not n.endswith("bias")

    matrix = [p for n, p in named if decays(n, p)]
    other = [p for n, p in named if not decays(n, p)]
    return [
        {"params": matrix, "weight_decay": weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]


def make_batches(examples: list, tokens_per_batch: int, gen: torch.Generator) -> list[list[int]]:
    """One epoch of index batches: shuffle, sort chunks of ~64 batches by length, cut by a
    padded-token budget, shuffle the batches. Little padding, still a random order.
    `examples[i][0]` is example i's token ids."""
    order = torch.randperm(len(examples), generator=gen).tolist()
    batches = []
    chunk = max(1, 64 * tokens_per_batch // 48)
    for c in range(0, len(order), chunk):
        part = sorted(order[c : c + chunk], key=lambda i: len(examples[i][0]))
        cur: list[int] = []
        for i in part:  # ascending length: example i is the longest so far
            if cur and len(examples[i][0]) * (len(cur) + 1) > tokens_per_batch:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[p] for p in perm]


class TokenBudgetBatches:
    """The zoo's batch stream: `make_batches` epochs from one generator seeded once, each
    batch taken from the end of its epoch's list and collated by `collate(rows)`."""

    def __init__(
        self, examples: list, tokens_per_batch: int, seed: int, collate: Callable[[list], dict]
    ):
        self.examples, self.tokens_per_batch, self.collate = examples, tokens_per_batch, collate
        self.gen = torch.Generator().manual_seed(seed)
        self.queue: list[list[int]] = []

    def next(self) -> dict[str, torch.Tensor]:
        if not self.queue:
            self.queue = make_batches(self.examples, self.tokens_per_batch, self.gen)
        return self.collate(self.queue.pop())


class NextTokenLM(nn.Module):
    """`forward(batch) -> (loss, metrics)` of a causal LM: cross-entropy of the next token at
    every position `labels [B, T]` trains (-100 elsewhere), summed and divided by the number of
    trained tokens. The rest of the batch is the model's input. With `aux_loss_coef > 0` (an
    MoE model), its routers' load-balancing loss (the model's `aux_loss`) is added with that
    weight and logged as `aux_loss`."""

    def __init__(self, model: nn.Module, aux_loss_coef: float = 0.0):
        super().__init__()
        self.model, self.aux_loss_coef = model, aux_loss_coef

    def forward(self, batch: dict[str, torch.Tensor]):
        labels = batch["labels"]  # [B, T]: the token at t + 1, or -100
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if self.aux_loss_coef:
            inputs["output_router_logits"] = True
        out = self.model(**inputs, use_cache=False)
        logits = out.logits  # [B, T, V]
        n = (labels != -100).sum()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        loss = loss / n
        metrics = {"loss": loss.detach(), "tokens": n}
        if self.aux_loss_coef:
            metrics["aux_loss"] = out.aux_loss.detach()
            loss = loss + self.aux_loss_coef * out.aux_loss
        return loss, metrics


class BuildLog:
    """The loop's logger for a build: rows by step (a step's training and hook rows merged)
    with the seconds from the start to its training row; `echo` prints each logged row as a
    JSON line."""

    def __init__(self, echo: bool = False):
        self.by_step: dict[int, dict[str, Any]] = {}
        self.echo, self.t0 = echo, time.time()

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step not in self.by_step:  # the seconds when the step's training row came
            self.by_step[step] = {"step": step, "elapsed_s": round(time.time() - self.t0, 1)}
        self.by_step[step].update(metrics)
        if self.echo:
            print(json.dumps({"step": step, **metrics}), flush=True)

    def finish(self) -> None:
        pass

    def rows(self) -> list[dict[str, Any]]:
        return [self.by_step[s] for s in sorted(self.by_step)]


def train_target(
    model: nn.Module,
    batches: TokenBudgetBatches,
    a: TargetArgs,
    groups: list[dict],
    device: torch.device,
    progress: bool = True,
    hooks: Sequence[LoopHook] = (),
    aux_loss_coef: float = 0.0,
    objective: nn.Module | None = None,
) -> tuple[list[dict[str, Any]], list[float]]:
    """Train `model` in place on `device` with AdamW over param `groups` (a group's `lr` is its
    base rate; default `a.lr`). Returns the build log's rows (one per `LOG_EVERY` steps and
    the last; hooks' metrics merged) and the per-step losses (`NextTokenLM`'s objective, with
    its MoE load-balancing term at `aux_loss_coef`; or `objective`, a module over `model` with
    the same `forward(batch) -> (loss, metrics)`, e.g. `mtp_joint.NextTokenWithMTP`). Leaves
    the model in eval mode."""
    tc = trainer_config(a, progress)
    accelerator = make_accelerator(tc, cpu=device.type == "cpu")
    optimizer = build_optimizer(groups, tc)
    scheduler = warmup_cosine(optimizer, tc)
    if objective is None:
        objective = NextTokenLM(model, aux_loss_coef)
    module, optimizer = accelerator.prepare(objective, optimizer)
    log = BuildLog(echo=not progress)
    result = run_loop(
        accelerator,
        module,
        optimizer,
        scheduler,
        DeviceBatches(batches, accelerator.device),
        tc,
        logger=log,
        desc="train",
        hooks=hooks,
    )
    objective.eval()
    return log.rows(), result.losses
