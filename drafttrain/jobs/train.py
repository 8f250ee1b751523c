"""`train(cfg) -> summary`: the training step of the job behind `python -m drafttrain`
(`drafttrain.jobs.job`: train -> export -> verify).

setup (`drafttrain.jobs.setup.setup_training`: target, tokenized data, the kind's `init_drafter`,
the target the loop asks for features: live or an offline feature cache, through the target
interface) -> optimizer loop over the kind's objective (`drafttrain.trainer.loop.run_loop`:
accumulate, clip, step, schedule, log, periodic hooks; checkpoints and resume here) ->
held-out evaluation. Nothing here names a drafter kind or a target family: the kind's
`TrainSpec` (`drafttrain.registry`) supplies the drafter and the objective, and the drafter's
`FeatureSpec` tells the target what to return.

One process or several: the loop goes through `accelerate` (`drafttrain.trainer.distributed`), so
DDP, DeepSpeed ZeRO and FSDP2 wrap the drafter from outside the model code (STYLE rule 3).
Determinism: the drafter init is seeded, the batch order is a pure function of (seed, epoch),
and a checkpoint stores the optimizer, scheduler, RNG and the data cursor, so a resumed run
reproduces the uninterrupted one exactly (test R3).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml

from draftinfer.evaluation.threads import torch_threads
from drafttrain.data import BatchStream
from drafttrain.jobs.config import TrainConfig, check_train_config
from drafttrain.jobs.errors import ConfigError
from drafttrain.jobs.rollouts import OPDModule, RolloutBatches, RolloutHook
from drafttrain.jobs.runner_eval import RunnerEval
from drafttrain.jobs.setup import setup_training
from drafttrain.objectives.loss_fns import row_loss
from drafttrain.objectives.losses import data_parallel, metric_values
from drafttrain.objectives.opd import OPDLoss
from drafttrain.objectives.ttt import pick_backend
from drafttrain.trainer.checkpoint import (
    begin_checkpoint,
    finish_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_init_weights,
    load_rank_rng,
    restore_rng,
    save_rank_rng,
)
from drafttrain.trainer.distributed import (
    ObjectiveModule,
    configure_engine,
    full_drafter_state,
    make_accelerator,
    reduce_sum,
    replicated_loading,
    shard_batch,
    shards_state,
)
from drafttrain.trainer.loggers import MetricLogger, NullLogger, read_metrics
from drafttrain.trainer.loop import (
    DeviceBatches,
    LoopHook,
    loop_state,
    restore_loop,
    run_loop,
    warmup_cosine,
)
from drafttrain.trainer.optim import build_optimizer, with_master_weights
from drafttrain.trainer.wrap import apply_training_wrappers


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["drafter"] = asdict(cfg.drafter)
    return d


def write_resolved_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


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


def final_walk(cfg: TrainConfig, objective, target, device, run_dir: Path, logger) -> dict:
    """The training-time walk AL at the end of training (`drafttrain.jobs.walk_al`), over the
    runner check's prompts and K: `walk_al.json`, the metrics log, and the summary keys
    `sim_walk_*` (or `sim_walk_al`: the reason it was skipped)."""
    from drafttrain.frozen.target import FrozenTarget
    from drafttrain.jobs.runner_eval import verify_config
    from drafttrain.jobs.walk_al import CONTINUATIONS_FILE, held_out_continuations, walk_al

    if not hasattr(objective, "anchor_logits"):
        return {"sim_walk_al": f"skipped: the {objective.__class__.__name__} has no anchor_logits"}
    if not isinstance(target, FrozenTarget):
        return {"sim_walk_al": "skipped: the features come from a cache (no live target)"}
    t0 = time.perf_counter()
    icfg = verify_config(cfg, run_dir)
    limit = objective.anchor_draft_limit() if hasattr(objective, "anchor_draft_limit") else None
    if limit is not None and limit < icfg.k:
        return {"sim_walk_al": f"skipped: K={icfg.k} drafts, the trainer's forward gives {limit}"}
    seqs = held_out_continuations(icfg, device, icfg.k + 1, run_dir / CONTINUATIONS_FILE)
    if isinstance(seqs, str):
        return {"sim_walk_al": f"skipped: {seqs}"}
    was_training = objective.drafter.training
    objective.drafter.eval()
    try:
        out = walk_al(objective, target, seqs, icfg.k, device)
    finally:
        objective.drafter.train(was_training)
    out["sim_walk_total_seconds"] = round(time.perf_counter() - t0, 2)  # continuations included
    logger.log({k: v for k, v in out.items() if isinstance(v, float)}, cfg.trainer.max_steps)
    (run_dir / "walk_al.json").write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"training-time walk AL {out['sim_walk_al']:.3f} at K={icfg.k} "
        f"({out['sim_walk_rounds']} rounds, {out['sim_walk_total_seconds']} s)"
    )
    return out


def opd_rollouts(cfg: TrainConfig, kind: str, drafter, target, device, run_dir: Path, world: int):
    """`trainer.stage=opd`: the rollout maker (`drafttrain.jobs.rollouts.Rollouts`; its prompts
    rendered now, so bad input fails before anything is written), or None in the SFT stage."""
    if cfg.trainer.stage != "opd":
        return None
    from draftinfer.registry import drafter_spec
    from drafttrain.frozen.target import FrozenTarget
    from drafttrain.jobs.rollouts import Rollouts

    if world > 1:
        raise ConfigError("trainer.stage=opd runs in one process (no launcher) for now")
    if not isinstance(target, FrozenTarget):
        raise ConfigError("trainer.stage=opd needs the live target (data.cache=null)")
    k = cfg.opd.k if cfg.opd.k is not None else cfg.export.verify_k
    drafter_spec(kind).check_k(drafter.config, k)
    return Rollouts(cfg, target, drafter.config.features, device, run_dir, k)


def train(cfg: TrainConfig, keep_logger: bool = False) -> dict[str, Any]:
    """Train (or resume) and checkpoint. Returns a summary dict (`run_dir`, losses, eval).
    `keep_logger=True` leaves the metric logger open in `summary["logger"]` (the job logs the
    runner's results into the same wandb run, then finishes it).

    Under a launcher (`drafttrain.trainer.distributed`) every rank runs this with its share of each
    global batch; only the main process writes the run directory, logs and shows progress.

    Bad input (config, data, target) fails with a one-line `DraftError` before anything is
    written; a fresh run directory is removed again if setup fails."""
    with torch_threads(cfg.trainer.num_threads):
        return _train(cfg, keep_logger)


def _train(cfg: TrainConfig, keep_logger: bool) -> dict[str, Any]:
    tc = check_train_config(cfg).trainer  # a bad value fails here, before anything is written
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
            setup = setup_training(cfg, device)
        spec, split, drafter, target = setup.job.spec, setup.job.split, setup.drafter, setup.target
        drafter.to(device)
        # Frozen parameters, precision, torch.compile and activation checkpointing, from
        # outside the model code (a bad `trainer.freeze` fails here, before any output).
        apply_training_wrappers(drafter, spec.blocks(drafter), tc)
        # The runner's AL every `eval.every_n_steps` steps (None when off; prompts checked now).
        runner = RunnerEval.for_run(cfg, device, accelerator)
        init = None
        if tc.init_from is not None and resume_from is None:  # weights only; resume wins
            arch = drafter.config.to_dict()
            init, heads = load_init_weights(
                tc.init_from, spec.name, arch, lambda saved: spec.warm_start_heads(saved, arch)
            )
            if heads:  # the heads this architecture adds start at their init
                own = drafter.trainable_state_dict()
                init.update({k: v for k, v in own.items() if k.startswith(heads)})
                print(f"init_from: {', '.join(heads)} start at their init", flush=True)
        rollouts = opd_rollouts(cfg, spec.name, drafter, target, device, run_dir, world)
    except BaseException:
        if main and fresh and run_dir.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_resolved_config(cfg, run_dir / "training_args.yaml")
    kind, arch = spec.name, drafter.config
    if init is not None:
        drafter.load_own_state({k: v.to(device) for k, v in init.items()})
    own_keys = set(drafter.trainable_state_dict())
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, tc)
    scheduler = warmup_cosine(optimizer, tc)
    pad_id = setup.job.pad_id
    if rollouts is None:
        stream = BatchStream(split, cfg.data.batch_size, pad_id, cfg.seed)
        # A source that reads ahead of the loop (a streaming engine source) wraps the stream.
        stream = getattr(target, "stream_batches", lambda s: s)(stream)
        batches = DeviceBatches(
            stream,
            device,
            lambda b: shard_batch(b, rank, world, split),  # this rank's rows of the global batch
        )
    else:  # trainer.stage=opd: the runner's rollouts with the current drafter
        batches = RolloutBatches(rollouts, cfg.data.batch_size, cfg.seed)

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
        start_step = restore_loop(ck["state"], scheduler, batches)
    loss = row_loss(tc.loss or spec.default_loss)
    objective = spec.objective(
        drafter,
        cfg.drafter,
        pick_backend(cfg.drafter.attention_backend, device),
        loss,
    )
    configure_engine(accelerator, tc, -(-cfg.data.batch_size // world))
    module = ObjectiveModule(objective, target)
    if rollouts is not None:
        o = cfg.opd
        opd_loss = OPDLoss(objective, rollouts.k, o.gamma, o.normalize, o.rejected_loss)
        module = OPDModule(opd_loss, batches)
    wrapped, optimizer = accelerator.prepare(module, optimizer)
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
        if main:
            begin_checkpoint(ckpt_root, step)
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
                    **loop_state(scheduler, batches),
                    "drafter_kind": kind,
                    "drafter_config": arch.to_dict(),
                    "objective": objective.checkpoint_meta(),
                    "stage": tc.stage,
                    "loss": loss.name,
                    "world_size": world,
                    "engine_state": engine_state,
                },
                keep_last=tc.keep_last,
            )
        accelerator.wait_for_everyone()

    # Periodic callbacks of the loop (`drafttrain.trainer.loop.LoopHook`: every N steps and after the
    # last, on every rank, metrics logged at that step), e.g. the runner's AL during training.
    hooks: list[LoopHook] = [] if runner is None else [runner.hook(kind, arch, own_state)]
    t_stage = time.perf_counter()  # the stage's wall time: the first rollout and the loop
    if rollouts is not None:
        refresh = RolloutHook(batches, kind, arch, own_state, cfg.opd.refresh_every)
        hooks.append(refresh)
        if batches.store is None:  # a fresh run: the first rollout, with the SFT weights
            logger.log(refresh.refresh(start_step), start_step)
    loop = run_loop(
        accelerator,
        wrapped,
        optimizer,
        scheduler,
        batches,
        tc,
        start_step=start_step,
        logger=logger,
        desc=f"train {kind}",
        checkpoint=checkpoint,
        hooks=hooks,
        forward_context=lambda: data_parallel(reduce_sum(accelerator), world),
    )
    close = getattr(getattr(batches, "stream", None), "close", None)
    if close is not None:  # a read-ahead stream stops reading
        close()
    if start_step < tc.max_steps or latest_checkpoint(ckpt_root) is None:
        checkpoint(tc.max_steps)
    losses = loop.losses
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "steps": tc.max_steps,
        "stage": tc.stage,
        # Wall time of this process's steps (OPD: rollouts and their features included; the
        # runner's AL during training too, when on): the budget OPD and SFT are matched on.
        "stage_seconds": round(time.perf_counter() - t_stage, 2),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "main_process": main,
    }
    if cfg.data.eval_split:
        # The held-out split is scored with the kind's own objective (in the OPD stage too).
        held = wrapped if rollouts is None else ObjectiveModule(objective, target)
        ev = evaluate(cfg, held, split, device, pad_id, accelerator)
        logger.log(ev, tc.max_steps)
        if main:
            (run_dir / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")
        summary.update(ev)
    if runner is not None:
        summary.update(runner.finish(summary, run_dir, loop.seconds))
    if cfg.eval.walk and main:
        summary.update(final_walk(cfg, objective, target, device, run_dir, logger))
    if keep_logger:
        summary["logger"] = logger
    else:
        logger.finish()
    if main:
        save_training_plot(run_dir)
    summary["losses"] = losses
    return summary
