"""The comparison users ask for on a target that ships its own MTP layer (issue 48, items 4
and 3): at K drafts a round, the same held-out prompts, greedy and lossless,

- (a) `native`: the target's released MTP layer reused K times (`drafter=native`, no training);
- (b) `mtp`: N distinct MTP modules trained here (the `mtp` preset, module 0 from the released
  layer);
- (c) `eagle3` and `dflash`: an EAGLE-3 head and a DFlash block drafter trained with the same
  steps;

each trained drafter once per seed (`seed=S`: initialisation and data order) by its preset's
own job (train, export, the runner's check on the exported files at K, `export.verify_*`), and
the released layer through the same check's settings (`verify_config`: same prompts, lengths,
batch). A run directory that already holds a finished run of the identical config (e.g. the
preset run by its own command with `output_dir=<work>/mtp_s0`) is read, not retrained.

    python -m draftbench.mtp_compare --seeds 0 1 --steps 200 \
        --out docs/results/<date>_cpu_mtp_compare_deepseek.json
    python -m draftbench.mtp_compare --family glm4_moe --seeds 0 1 --steps 200 \
        --out docs/results/<date>_cpu_mtp_compare_glm.json

`--family` picks the target and each drafter's preset (`COMPARISONS`): `deepseek_v3` on
`zoo:deepseek-tiny` (the default), `glm4_moe` on `zoo:glm-tiny`.

Writes the JSON (every run's AL, per-position acceptance, lossless flag, job seconds) and prints
a markdown table: per drafter the AL per seed, the mean and the spread (max - min); whether (b)
beats (a) beyond the spread is `min over seeds of (b) > (a)` (the native layer is
deterministic: one run).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Comparison:
    """One target's comparison: its target config (`conf/drafttrain/target/<target>.yaml`), each
    drafter's preset and extra overrides, and the default work directory."""

    target: str
    drafters: dict[str, tuple[str, list[str]]]
    work: str


# The dflash drafter is `conf=dflash` pointed at the target, sized as the MoE presets'
# (dflash_gpt_oss: intermediate 512). GLM has no EAGLE-3 preset of its own: `conf=eagle3`
# pointed at it with eagle3_deepseek's settings (intermediate 512, 20 warmup steps).
COMPARISONS = {
    "deepseek_v3": Comparison(
        "zoo_deepseek",
        {
            "mtp": ("mtp_deepseek", []),
            "eagle3": ("eagle3_deepseek", []),
            "dflash": ("dflash", ["target=zoo_deepseek", "drafter.intermediate_size=512"]),
        },
        "outputs/mtp_compare",
    ),
    "glm4_moe": Comparison(
        "zoo_glm4_moe",
        {
            "mtp": ("mtp_glm4_moe", []),
            "eagle3": (
                "eagle3",
                [
                    "target=zoo_glm4_moe",
                    "drafter.intermediate_size=512",
                    "trainer.warmup_steps=20",
                ],
            ),
            # GLM pads with its EOS, so DFlash's mask slots take the reserved `[MASK]` (id 1 in
            # glm-tiny's tokenizer, never in the chat), as dflash_llama3_8b a reserved token.
            "dflash": (
                "dflash",
                ["target=zoo_glm4_moe", "drafter.intermediate_size=512", "drafter.mask_token_id=1"],
            ),
        },
        "outputs/mtp_compare_glm4_moe",
    ),
}
DRAFTERS = COMPARISONS["deepseek_v3"].drafters  # every comparison names the same three


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--family", default="deepseek_v3", choices=list(COMPARISONS))
    p.add_argument(
        "--target", default=None, help="target.name_or_path (default: the family's zoo target)"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=200, help="training steps of every drafter")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    p.add_argument("--work", type=Path, help="default: the family's (COMPARISONS)")
    p.add_argument("--out", type=Path, help="the JSON report (required unless --train-only)")
    p.add_argument(
        "--train-only",
        action="store_true",
        help="train, export and verify the runs missing from --work, nothing else (several of "
        "these side by side fill the work directory; a last call without it writes the table)",
    )
    a = p.parse_args(argv)
    a.work = a.work or Path(COMPARISONS[a.family].work)
    return a


def compose(preset: str, overrides: list[str]):
    """The preset's training config, composed as `python -m drafttrain conf=<preset>` does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from drafttrain.__main__ import CONF_DIR, register_configs, to_train_config

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_train_config(hydra_compose(config_name=preset, overrides=overrides))


def run_dir(a: argparse.Namespace, name: str, seed: int) -> Path:
    return a.work / f"{name}_s{seed}"


def config(name: str, seed: int, a: argparse.Namespace):
    """Drafter `name`'s training config at `seed`: its preset with `a.steps` steps, verified by
    the runner at K = `a.k` on the preset's held-out prompts (`export.verify_*`, the same for
    every drafter)."""
    preset, extra = COMPARISONS[a.family].drafters[name]
    target = [f"target.name_or_path={a.target}"] if a.target else []
    return compose(
        preset,
        [
            *extra,
            *target,
            f"seed={seed}",
            f"trainer.max_steps={a.steps}",
            f"output_dir={run_dir(a, name, seed)}",
            f"export.verify_k={a.k}",
            "trainer.progress=false",
        ],
    )


def same_run(cfg, out: Path) -> bool:
    """`out` holds a finished run of exactly `cfg` (e.g. the preset run by its own command
    with `output_dir=` this run's directory): its resolved config equals `cfg`'s."""
    from drafttrain.export.card import RUNNER_REPORT
    from drafttrain.jobs.config import load_train_config

    if not (out / "export" / RUNNER_REPORT).is_file():
        return False
    done = load_train_config(out / "training_args.yaml")
    for c in (done, cfg):  # fields that change no number
        c.trainer.progress, c.trainer.save_every = False, 0
    return done == cfg


def trained(name: str, seed: int, a: argparse.Namespace) -> dict:
    """Train, export and verify drafter `name` at `seed` (or read a finished identical run):
    the runner's report on its export, and the job's seconds (None when reused)."""
    from drafttrain.export.card import RUNNER_REPORT
    from drafttrain.jobs.job import run_job

    cfg, out = config(name, seed, a), run_dir(a, name, seed)
    seconds = None
    if not same_run(cfg, out):
        t0 = time.perf_counter()
        run_job(cfg)
        seconds = time.perf_counter() - t0
    rep = json.loads((out / "export" / RUNNER_REPORT).read_text())
    return {"export": str(out / "export"), "job_s": seconds, **picked(rep)}


def picked(rep: dict) -> dict:
    keys = ("acceptance_length", "per_position_acceptance", "lossless", "rounds", "num_prompts")
    return {k: rep[k] for k in keys} | {"k": rep["k"], "max_new_tokens": rep["max_new_tokens"]}


def native(a: argparse.Namespace) -> dict:
    """The released MTP layer served as is (`drafter=native`), with the runner check's own
    settings (`verify_config` of the mtp run: same prompts, K, lengths, batch)."""
    from dataclasses import asdict

    from draftinfer.evaluation.run import run_eval
    from draftinfer.evaluation.threads import torch_threads
    from drafttrain.jobs.runner_eval import verify_config

    cfg = verify_config(config("mtp", a.seeds[0], a), "native")
    with torch_threads(1):
        return picked(asdict(run_eval(cfg)))


def table(runs: list[dict], seeds: list[int]) -> tuple[str, dict]:
    """The markdown table (one row per drafter) and the verdict on (b) against (a)."""
    rows = {}
    for r in runs:
        rows.setdefault(r["drafter"], []).append(r)
    head = "| drafter | " + " | ".join(f"AL seed {s}" for s in seeds)
    head += " | mean AL | spread | per-position (mean) | lossless |"
    lines = [head, "|" + "---|" * (len(seeds) + 5)]
    for name, rs in rows.items():
        als = [x["acceptance_length"] for x in rs]
        by_seed = {x["seed"]: x["acceptance_length"] for x in rs}
        cells = [f"{by_seed[s]:.3f}" if s in by_seed else "-" for s in seeds]
        if name == "native":  # deterministic: one run serves every seed
            cells = [f"{als[0]:.3f}"] * len(seeds)
        pos = [
            sum(x["per_position_acceptance"][j] for x in rs) / len(rs)
            for j in range(len(rs[0]["per_position_acceptance"]))
        ]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {sum(als) / len(als):.3f} | {max(als) - min(als):.3f} | "
            + " ".join(f"{p:.2f}" for p in pos)
            + f" | {all(x['lossless'] for x in rs)} |"
        )
    verdict = {}
    if "native" in rows and "mtp" in rows:
        nat = rows["native"][0]["acceptance_length"]
        mtp = [x["acceptance_length"] for x in rows["mtp"]]
        verdict = {
            "native_al": nat,
            "mtp_min_al": min(mtp),
            "mtp_spread": max(mtp) - min(mtp),
            "mtp_beats_native_beyond_spread": min(mtp) > nat,
        }
    return "\n".join(lines), verdict


def main(argv=None) -> dict:
    import torch

    a = parse_args(argv)
    if a.out is None and not a.train_only:
        raise SystemExit("--out is required (or --train-only)")
    a.work.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in a.seeds:
        for name in a.drafters:
            runs.append({"drafter": name, "seed": seed, **trained(name, seed, a)})
            print(json.dumps(runs[-1]), flush=True)
    if a.train_only:
        return {"runs": runs}
    runs.insert(0, {"drafter": "native", "seed": None, **native(a)})
    print(json.dumps(runs[0]), flush=True)
    md, verdict = table(runs, a.seeds)
    report = {
        "command": "python -m draftbench.mtp_compare " + " ".join(argv or sys.argv[1:]),
        "family": a.family,
        "target": config("mtp", a.seeds[0], a).target.name_or_path,
        "k": a.k,
        "steps": a.steps,
        "runs": runs,
        "verdict": verdict,
        "table": md,
        "env": {"python": platform.python_version(), "torch": torch.__version__},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(md)
    print(json.dumps(verdict))
    return report


if __name__ == "__main__":
    main()
