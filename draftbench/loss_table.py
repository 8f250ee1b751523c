"""The loss table on the zoo: each kind's CPU preset trained with each `trainer.loss`, the same
steps and seed, each export's AL measured by the job's own runner check (the preset's
`export.verify_k`, the first 32 held-out conversations of `draftinfer/zoo/chat/test.jsonl`,
64 new tokens, greedy).

    python -m draftbench.loss_table --out /tmp/loss_table [--kinds eagle3,mtp] \
        [--losses soft_ce,tv] [--steps-scale 0.4] [--seeds 0]

One job at a time, each a fresh `python -m drafttrain` process with `trainer.num_threads=1`
(the machine is shared). A cell already in `<out>/table.json` is not run again (re-running
resumes); `--steps-scale` shortens every run of a kind equally (never one cell). The table
is printed last, as markdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftbench.train_runs import run_preset, table_cells
from drafttrain.objectives.loss_fns import LOSSES
from drafttrain.trainer.loggers import read_metrics

# Each kind's CPU preset against the text zoo target and its step count.
PRESETS = {"eagle3": ("eagle3", 600), "ptd": ("ptd_eagle3", 1500), "mtp": ("mtp3", 600),
           "dflash": ("dflash", 600)}  # fmt: skip


def _cell(out: Path, kind: str, loss: str, seed: int, steps: int) -> dict:
    preset, _ = PRESETS[kind]
    run = out / f"{kind}_{loss}_s{seed}"
    cmd, wall = run_preset(
        out, run, preset, [f"trainer.loss={loss}", f"trainer.max_steps={steps}", f"seed={seed}"]
    )
    rep = json.loads(next(run.rglob("runner_report.json")).read_text())
    last = [r for r in read_metrics(run) if "sim_al" in r][-1]  # the last training window
    return {
        "kind": kind,
        "loss": loss,
        "seed": seed,
        "steps": steps,
        "command": " ".join(cmd[1:]),
        "wall_s": round(wall, 1),
        "al": rep["acceptance_length"],
        "per_position": rep["per_position_acceptance"],
        "k": rep["k"],
        "lossless": rep["lossless"],
        "sim_al_last": last["sim_al"],
        "loss_last": last["loss"],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", default=",".join(PRESETS))
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps-scale", type=float, default=1.0)
    a = ap.parse_args(argv)
    out, table_path, cells = table_cells(a.out)
    done = {(c["kind"], c["loss"], c["seed"], c["steps"]) for c in cells}
    for kind in a.kinds.split(","):
        steps = max(1, round(PRESETS[kind][1] * a.steps_scale))
        for seed in [int(s) for s in a.seeds.split(",")]:
            for loss in a.losses.split(","):
                if (kind, loss, seed, steps) in done:
                    continue
                c = _cell(out, kind, loss, seed, steps)
                print(
                    f"{kind} {loss} seed {seed}: AL {c['al']:.3f} ({c['wall_s']:.0f} s)", flush=True
                )
                cells.append(c)
                table_path.write_text(json.dumps(cells, indent=1) + "\n")
    print("| kind | loss | seed | steps | K | AL | per-position | lossless | wall |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        pp = " ".join(f"{x:.2f}" for x in c["per_position"])
        print(
            f"| {c['kind']} | {c['loss']} | {c['seed']} | {c['steps']} | {c['k']} | "
            f"{c['al']:.3f} | {pp} | {str(c['lossless']).lower()} | {c['wall_s']:.0f} s |"
        )


if __name__ == "__main__":
    main()
