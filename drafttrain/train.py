"""`train(cfg) -> summary`: the training step of the job behind `python -m drafttrain`
(`drafttrain.job`: train -> export -> verify).

load target -> tokenize chat data -> the kind's `init_drafter` (architecture from the target,
draft vocabulary, initial weights) -> optimizer loop over the kind's objective (checkpoints,
resume) -> held-out evaluation. Nothing here names a drafter kind: the kind's `TrainSpec`
(`drafttrain.registry`) supplies the drafter and the objective, and the drafter's
`FeatureSpec` tells the target what to return.

One process or several: the loop goes through `accelerate` (`drafttrain.distributed`), so
DDP, DeepSpeed ZeRO and FSDP2 wrap the drafter from outside the model code (STYLE rule 3). Determinism: the drafter init is
seeded, the batch order is a pure function of (seed, epoch), and a checkpoint stores the
optimizer, scheduler, RNG and the data cursor, so a resumed run reproduces the
uninterrupted one exactly (test R3).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml

from draftinfer.registry import drafter_spec
from draftinfer.threads import torch_threads
from drafttrain.checkpoint import (
    begin_checkpoint,
    finish_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_rank_rng,
    restore_rng,
    save_rank_rng,
)
from drafttrain.config import TrainConfig
from drafttrain.distributed import (
    ObjectiveModule,
    configure_engine,
    full_drafter_state,
    make_accelerator,
    reduce_sum,
    replicated_loading,
    shard_batch,
    shards_state,
)
from drafttrain.errors import ConfigError, DataError
from drafttrain.families import target_family
from drafttrain.loggers import MetricLogger, NullLogger, read_metrics
from drafttrain.losses import data_parallel, metric_values
from drafttrain.optim import build_optimizer, dtype_of, with_master_weights
from drafttrain.registry import InitContext, train_spec
from drafttrain.runner_eval import RunnerEval
from drafttrain.target import load_tokenizer
from drafttrain.ttt import pick_backend
from drafttrain.wrap import apply_training_wrappers


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["drafter"] = asdict(cfg.drafter)
    return d


def write_resolved_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup, then cosine from 1 to `min_ratio` at `total` optimizer steps."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class BatchStream:
    """Deterministic micro-batch stream; its cursor (epoch, index) is checkpointed.
    `data`: a `drafttrain.data.TokenizedSplit` (batches by its collate) or a tokenized text
    dataset (batches by `drafttrain.data.collate`)."""

    def __init__(self, data, batch_size: int, pad_id: int, seed: int):
        from drafttrain.data import length_bucketed_batches

        split = data if hasattr(data, "collate") else None
        dataset = split.data if split is not None else data
        self.dataset, self.pad_id, self.seed, self.batch_size = dataset, pad_id, seed, batch_size
        self.collate = split.collate if split is not None else self._text_collate
        self.lengths = list(dataset["length"])
        self._plan = length_bucketed_batches
        self.epoch, self.index = 0, 0
        self._batches = self._plan(self.lengths, batch_size, seed, 0)

    def _text_collate(self, rows: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        from drafttrain.data import collate

        return collate([self.dataset[i] for i in rows], pad_id)

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, st: dict[str, int]) -> None:
        self.epoch, self.index = st["epoch"], st["index"]
        self._batches = self._plan(self.lengths, self.batch_size, self.seed, self.epoch)

    def next(self) -> dict[str, torch.Tensor]:
        if self.index >= len(self._batches):
            self.epoch, self.index = self.epoch + 1, 0
            self._batches = self._plan(self.lengths, self.batch_size, self.seed, self.epoch)
        ids = self._batches[self.index]
        self.index += 1
        batch = self.collate(ids, self.pad_id)
        batch["index"] = torch.tensor(ids, dtype=torch.long)  # rows of the dataset (caches)
        return batch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on the training device; from pinned memory without a host wait on CUDA."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def losses_of(step_losses: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"_loss_{i}": v for i, v in enumerate(step_losses)}


def prepare_data(cfg: TrainConfig, adapter):
    """The tokenized training split (a `drafttrain.data.TokenizedSplit`) of a data adapter
    (`TrainFamily.data`: text chat, image+text chat)."""
    split = adapter.tokenize(cfg.data)
    if len(split.data) == 0:
        raise DataError(f"dataset {cfg.data.path!r} has no usable conversations")
    return split


@torch.no_grad()
def evaluate(
    cfg: TrainConfig, wrapped, train_split, device, pad_id: int, accelerator
) -> dict[str, float]:
    """Mean objective metrics over `eval_batches` batches of the held-out split (of the
    training split's data adapter; every rank scores its rows of each batch; the metrics are
    over the whole batch)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    split, batches = train_split.held_out(cfg.data, cfg.seed)
    module = accelerator.unwrap_model(wrapped)
    module.use_split("eval")  # a feature cache reads its eval part
    wrapped.eval()
    sums: dict[str, float] = {}
    weight = 0.0
    for ids in batches:
        batch = split.collate(ids, pad_id)
        batch["index"] = torch.tensor(ids, dtype=torch.long)
        batch = {k: v.to(device) for k, v in shard_batch(batch, rank, world, split).items()}
        with accelerator.autocast(), data_parallel(reduce_sum(accelerator), world):
            _, m = wrapped(batch)
        m = metric_values(m)
        w = m.pop("tokens")
        weight += w
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v * w
    module.use_split("train")
    return {f"eval_{k}": v / max(weight, 1.0) for k, v in sums.items()}


def save_training_plot(run_dir: Path) -> Path | None:
    rows = read_metrics(run_dir)
    rows = [r for r in rows if "loss" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [r["loss"] for r in rows])
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.set_yscale("log")
    accs = sorted(
        {k for r in rows for k in r if k.startswith("acc_")}, key=lambda k: int(k.split("_")[1])
    )
    for k in accs:
        b.plot(steps, [r.get(k, float("nan")) for r in rows], label=f"draft {k.split('_')[1]}")
    b.set_xlabel("step")
    b.set_ylabel("top-1 accuracy vs target")
    b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = run_dir / "training_curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _setup(cfg: TrainConfig, run_dir: Path, device):
    """Tokenizer, target, data and the initialised drafter: everything that can fail on bad
    input, before the run writes anything of its own. The target's family
    (`drafttrain.families`, by its architecture) supplies the target and the data adapter."""
    spec = train_spec(getattr(cfg.drafter, "kind", None) or "")
    pick_backend(cfg.drafter.attention_backend, device)  # validated before any work
    dtype_of(cfg.trainer.param_dtype, "param_dtype")
    dtype_of(cfg.trainer.optimizer_dtype, "optimizer_dtype")
    family = target_family(cfg.target.name_or_path)
    family.check_kind(drafter_spec(spec.name))  # the kind x family pair, before any output
    if cfg.data.cache:
        from drafttrain.cache import check_family

        check_family(family, cfg.target.name_or_path)
    tokenizer = load_tokenizer(cfg.target.name_or_path)
    target = family.target(cfg.target, device)
    split = prepare_data(cfg, family.data(cfg.target.name_or_path, tokenizer))
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else run_dir / "cache"
    drafter = spec.init_drafter(cfg.drafter, InitContext(target, tokenizer, split.data, cache_dir))
    if cfg.data.cache:  # read features from an offline cache; the target is never run
        from drafttrain.cache import CachedTarget

        target = CachedTarget.open(cfg, target, tokenizer, split.data, drafter.config.features)
    return spec, tokenizer, target, split, drafter


def train(cfg: TrainConfig, keep_logger: bool = False) -> dict[str, Any]:
    """Train (or resume) and checkpoint. Returns a summary dict (`run_dir`, losses, eval).
    `keep_logger=True` leaves the metric logger open in `summary["logger"]` (the job logs the
    runner's results into the same wandb run, then finishes it).

    Under a launcher (`drafttrain.distributed`) every rank runs this with its share of each
    global batch; only the main process writes the run directory, logs and shows progress.

    Bad input (config, data, target) fails with a one-line `DraftError` before anything is
    written; a fresh run directory is removed again if setup fails."""
    with torch_threads(cfg.trainer.num_threads):
        return _train(cfg, keep_logger)


def _train(cfg: TrainConfig, keep_logger: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    tc = cfg.trainer
    run_dir = Path(cfg.output_dir)
    fresh = not run_dir.exists()
    ckpt_root = run_dir / "checkpoints"
    resume_from = latest_checkpoint(ckpt_root) if cfg.resume else None

    accelerator = make_accelerator(tc)
    device, main = accelerator.device, accelerator.is_main_process
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(cfg.seed)
    try:
        # Rank 0 builds the data caches, then the rest; the target is whole on every rank.
        with accelerator.main_process_first(), replicated_loading(accelerator):
            spec, tokenizer, target, split, drafter = _setup(cfg, run_dir, device)
        drafter.to(device)
        # Frozen parameters, precision, torch.compile and activation checkpointing, from
        # outside the model code (a bad `trainer.freeze` fails here, before any output).
        apply_training_wrappers(drafter, spec.blocks(drafter), tc)
        # The runner's AL every `eval.every_n_steps` steps (None when off; prompts checked now).
        runner = RunnerEval.for_run(cfg, device, accelerator)
    except BaseException:
        if main and fresh and run_dir.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_resolved_config(cfg, run_dir / "training_args.yaml")
    kind, arch = spec.name, drafter.config
    own_keys = set(drafter.trainable_state_dict())
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, tc)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stream = BatchStream(split, cfg.data.batch_size, pad_id, cfg.seed)

    start_step, ck = 0, None
    if resume_from is not None:
        ck = load_checkpoint(resume_from)
        if ck["state"].get("drafter_config") != arch.to_dict():
            raise ConfigError(
                f"cannot resume from {resume_from}: its drafter architecture "
                "differs from this config"
            )
        if bool(ck["state"].get("engine_state")) != shards_state(accelerator):
            raise ConfigError(
                f"cannot resume from {resume_from}: it was written "
                + ("with" if ck["state"].get("engine_state") else "without")
                + " a sharding engine (DeepSpeed ZeRO / FSDP); resume under the same launcher"
            )
        drafter.load_own_state({k: v.to(device) for k, v in ck["drafter"].items()})
        if ck["optimizer"] is not None:
            optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["state"]["scheduler"])
        stream.restore(ck["state"]["data"])
        start_step = ck["state"]["step"]
    objective = spec.objective(
        drafter, cfg.drafter, pick_backend(cfg.drafter.attention_backend, device)
    )
    configure_engine(accelerator, tc, -(-cfg.data.batch_size // world))
    wrapped, optimizer = accelerator.prepare(ObjectiveModule(objective, target), optimizer)
    if ck is not None:
        if ck["state"].get("engine_state"):
            accelerator.load_state(str(resume_from / "engine"))
        restore_rng(load_rank_rng(resume_from, rank))
    logger = (
        MetricLogger(cfg.logger, run_dir, config_to_dict(cfg), resume=resume_from is not None)
        if main
        else NullLogger()
    )
    engine_state = shards_state(accelerator)

    def own_state() -> dict[str, torch.Tensor]:
        """The drafter's own tensors as a checkpoint stores them. Collective under sharding."""
        return (
            full_drafter_state(accelerator, wrapped, own_keys)
            if engine_state
            else with_master_weights(drafter.trainable_state_dict(), drafter, optimizer)
        )

    def checkpoint(step: int) -> None:
        """Collective: every rank calls it (gathers, engine state, per-rank RNG)."""
        own = own_state()
        tmp = begin_checkpoint(ckpt_root, step) if main else None
        accelerator.wait_for_everyone()
        tmp = ckpt_root / f"step_{step:06d}.tmp"
        if engine_state:
            accelerator.save_state(str(tmp / "engine"))
        if rank:
            save_rank_rng(tmp, rank)
        accelerator.wait_for_everyone()
        if main:
            finish_checkpoint(
                ckpt_root,
                step,
                own,
                None if engine_state else optimizer,
                {
                    "scheduler": scheduler.state_dict(),
                    "data": stream.state(),
                    "drafter_kind": kind,
                    "drafter_config": arch.to_dict(),
                    "objective": objective.checkpoint_meta(),
                    "world_size": world,
                    "engine_state": engine_state,
                },
                keep_last=tc.keep_last,
            )
        accelerator.wait_for_everyone()

    bar = tqdm(
        total=tc.max_steps,
        initial=start_step,
        disable=not (tc.progress and main),
        desc=f"train {kind}",
        unit="step",
        dynamic_ncols=True,
    )
    # Metrics stay device tensors (float64, the same arithmetic a host loop would do) until a
    # log step reads them all at once: the loop itself never waits for the device.
    window: dict[str, torch.Tensor | float] = {}
    n_window, tok_window, t_window = 0, 0.0, time.perf_counter()
    step_losses: list[torch.Tensor] = []  # per optimizer step, read at log steps
    losses: list[float] = []  # per optimizer step (golden-loss and rank-match tests)
    postfix: dict[str, str] = {}  # the progress bar's fields
    last_log: dict[str, float] = {}  # the latest log row
    t_loop = time.perf_counter()
    for step in range(start_step, tc.max_steps):
        wrapped.train()
        step_metrics: dict[str, torch.Tensor | float] = {}
        for _ in range(tc.grad_accum):
            batch = shard_batch(stream.next(), rank, world, split)
            batch = {k: to_device(v, device) for k, v in batch.items()}
            with accelerator.accumulate(wrapped), accelerator.autocast():
                with data_parallel(reduce_sum(accelerator), world):
                    loss, m = wrapped(batch)
                accelerator.backward(loss)
            for k, v in m.items():
                step_metrics[k] = step_metrics.get(k, 0.0) + v / tc.grad_accum
        if tc.grad_clip > 0:
            accelerator.clip_grad_norm_(wrapped.parameters(), tc.grad_clip)
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
            values = metric_values({**window, "_tokens": tok_window, **losses_of(step_losses)})
            losses += [values.pop(f"_loss_{i}") for i in range(len(step_losses))]
            step_losses = []
            tok = values.pop("_tokens")
            dt = time.perf_counter() - t_window
            avg = {k: v / n_window for k, v in values.items() if k != "tokens"}
            avg["lr"] = scheduler.get_last_lr()[0]
            avg["tokens_per_s"] = tok / max(dt, 1e-9)
            logger.log(avg, done)
            last_log = avg
            accs = sorted((k for k in avg if k.startswith("acc_")), key=lambda k: int(k[4:]))
            postfix.update(
                loss=f"{avg['loss']:.3f}",
                acc="/".join(f"{avg[k]:.2f}" for k in accs),  # per draft step / depth / module
                sim_al=f"{avg['sim_al']:.2f}",
                tok_s=f"{avg['tokens_per_s']:.0f}",
            )
            bar.set_postfix(postfix)
            window, n_window, tok_window, t_window = {}, 0, 0.0, time.perf_counter()
        if runner is not None:  # its time is kept out of the window's tokens/s
            t_window += runner.after_step(
                done, kind, arch, own_state, last_log, logger, bar, postfix
            )
        bar.update(1)
        if tc.save_every > 0 and done % tc.save_every == 0 and done != tc.max_steps:
            checkpoint(done)
    bar.close()
    loop_seconds = time.perf_counter() - t_loop
    if start_step < tc.max_steps or latest_checkpoint(ckpt_root) is None:
        checkpoint(tc.max_steps)
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "steps": tc.max_steps,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "main_process": main,
    }
    if cfg.data.eval_split:
        ev = evaluate(cfg, wrapped, split, device, pad_id, accelerator)
        logger.log(ev, tc.max_steps)
        if main:
            (run_dir / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")
        summary.update(ev)
    if runner is not None:
        summary.update(runner.finish(summary, run_dir, loop_seconds))
    if keep_logger:
        summary["logger"] = logger
    else:
        logger.finish()
    if main:
        save_training_plot(run_dir)
    summary["losses"] = losses
    return summary
