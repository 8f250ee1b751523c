"""`train(cfg)`: the whole job behind `python -m drafttrain conf=<preset>`.

load target -> tokenize chat data -> draft vocabulary -> build drafter -> optimizer loop
(checkpoints, resume) -> export (`<output_dir>/export/`).

Single process today; the loop goes through `accelerate` so wrapping for several GPUs is
applied from outside the model code later (STYLE rule 3). Determinism: the drafter init is
seeded, the batch order is a pure function of (seed, epoch), and a checkpoint stores the
optimizer, scheduler, RNG and the data cursor, so a resumed run reproduces the
uninterrupted one exactly (test R3).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml

from draftinfer.drafters import DRAFTERS
from drafttrain.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from drafttrain.config import TrainConfig
from drafttrain.errors import ConfigError, DataError
from drafttrain.loggers import MetricLogger, read_metrics
from drafttrain.objectives import OBJECTIVES
from drafttrain.objectives.eagle3 import init_from_target
from drafttrain.target import FrozenTarget, resolve_target_path
from drafttrain.ttt import pick_backend


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["drafter"] = asdict(cfg.drafter)
    return d


def write_resolved_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    from drafttrain.errors import TargetError

    path = resolve_target_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TargetError(f"cannot load the tokenizer of {name_or_path!r}: {first}") from None


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup, then cosine from 1 to `min_ratio` at `total` optimizer steps."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class BatchStream:
    """Deterministic micro-batch stream; its cursor (epoch, index) is checkpointed."""

    def __init__(self, dataset, batch_size: int, pad_id: int, seed: int):
        from drafttrain.data import length_bucketed_batches

        self.dataset, self.pad_id, self.seed, self.batch_size = dataset, pad_id, seed, batch_size
        self.lengths = list(dataset["length"])
        self._plan = length_bucketed_batches
        self.epoch, self.index = 0, 0
        self._batches = self._plan(self.lengths, batch_size, seed, 0)

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, st: dict[str, int]) -> None:
        self.epoch, self.index = st["epoch"], st["index"]
        self._batches = self._plan(self.lengths, self.batch_size, self.seed, self.epoch)

    def next(self) -> dict[str, torch.Tensor]:
        from drafttrain.data import collate

        if self.index >= len(self._batches):
            self.epoch, self.index = self.epoch + 1, 0
            self._batches = self._plan(self.lengths, self.batch_size, self.seed, self.epoch)
        ids = self._batches[self.index]
        self.index += 1
        return collate([self.dataset[i] for i in ids], self.pad_id)


def prepare_data(cfg: TrainConfig, tokenizer, target_vocab: int, cache_dir: Path):
    from drafttrain.data import load_chat_dataset, load_or_build_draft_vocab, tokenize_dataset

    raw = load_chat_dataset(cfg.data)
    data = tokenize_dataset(raw, tokenizer, cfg.data)
    if len(data) == 0:
        raise DataError(f"dataset {cfg.data.path!r} has no usable conversations")
    d2t, t2d = load_or_build_draft_vocab(
        data, target_vocab, cfg.drafter.draft_vocab_size, str(cache_dir / "draft_vocab")
    )
    return data, d2t, t2d


@torch.no_grad()
def evaluate(
    cfg: TrainConfig, objective, target: FrozenTarget, tokenizer, device, pad_id: int
) -> dict[str, float]:
    """Mean TTT metrics over `eval_batches` batches of the held-out split (no gradients)."""
    from dataclasses import replace

    from drafttrain.data import collate, load_chat_dataset, tokenize_dataset

    dcfg = replace(cfg.data, split=cfg.data.eval_split, max_samples=None)
    data = tokenize_dataset(load_chat_dataset(dcfg), tokenizer, dcfg)
    from drafttrain.data import length_bucketed_batches

    batches = length_bucketed_batches(
        list(data["length"]), cfg.data.batch_size, cfg.seed, 0, shuffle=False
    )[: cfg.data.eval_batches]
    objective.drafter.eval()
    sums: dict[str, float] = {}
    weight = 0.0
    for ids in batches:
        batch = {k: v.to(device) for k, v in collate([data[i] for i in ids], pad_id).items()}
        _, m = objective(batch, target(batch["input_ids"], batch["attention_mask"]))
        w = m.pop("tokens")
        weight += w
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v * w
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
    a.set_ylabel("TTT loss")
    a.set_yscale("log")
    accs = sorted(
        {k for r in rows for k in r if k.startswith("acc_")}, key=lambda k: int(k.split("_")[1])
    )
    for k in accs:
        b.plot(steps, [r.get(k, float("nan")) for r in rows], label=f"step {k.split('_')[1]}")
    b.set_xlabel("step")
    b.set_ylabel("top-1 accuracy vs target")
    b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = run_dir / "training_curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume), checkpoint and export. Returns a summary dict."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    if cfg.drafter is None or cfg.drafter.kind not in OBJECTIVES:
        raise ConfigError(
            f"unknown drafter kind {getattr(cfg.drafter, 'kind', None)!r}; "
            f"known: {sorted(OBJECTIVES)}"
        )
    tc = cfg.trainer
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved_config(cfg, run_dir / "training_args.yaml")
    ckpt_root = run_dir / "checkpoints"
    resume_from = latest_checkpoint(ckpt_root) if cfg.resume else None

    mp = tc.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() else "no"
    accelerator = Accelerator(mixed_precision=mp, cpu=not torch.cuda.is_available())
    device = accelerator.device
    torch.manual_seed(cfg.seed)

    tokenizer = load_tokenizer(cfg.target.name_or_path)
    target = FrozenTarget(cfg.target, device, cfg.drafter.aux_layer_ids or None)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else run_dir / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    data, d2t, t2d = prepare_data(cfg, tokenizer, target.vocab_size, cache_dir)

    kind = cfg.drafter.kind
    arch = OBJECTIVES[kind].arch_from_target(cfg.drafter, target, tokenizer)
    drafter = DRAFTERS[kind](arch)
    init_from_target(drafter, target, d2t, t2d)
    drafter.to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stream = BatchStream(data, cfg.data.batch_size, pad_id, cfg.seed)

    start_step = 0
    if resume_from is not None:
        ck = load_checkpoint(resume_from)
        if ck["state"].get("drafter_config") != arch.to_dict():
            raise ConfigError(
                f"cannot resume from {resume_from}: its drafter architecture "
                "differs from this config"
            )
        drafter.load_state_dict(ck["drafter"], strict=False)
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["state"]["scheduler"])
        stream.restore(ck["state"]["data"])
        restore_rng(ck["rng"])
        start_step = ck["state"]["step"]
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    model = accelerator.unwrap_model(drafter)
    backend = pick_backend(cfg.drafter.attention_backend, device)
    objective = OBJECTIVES[kind](model, cfg.drafter, backend)
    logger = MetricLogger(cfg.logger, run_dir, config_to_dict(cfg), resume=resume_from is not None)

    def checkpoint(step: int) -> None:
        save_checkpoint(
            ckpt_root,
            step,
            model.trainable_state_dict(),
            optimizer,
            {
                "scheduler": scheduler.state_dict(),
                "data": stream.state(),
                "drafter_kind": kind,
                "drafter_config": arch.to_dict(),
                "objective": objective.checkpoint_meta(),
            },
            keep_last=tc.keep_last,
        )

    bar = tqdm(
        total=tc.max_steps,
        initial=start_step,
        disable=not tc.progress,
        desc=f"train {kind}",
        unit="step",
        dynamic_ncols=True,
    )
    window: dict[str, float] = {}
    n_window, tok_window, t_window = 0, 0.0, time.perf_counter()
    first_loss = last_loss = None
    for step in range(start_step, tc.max_steps):
        drafter.train()
        step_metrics: dict[str, float] = {}
        for _ in range(tc.grad_accum):
            batch = {k: v.to(device) for k, v in stream.next().items()}
            tgt = target(batch["input_ids"], batch["attention_mask"])
            with accelerator.autocast():
                loss, m = objective(batch, tgt)
            accelerator.backward(loss / tc.grad_accum)
            m["loss"] = loss.item()
            for k, v in m.items():
                step_metrics[k] = step_metrics.get(k, 0.0) + v / tc.grad_accum
        if tc.grad_clip > 0:
            accelerator.clip_grad_norm_(params, tc.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if first_loss is None:
            first_loss = step_metrics["loss"]
        last_loss = step_metrics["loss"]
        for k, v in step_metrics.items():
            window[k] = window.get(k, 0.0) + v
        n_window += 1
        tok_window += step_metrics["tokens"] * tc.grad_accum
        done = step + 1
        if done % tc.log_every == 0 or done == tc.max_steps:
            dt = time.perf_counter() - t_window
            avg = {k: v / n_window for k, v in window.items() if k != "tokens"}
            avg["lr"] = scheduler.get_last_lr()[0]
            avg["tokens_per_s"] = tok_window / max(dt, 1e-9)
            logger.log(avg, done)
            bar.set_postfix(
                loss=f"{avg['loss']:.3f}",
                acc0=f"{avg.get('acc_0', 0):.2f}",
                sim_al=f"{avg['sim_al']:.2f}",
                tok_s=f"{avg['tokens_per_s']:.0f}",
            )
            window, n_window, tok_window, t_window = {}, 0, 0.0, time.perf_counter()
        bar.update(1)
        if tc.save_every > 0 and done % tc.save_every == 0 and done != tc.max_steps:
            checkpoint(done)
    bar.close()
    if start_step < tc.max_steps or latest_checkpoint(ckpt_root) is None:
        checkpoint(tc.max_steps)
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "steps": tc.max_steps,
        "first_loss": first_loss,
        "last_loss": last_loss,
    }
    if cfg.data.eval_split:
        ev = evaluate(cfg, objective, target, tokenizer, device, pad_id)
        logger.log(ev, tc.max_steps)
        (run_dir / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")
        summary.update(ev)
    logger.finish()
    save_training_plot(run_dir)
    if cfg.export.enabled:
        from drafttrain.export import export_run

        export_dir = export_run(run_dir)
        summary["export_dir"] = str(export_dir)
        if cfg.export.verify:
            del target, objective, drafter, model, optimizer  # free memory for the runner
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            summary["runner"] = verify_export(cfg, run_dir, export_dir)
    return summary


def verify_export(cfg: TrainConfig, run_dir: Path, export_dir: Path) -> dict[str, Any]:
    """Run `draftinfer` on the exported files (read back from disk) over held-out prompts;
    write `runner_report.json` + `acceptance.png` into the export and the table into its card."""
    from draftinfer.config import InferConfig
    from draftinfer.run import format_report, run_eval
    from drafttrain.export import write_model_card

    e = cfg.export
    icfg = InferConfig(
        drafter=str(export_dir),
        target=cfg.target.name_or_path,
        prompts=cfg.data.path,
        prompts_split=cfg.data.eval_split or cfg.data.split,
        num_prompts=e.verify_prompts,
        k=e.verify_k,
        max_new_tokens=e.verify_max_new_tokens,
        batch_size=e.verify_batch_size,
        max_model_len=min(2048, cfg.data.max_length + e.verify_max_new_tokens + 8),
        report=str(export_dir / "runner_report.json"),
        progress=cfg.trainer.progress,
    )
    report = run_eval(icfg)
    (export_dir / "runner_report.png").replace(export_dir / "acceptance.png")
    write_model_card(run_dir, export_dir)
    print(format_report(report))
    return report
