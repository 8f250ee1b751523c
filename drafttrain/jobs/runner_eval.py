"""The runner's real acceptance length during training (`eval.every_n_steps`).

The AL a training run shows (`sim_al`, `drafttrain.objectives.losses`) is *simulated*: per-position top-1
agreement with the target on the data's own responses, multiplied out as if positions were
independent. What an engine sees is the target's own continuation, drafted round by round
with the drafter's KV built from target features. `RunnerEval` measures the latter in-process
every N steps, on one machine, with no second engine:

1. *export in memory*: the drafter's own state (what a checkpoint stores) goes into a fresh
   module of its kind and through `draftinfer.files.checkpoint.snapshot_drafter`, the exporter's and
   the loader's own functions minus the file I/O (config JSON round trip, serving tensors cast
   to `export.dtype`, renamed, validated, shared target weights attached). So the runner
   decodes with exactly the weights `python -m drafttrain.export` would write at that step
   (`tests/train/test_train_eval.py` checks the snapshot against a real export + load, per
   kind);
2. the native target (loaded once, on the training device) decodes held-out prompts (the
   data's eval split, or an acceptance suite) plainly once, and speculatively with each
   snapshot (`draftinfer.evaluation.suite_decode.decode_batch`: greedy, lossless-checked);
3. `runner_al` (micro AL: mean over rounds), `runner_al_macro`, `runner_pos_j`, `runner_lossless`,
   the simulated AL of the same K from the latest training window (`runner_sim_al`) and
   their gap go to `metrics.jsonl`, wandb and the progress bar.

`final_gap` puts the last runner AL beside the held-out simulated AL at the same K for the
job summary and the model card.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from drafttrain.jobs.config import TrainConfig
from drafttrain.jobs.errors import ConfigError
from drafttrain.trainer.loop import LoopHook

RUNNER_EVAL_FILE = "runner_eval.json"


def verify_config(cfg: TrainConfig, export_dir: str | Path, k: int | None = None, **over):
    """The `draftinfer` config of the job's runner check (`drafttrain.jobs.job.verify`) of the
    drafter in `export_dir` at `k` drafts a round (default `export.verify_k`): the held-out
    prompts (`data.eval_split` of `data.eval_path`, default `data.path`), `export.verify_*`
    counts; `over` replaces fields (report, plot, ...)."""
    from draftinfer.evaluation.config import InferConfig

    e = cfg.export
    fields = dict(
        drafter=str(export_dir),
        target=cfg.target.name_or_path,
        prompts=cfg.data.eval_path or cfg.data.path,
        prompts_split=cfg.data.eval_split or cfg.data.split,
        num_prompts=e.verify_prompts,
        k=e.verify_k if k is None else k,
        max_new_tokens=e.verify_max_new_tokens,
        batch_size=e.verify_batch_size,
        max_model_len=min(2048, cfg.data.max_length + e.verify_max_new_tokens + 8),
        progress=cfg.trainer.progress,
    )
    return InferConfig(**{**fields, **over})


def runner_drafter(kind: str, arch: Any, own: dict, target, target_name: str, dtype, export_dtype):
    """Export in memory: the exporter's steps (`drafttrain.export.directory.export_run`) on a
    drafter's own state `own` (what a checkpoint stores; architecture `arch`), loaded as the
    runner loads an export, on the native `target`'s device in `dtype` (module docstring, 1).
    Shared by the runner's AL during training and on-policy rollouts (`drafttrain.jobs.rollouts`)."""
    from draftinfer.files.checkpoint import snapshot_drafter
    from draftinfer.registry import drafter_spec

    spec = drafter_spec(kind)
    module = spec.build(spec.config_class(**arch.to_dict()))
    module.load_own_state({k: v.detach().to("cpu") for k, v in own.items()})
    # As `drafttrain.export.directory.export_run` does: the weights shared with the target attached
    # before the serving tensors are taken (a layout may store copies of them).
    spec.attach_shared(module, target.shared_weights())
    device = next(target.parameters()).device
    return snapshot_drafter(
        module, {"target": target_name}, target.shared_weights(), device, dtype, export_dtype
    )


def simulated_acceptance(accs: list[float], k: int) -> tuple[float, list[float]]:
    """(AL, per-position acceptance) of greedy drafting at `k` drafts from per-position top-1
    accuracies `accs` (position 1 first), positions independent: pos j = prod_{s<=j} acc_s and
    AL = 1 + sum_{j<=k} pos j. `drafttrain.objectives.losses.DraftLoss` computes the same over all of
    its positions (`sim_al`); here it is cut at the runner's K to compare like with like."""
    pos, surv = [], 1.0
    for a in accs[:k]:
        surv *= a
        pos.append(surv)
    return 1.0 + sum(pos), pos


def position_accuracies(metrics: dict[str, float], prefix: str = "acc_") -> list[float]:
    """`acc_0, acc_1, ...` (or `eval_acc_*`) of a metrics row, in position order."""
    keys = [k for k in metrics if k.startswith(prefix) and k[len(prefix) :].isdigit()]
    return [metrics[k] for k in sorted(keys, key=lambda k: int(k[len(prefix) :]))]


class RunnerEval:
    """The runner's AL during training: `hook(...)` is the training loop's periodic callback
    (`drafttrain.trainer.loop.LoopHook`), every `eval.every_n_steps` steps (and at the last), on every
    rank. Construction
    checks the settings (every rank) and reads and renders the prompts (main process), so bad
    input fails before training starts; the native target loads at the first measurement.
    `RunnerEval.for_run` gives None when `eval.every_n_steps` is 0 (off)."""

    @classmethod
    def for_run(cls, cfg: TrainConfig, device: torch.device, accelerator) -> RunnerEval | None:
        return cls(cfg, device, accelerator) if cfg.eval.every_n_steps else None

    def __init__(self, cfg: TrainConfig, device: torch.device, accelerator=None):
        from draftinfer.evaluation.chat import data_base_dir
        from draftinfer.evaluation.suite_decode import PromptRenderer
        from draftinfer.evaluation.suites import SuiteConfig, load_suite, suite_rows, suite_source
        from draftinfer.files.paths import resolve_path
        from draftinfer.registry import family_of

        e = cfg.eval
        self.every = e.every_n_steps
        self.k = e.k if e.k is not None else cfg.export.verify_k
        for name, v in (
            ("every_n_steps", e.every_n_steps),
            ("num_prompts", e.num_prompts),
            ("max_new_tokens", e.max_new_tokens),
            ("k", self.k),
            ("batch_size", e.batch_size),
        ):
            if v < 1:
                raise ConfigError(f"eval.{name} must be >= 1, got {v}")
        if not e.temperature >= 0.0:
            raise ConfigError(f"eval.temperature must be >= 0, got {e.temperature}")
        self.cfg, self.device, self.accelerator = cfg, device, accelerator
        self.main = accelerator is None or accelerator.is_main_process
        dt = getattr(torch, cfg.export.dtype, None)
        if cfg.export.dtype not in ("bfloat16", "float16", "float32") or dt is None:
            raise ConfigError(f"export.dtype must be bfloat16, float16 or float32, got {dt}")
        self.export_dtype = dt
        if e.suite:
            suite = load_suite(e.suite)
            suite.num_prompts, suite.max_new_tokens = e.num_prompts, e.max_new_tokens
            source = suite_source(suite, e.path, 1)
        else:  # the prompts the job's verification reads (`drafttrain.jobs.job.verify`)
            d = cfg.data
            source = d.eval_path or d.path
            suite = SuiteConfig(
                name="heldout",
                dataset=source,
                config=None if d.eval_path else d.name,
                split=d.eval_split or d.split,
                messages=d.messages_field,
                num_prompts=e.num_prompts,
                max_new_tokens=e.max_new_tokens,
            )
        self.suite = suite
        self.target_path = resolve_path(cfg.target.name_or_path)
        family = family_of(self.target_path)
        if suite.image and not family.takes_images:
            raise ConfigError(
                f"eval.suite={suite.name!r} has image prompts; the target takes text only"
            )
        # The cache length the job's verification uses (`drafttrain.jobs.job.verify`).
        self.max_model_len = min(2048, cfg.data.max_length + e.max_new_tokens + 8)
        self.prompts: list = []
        self.tokenizer = None
        if self.main:  # only the main process decodes
            rows = suite_rows(suite, source)
            renderer = PromptRenderer(family, self.target_path, self.max_model_len)
            base = data_base_dir(source)
            kw = {"enable_thinking": suite.enable_thinking}
            rendered = [
                (r.row, renderer.render(r.conversation([]), f"eval row {r.row}", kw, base))
                for r in rows
            ]
            self.prompts = [(row, p) for row, p in rendered if p is not None]
            if not self.prompts:
                raise ConfigError(
                    f"eval: no prompt of {source!r} fits max_model_len={self.max_model_len}"
                )
            self.tokenizer = renderer.tokenizer
        self.target = None
        self.plain: dict[int, list[list[int]]] = {}  # batch start -> plain outputs (cached)
        self.seconds = 0.0
        self.calls = 0
        self.last: dict[str, float] = {}

    def hook(self, kind: str, arch: Any, own_state: Callable[[], dict[str, torch.Tensor]]):
        """This evaluation as the training loop's periodic callback (`drafttrain.trainer.loop.LoopHook`):
        when due, the drafter's own state (`own_state()`, collective under sharding: every rank
        calls it) is measured by the main process; the loop logs the metrics (metrics.jsonl and
        wandb), shows `run_al` beside `sim_al` and keeps the time out of its tokens/s."""
        return _RunnerEvalHook(self, kind, arch, own_state)

    def finish(self, summary: dict[str, Any], run_dir: Path, loop_seconds: float) -> dict:
        """`{"runner_eval": ...}` for the job summary (also `<run_dir>/runner_eval.json`,
        which the model card reads); `summary`: the training summary so far (its held-out
        `eval_acc_*`). Empty on other ranks or when nothing was measured."""
        if not (self.main and self.calls):
            return {}
        out = self.summary(summary, loop_seconds)
        write_runner_eval(run_dir, out)
        return {"runner_eval": out}

    def _load_target(self):
        from draftinfer.evaluation.run import pick_dtype
        from draftinfer.files.loading import load_native_target

        self.dtype = pick_dtype("auto", self.device)  # fp32 on CPU (exact), bf16 on CUDA
        self.target = load_native_target(
            self.target_path,
            self.device,
            self.dtype,
            max_batch=self.cfg.eval.batch_size,
            max_seq_len=self.max_model_len,
        )

    @torch.no_grad()
    def __call__(
        self,
        step: int,
        kind: str,
        arch: Any,
        own: dict[str, torch.Tensor],
        window: dict[str, float],
    ) -> dict[str, float]:
        """Runner metrics at `step` of the `kind` drafter whose own state is `own` (what a
        checkpoint stores; architecture `arch`); `window`: the latest training log row (for
        the simulated AL)."""
        # Building a module draws its random init: keep training's random streams untouched.
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            return self._call(step, kind, arch, own, window)

    def _call(self, step, kind, arch, own, window) -> dict[str, float]:
        from draftinfer.conventions.metrics import (
            acceptance_length,
            macro_acceptance_length,
            per_position_acceptance,
        )
        from draftinfer.decoding.engine import SpecDecoder
        from draftinfer.evaluation.suite_decode import Decoding, decode_batch
        from draftinfer.registry import drafter_spec

        t0 = time.perf_counter()
        if self.target is None:
            self._load_target()
        drafter = runner_drafter(
            kind, arch, own, self.target, self.cfg.target.name_or_path, self.dtype,
            self.export_dtype,
        )  # fmt: skip
        drafter_spec(kind).check_k(drafter.config, self.k)
        e = self.cfg.eval
        decoder = SpecDecoder(
            self.target,
            drafter,
            self.k,
            max_batch=e.batch_size,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
        )
        d = Decoding(
            self.target,
            drafter,
            decoder,
            self.tokenizer,
            self.k,
            "onehot",
            0,
            1.0,
            self.max_model_len,
            check_sampled=False,
            eos=tuple(self.target.config.eos_token_ids),
        )
        records = []
        for i in range(0, len(self.prompts), e.batch_size):
            batch = self.prompts[i : i + e.batch_size]
            recs, plain, _, _ = decode_batch(
                d,
                [p for _, p in batch],
                [(row, 0) for row, _ in batch],
                e.temperature,
                e.max_new_tokens,
                [self.cfg.seed + row for row, _ in batch],
                self.plain.get(i) if e.temperature == 0.0 else None,
            )
            self.plain[i] = plain
            records += recs
        accepted = [a for r in records for a in r.accepted]
        proposed = [p for r in records for p in r.proposed]
        pos = per_position_acceptance(accepted, proposed, self.k)
        out = {
            "runner_al": acceptance_length(accepted),
            "runner_al_macro": macro_acceptance_length([r.accepted for r in records]),
            **{f"runner_pos_{j + 1}": v for j, v in enumerate(pos)},
        }
        if e.temperature == 0.0:
            out["runner_lossless"] = float(all(r.lossless for r in records))
        accs = position_accuracies(window)
        if len(accs) >= self.k:
            out["runner_sim_al"] = simulated_acceptance(accs, self.k)[0]
            out["runner_al_gap"] = out["runner_sim_al"] - out["runner_al"]
        self.calls += 1
        out["runner_seconds"] = time.perf_counter() - t0
        self.seconds += out["runner_seconds"]
        self.last = {"step": step, **out}
        return out

    def summary(self, held_out: dict[str, float], loop_seconds: float) -> dict[str, Any]:
        """The run's runner evaluation for the job summary and the card: its time share and
        how far the simulated AL at the runner's K (`sim_al`: from the held-out split's
        `eval_acc_*` when the run has one, else the last training window's) was from the
        runner's AL at the end (`gap` = simulated - runner)."""
        out: dict[str, Any] = {
            "k": self.k,
            "prompts": len(self.prompts),
            "source": self.suite.dataset if self.suite.name == "heldout" else self.suite.name,
            "calls": self.calls,
            "seconds": self.seconds,
            "loop_seconds": loop_seconds,
            "share": self.seconds / loop_seconds if loop_seconds > 0 else float("nan"),
            "last": self.last,
        }
        accs = position_accuracies(held_out, "eval_acc_")
        if self.last and len(accs) >= self.k:
            out["sim_al"] = simulated_acceptance(accs, self.k)[0]
            out["sim_source"] = "held-out split"
        elif "runner_sim_al" in self.last:
            out["sim_al"] = self.last["runner_sim_al"]
            out["sim_source"] = "last training window"
        if "sim_al" in out:
            out["gap"] = out["sim_al"] - self.last["runner_al"]
        return out


def write_runner_eval(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / RUNNER_EVAL_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def read_runner_eval(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / RUNNER_EVAL_FILE
    return json.loads(path.read_text()) if path.is_file() else None


class _RunnerEvalHook(LoopHook):
    def __init__(self, runner: RunnerEval, kind: str, arch: Any, own_state) -> None:
        self.runner, self.kind, self.arch, self.own_state = runner, kind, arch, own_state
        self.every_n_steps = runner.every

    def __call__(self, step: int, last_log: dict[str, float]) -> dict[str, float]:
        own = self.own_state()
        r = self.runner
        metrics = r(step, self.kind, self.arch, own, last_log) if r.main else {}
        if r.accelerator is not None:
            r.accelerator.wait_for_everyone()
        return metrics

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"run_al": f"{metrics['runner_al']:.2f}"}
