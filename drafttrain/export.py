"""Export a training run as a drafter checkpoint directory (DESIGN section 4).

    python -m drafttrain.export RUN_DIR [--out DIR] [--checkpoint step_000200] [--dtype bfloat16]

Writes `config.json` (the kind's serving layout, e.g. vLLM/SGLang `LlamaForCausalLMEagle3`;
our conventions under `"drafttrain"`), `model.safetensors`, `config.speculators.json` (when
the kind has a vllm-project/speculators format), the target's tokenizer files,
`training_args.yaml` and a `README.md` model card. The run's config is read back through the
typed schema and the tensors come from the run's checkpoint on disk, so the export is exactly
what training saved. Nothing here names a drafter kind (`draftinfer.registry`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from draftinfer.checkfields import require
from draftinfer.checkpoint import atomic_write_text, read_drafter_config, write_drafter
from draftinfer.registry import drafter_spec
from drafttrain.checkpoint import latest_checkpoint, load_checkpoint
from drafttrain.config import load_train_config
from drafttrain.errors import CheckpointError, DraftError
from drafttrain.loggers import read_metrics
from drafttrain.target import load_tokenizer

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_card(
    cfg: dict[str, Any],
    kind: str,
    serving: str,
    metrics: list[dict[str, float]],
    has_plot: bool,
    evaluation: dict[str, float] | None = None,
    runner: dict[str, Any] | None = None,
) -> str:
    target = cfg["target"]["name_or_path"]
    front = {
        "base_model": target,
        "library_name": "drafttrain",
        "tags": ["speculative-decoding", "drafter", kind],
    }
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {kind} drafter for `{target}`",
        "",
        f"Trained with `python -m drafttrain conf={cfg.get('preset') or '<preset>'}` "
        f"for {cfg['trainer']['max_steps']} optimizer steps.",
        "",
        "## Serving",
        "",
        serving,
        "",
    ]
    if metrics:
        last = metrics[-1]
        accs = sorted((k for k in last if k.startswith("acc_")), key=lambda k: int(k[4:]))
        lines += [
            "## Training metrics (last logging window)",
            "",
            "| draft | " + " | ".join(a[4:] for a in accs) + " |",
            "|---|" + "---|" * len(accs),
            "| top-1 acc | " + " | ".join(f"{last[a]:.3f}" for a in accs) + " |",
            "",
            f"Simulated acceptance length: {last.get('sim_al', float('nan')):.3f}; "
            f"final loss {last.get('loss', float('nan')):.4f}.",
            "",
        ]
        if evaluation:
            accs = sorted(
                (k for k in evaluation if k.startswith("eval_acc_")),
                key=lambda k: int(k.rsplit("_", 1)[1]),
            )
            lines += [
                f"Held-out split `{cfg['data'].get('eval_split')}`: per-step top-1 accuracy "
                + ", ".join(f"{evaluation[a]:.3f}" for a in accs)
                + f"; simulated acceptance length {evaluation['eval_sim_al']:.3f}.",
                "",
            ]
        if has_plot:
            lines += ["![training curves](training_curves.png)", ""]
    if runner:
        pos = runner["per_position_acceptance"]
        lines += [
            "## Acceptance measured by the runner",
            "",
            f"`python -m draftinfer` loaded this directory from disk and decoded "
            f"{runner['num_prompts']} held-out prompts against `{runner['target']}` "
            f"({runner['device']}, {runner['dtype']}, temperature {runner['temperature']}).",
            "",
            "| k | acceptance length | "
            + " | ".join(f"pos {j + 1}" for j in range(len(pos)))
            + " | lossless |",
            "|---|---|" + "---|" * len(pos) + "---|",
            f"| {runner['k']} | {runner['acceptance_length']:.3f} | "
            + " | ".join(f"{v:.3f}" for v in pos)
            + f" | {runner['lossless']} |",
            "",
            "![per-position acceptance](acceptance.png)",
            "",
        ]
    else:
        lines += [
            "Acceptance length measured by the runner: run `python -m draftinfer "
            "drafter=<this dir>`.",
            "",
        ]
    lines += [
        "## Training config",
        "",
        "```yaml",
        yaml.safe_dump(cfg, sort_keys=False).strip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def export_run(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    checkpoint: str | None = None,
    dtype: str | None = None,
    card: bool = True,
) -> Path:
    """Write the export of `run_dir`'s checkpoint (default: the latest). `card=False` leaves
    the model card to the caller (the job writes it once, after verification)."""
    run = Path(run_dir)
    cfg = load_train_config(run / "training_args.yaml")
    ckpt = (
        (run / "checkpoints" / checkpoint) if checkpoint else latest_checkpoint(run / "checkpoints")
    )
    if ckpt is None or not ckpt.is_dir():
        raise CheckpointError(f"no checkpoint to export under {run / 'checkpoints'}")
    dtype_name = dtype or cfg.export.dtype
    if dtype_name not in _DTYPES:
        raise DraftError(f"export dtype must be one of {sorted(_DTYPES)}, got {dtype_name!r}")
    ck = load_checkpoint(ckpt)
    state = ck["state"]
    where = str(ckpt / "state.json")
    spec = drafter_spec(require(state, "drafter_kind", where))
    arch = spec.config_class(**require(state, "drafter_config", where))
    drafter = spec.build(arch)
    drafter.load_own_state(ck["drafter"])
    objective_meta = require(state, "objective", where)
    serving_k = int(require(objective_meta, "serving_k", where))

    out = Path(out_dir) if out_dir else run / "export"
    out.mkdir(parents=True, exist_ok=True)
    target_name = cfg.target.name_or_path
    meta = {
        "target": target_name,
        "trained_steps": state["step"],
        "preset": cfg.preset,
        **objective_meta,
    }
    write_drafter(out, drafter, meta, _DTYPES[dtype_name])
    spec_cfg = spec.speculators_config(arch, target_name, serving_k)
    if cfg.export.speculators_config and spec_cfg is not None:
        atomic_write_text(out / "config.speculators.json", json.dumps(spec_cfg, indent=2) + "\n")
    load_tokenizer(target_name).save_pretrained(str(out))
    shutil.copyfile(run / "training_args.yaml", out / "training_args.yaml")
    plot = run / "training_curves.png"
    if plot.is_file():
        shutil.copyfile(plot, out / "training_curves.png")
    if card:
        write_model_card(run, out)
    return out


def write_model_card(run: Path, out: Path) -> None:
    """Write `out/README.md` from the run's config, metrics, held-out evaluation and, when
    present, the runner's report `out/runner_report.json`."""
    cfg = yaml.safe_load((run / "training_args.yaml").read_text())
    spec, arch, meta = read_drafter_config(out)
    ev_path, rep_path = run / "eval.json", out / "runner_report.json"
    evaluation = json.loads(ev_path.read_text()) if ev_path.is_file() else None
    runner = json.loads(rep_path.read_text()) if rep_path.is_file() else None
    serving = spec.serving_hint(arch, int(meta["serving_k"]))
    card = model_card(
        cfg,
        spec.name,
        serving,
        read_metrics(run),
        (out / "training_curves.png").is_file(),
        evaluation,
        runner,
    )
    atomic_write_text(out / "README.md", card)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m drafttrain.export", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="export directory (default RUN_DIR/export)")
    p.add_argument("--checkpoint", default=None, help="checkpoint name (default: latest)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES))
    a = p.parse_args(argv)
    try:
        out = export_run(a.run_dir, a.out, a.checkpoint, a.dtype)
    except DraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
