"""The model card (`README.md`) of an export: one definition, used for the export directory and
for the Hub upload (`drafttrain.export.hub`), which only changes where the drafter is said to live.

Front matter (huggingface_hub's `ModelCardData`): `base_model` (the target's hub id,
`export.hub_base_model` when the target is a local directory), `library_name: vllm` (the
export is vLLM's layout), `pipeline_tag` (`text-generation`, or `image-text-to-text` for a
target with a vision tower), `tags` (`speculative-decoding`, the drafter kind, `drafttrain`).
Body: the exact launch commands (the kind's `DrafterSpec.serving_hint`) and the target family's
serving facts (`TrainFamily.card_notes`, e.g. what vLLM reads for a Qwen3-VL drafter), the
training metrics,
the runner's acceptance-length table by K and its per-position acceptance plot when the export
has them, how far simulated and real AL were apart at the end when the run measured the
runner's AL during training (`eval.every_n_steps`), the "Acceptance by benchmark" section
when `python -m draftinfer eval=...` ran on the export, and the training config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from draftinfer.evaluation.report import RunReport
from draftinfer.evaluation.suite_report import PLOT_NAME as SUITES_PLOT
from draftinfer.evaluation.suite_report import (
    SUITES_DIR,
    SuitesReport,
    card_section,
    read_suites_report,
)
from draftinfer.files.checkpoint import atomic_write_text, read_drafter_config
from draftinfer.files.paths import resolve_path
from drafttrain.frozen.target import is_hub_id, load_target_config
from drafttrain.jobs.config import load_train_config
from drafttrain.jobs.runner_eval import read_runner_eval
from drafttrain.registry import family_for
from drafttrain.trainer.loggers import read_metrics

# The runner's report for `export.verify_k` and its plot; extra K values write
# `runner_report_k{K}.json` (`drafttrain.jobs.job.verify`).
RUNNER_REPORT = "runner_report.json"
RUNNER_PLOT = "acceptance.png"


def runner_reports(export_dir: Path) -> list[RunReport]:
    """The runner's reports in `export_dir`, one per measured K, sorted by K."""
    paths = [export_dir / RUNNER_REPORT, *sorted(export_dir.glob("runner_report_k*.json"))]
    reports = [RunReport.read(p) for p in paths if p.is_file()]
    return sorted(reports, key=lambda r: r.k)


def _al_table(reports: list[RunReport]) -> list[str]:
    r0 = reports[0]
    width = max(len(r.per_position_acceptance) for r in reports)
    lines = [
        "## Acceptance measured by the runner",
        "",
        f"`python -m draftinfer` loaded this directory from disk and decoded "
        f"{r0.num_prompts} held-out prompts against `{r0.target}` "
        f"({r0.device}, {r0.dtype}, temperature {r0.temperature}). Acceptance length "
        "(AL) = mean accepted drafts + 1 per round; position j = P(drafts 1..j all accepted).",
        "",
        "| K | AL | " + " | ".join(f"pos {j + 1}" for j in range(width)) + " | lossless |",
        "|---|---|" + "---|" * width + "---|",
    ]
    for r in reports:
        pos = [f"{v:.3f}" for v in r.per_position_acceptance]
        pos += [""] * (width - len(pos))
        lines.append(
            f"| {r.k} | {r.acceptance_length:.3f} | " + " | ".join(pos) + f" | {r.lossless} |"
        )
    return lines


def card_text(
    cfg: dict[str, Any],
    kind: str,
    front: dict[str, Any],
    serving: str,
    metrics: list[dict[str, float]],
    has_plot: bool,
    evaluation: dict[str, float] | None = None,
    reports: list[RunReport] | None = None,
    has_acceptance_plot: bool = False,
    notes: list[str] | None = None,
    runner_eval: dict[str, Any] | None = None,
    suites: SuitesReport | None = None,
) -> str:
    """The card's markdown: `front` (card data) as YAML front matter, then the body.
    `notes`: the target family's serving facts (`TrainFamily.card_notes`), one bullet each.
    `runner_eval`: the runner's AL during training (`drafttrain.jobs.runner_eval`); `suites`: the
    acceptance suites' report (`python -m draftinfer eval=...`, `draftinfer.evaluation.suite_report`)."""
    from huggingface_hub import ModelCardData

    target = cfg["target"]["name_or_path"]
    lines = [
        "---",
        ModelCardData(**front).to_yaml(),
        "---",
        "",
        f"# {kind} drafter for `{front.get('base_model') or target}`",
        "",
        f"Trained with `python -m drafttrain conf={cfg.get('preset') or '<preset>'}` "
        f"for {cfg['trainer']['max_steps']} optimizer steps against `{target}`.",
        "",
        "## Serving",
        "",
        serving,
        "",
    ]
    if notes:
        lines += [*(f"- {n}" for n in notes), ""]
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
                f"Held-out split `{cfg['data'].get('eval_split')}`"
                + (f" of `{cfg['data']['eval_path']}`" if cfg["data"].get("eval_path") else "")
                + ": per-step top-1 accuracy "
                + ", ".join(f"{evaluation[a]:.3f}" for a in accs)
                + f"; simulated acceptance length {evaluation['eval_sim_al']:.3f}.",
                "",
            ]
        if runner_eval and "gap" in runner_eval:
            r = runner_eval
            lines += [
                f"Simulated vs real AL at the end: the simulated AL at K={r['k']} "
                f"(per-position accuracy of the {r['sim_source']}, multiplied out) was "
                f"{r['sim_al']:.3f}; the "
                f"runner during training (an in-memory export decoding {r['prompts']} "
                f"held-out prompts at step {r['last']['step']}) measured "
                f"{r['last']['runner_al']:.3f}, {r['gap']:+.3f} apart. Measuring it every "
                f"`eval.every_n_steps` cost {100 * r['share']:.1f}% of the training loop's "
                "time.",
                "",
            ]
        if has_plot:
            lines += ["![training curves](training_curves.png)", ""]
    if reports:
        lines += _al_table(reports) + [""]
        if has_acceptance_plot:
            lines += [f"![per-position acceptance]({RUNNER_PLOT})", ""]
    else:
        lines += [
            "Acceptance length measured by the runner: run `python -m draftinfer "
            "drafter=<this dir>`.",
            "",
        ]
    if suites is not None:
        lines += card_section(suites, f"{SUITES_DIR}/{SUITES_PLOT}") + [""]
    lines += [
        "## Training config",
        "",
        "```yaml",
        yaml.safe_dump(cfg, sort_keys=False).strip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def write_model_card(
    run: Path,
    out: Path,
    dest: Path | None = None,
    drafter_ref: str | None = None,
    base_model: str | None = None,
) -> Path:
    """Write the card of export `out` (of run `run`) to `dest/README.md` (default `out`).

    `drafter_ref` is where the launch commands load the drafter from: the Hub repo id for an
    upload, the export directory otherwise. `base_model` defaults to `export.hub_base_model`,
    else `target.name_or_path`; the commands name the target by it when it is a hub id, else
    by the target's local path."""
    run, out = Path(run), Path(out)
    raw = yaml.safe_load((run / "training_args.yaml").read_text())
    cfg = load_train_config(run / "training_args.yaml")
    spec, arch, meta = read_drafter_config(out)
    target = cfg.target.name_or_path
    base = base_model or cfg.export.hub_base_model or target
    target_ref = base if is_hub_id(base) else resolve_path(target)
    target_config = load_target_config(target)
    family = family_for(list(getattr(target_config, "architectures", None) or []))
    front = {
        "base_model": base,
        "library_name": "vllm",
        "pipeline_tag": family.pipeline_tag,
        "tags": ["speculative-decoding", spec.name, "drafttrain"],
    }
    serving = spec.serving_hint(
        arch, int(meta["serving_k"]), target_ref, drafter_ref or str(out.resolve())
    )
    ev_path = run / "eval.json"
    text = card_text(
        raw,
        spec.name,
        front,
        serving,
        read_metrics(run),
        (out / "training_curves.png").is_file(),
        json.loads(ev_path.read_text()) if ev_path.is_file() else None,
        runner_reports(out),
        (out / RUNNER_PLOT).is_file(),
        family.card_notes(spec, arch),
        read_runner_eval(run),
        read_suites_report(out / SUITES_DIR),
    )
    dest = Path(dest) if dest is not None else out
    atomic_write_text(dest / "README.md", text)
    return dest / "README.md"
