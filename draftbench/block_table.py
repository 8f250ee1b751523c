"""The one-contract table of the block drafters on the zoo (issue 51 item 5): DFlash, DFlash2,
DSpark, LiLiCorr and LiLiCorr + conv trained on the same data, steps, block and seeds against
the shipped text zoo target, each export's AL measured by the job's own runner check (the first
32 held-out conversations of `draftinfer/zoo/chat/test.jsonl`, 64 new tokens, greedy, lossless
checked against plain greedy) at K = B - 1, and DSpark also at K = B (its anchor slot drafts).

    python -m draftbench.block_table --out /tmp/block_table [--arms dflash,lilicorr_conv] \
        [--seeds 0,1] [--steps-scale 1.0]

Every arm is the `dflash` preset's contract (2 layers, B = 4, 32 anchors, gamma 4, 600 steps,
the kind's default loss `dpace`) with one option switched on; DSpark is its own preset
(`conf=dspark`: its loss is its own, 0.1 CE + 0.9 TV + BCE, with exp-decay weights) on the
same block, data and steps. One job at a time, each a fresh `python -m drafttrain` process
with `trainer.num_threads=1` (the machine is shared). A cell already in `<out>/table.json` is
not run again (re-running resumes). The table is printed last, as markdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftbench.train_runs import run_preset, table_cells

STEPS = 600
BLOCK = 4
# arm -> (preset, overrides); every arm on the dflash preset's block, data and steps.
ARMS: dict[str, tuple[str, list[str]]] = {
    "dflash": ("dflash", []),
    "dflash2": ("dflash", ["drafter.dflash2=true", "drafter.selector_top_k=8"]),
    "dspark": ("dspark", [f"export.verify_k={BLOCK - 1}", f"export.verify_extra_k=[{BLOCK}]"]),
    "lilicorr": ("lilicorr", ["drafter.lilicorr_conv=false"]),
    "lilicorr_conv": ("lilicorr", []),
}


def _reports(run: Path) -> dict[int, dict]:
    out = {}
    for path in run.rglob("runner_report*.json"):
        rep = json.loads(path.read_text())
        out[int(rep["k"])] = rep
    return out


def cell(out: Path, arm: str, seed: int, steps: int) -> dict:
    preset, extra = ARMS[arm]
    run = out / f"{arm}_s{seed}_n{steps}"
    cmd, wall = run_preset(
        out, run, preset,
        [f"drafter.block_size={BLOCK}", f"trainer.max_steps={steps}", f"seed={seed}", *extra],
    )  # fmt: skip
    reps = _reports(run)
    return {
        "arm": arm,
        "seed": seed,
        "steps": steps,
        "command": " ".join(cmd[1:]),
        "wall_s": round(wall, 1),
        "al": {str(k): r["acceptance_length"] for k, r in sorted(reps.items())},
        "per_position": {str(k): r["per_position_acceptance"] for k, r in sorted(reps.items())},
        "lossless": all(r["lossless"] for r in reps.values()),
    }


def markdown(cells: list[dict]) -> str:
    """Per arm: AL at K = B - 1 per seed and its mean; DSpark's AL at K = B beside it."""
    kb1, kb = str(BLOCK - 1), str(BLOCK)
    rows = [
        f"| arm | steps | seeds | AL at K = {kb1} (per seed) | mean | AL at K = {kb} | lossless | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_arm: dict[tuple[str, int], list[dict]] = {}
    for c in cells:
        by_arm.setdefault((c["arm"], c["steps"]), []).append(c)
    for (arm, steps), cs in by_arm.items():
        cs = sorted(cs, key=lambda c: c["seed"])
        als = [c["al"][kb1] for c in cs]
        at_b = [c["al"][kb] for c in cs if kb in c["al"]]
        rows.append(
            f"| {arm} | {steps} | {','.join(str(c['seed']) for c in cs)} | "
            f"{' / '.join(f'{x:.3f}' for x in als)} | **{sum(als) / len(als):.3f}** | "
            f"{' / '.join(f'{x:.3f}' for x in at_b) or '-'} | "
            f"{str(all(c['lossless'] for c in cs)).lower()} | "
            f"{sum(c['wall_s'] for c in cs) / len(cs):.0f} s |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps-scale", type=float, default=1.0)
    a = ap.parse_args(argv)
    out, table_path, cells = table_cells(a.out)
    done = {(c["arm"], c["seed"], c["steps"]) for c in cells}
    steps = max(1, round(STEPS * a.steps_scale))
    for seed in [int(s) for s in a.seeds.split(",")]:
        for arm in a.arms.split(","):
            if (arm, seed, steps) in done:
                continue
            c = cell(out, arm, seed, steps)
            print(f"{arm} seed {seed}: AL {c['al']} ({c['wall_s']:.0f} s)", flush=True)
            cells.append(c)
            table_path.write_text(json.dumps(cells, indent=1) + "\n")
    table = markdown(cells)
    (out / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
