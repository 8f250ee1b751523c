"""Round costs per K of an exported drafter on its own target, as a `round_costs=` file.

    python -m draftbench.verify_costs --drafter DIR --ks 1,2,3,4 --batch 8 --out costs.json

`draftbench.round` times rounds at real shapes with random weights; this times a trained
drafter against the target it was trained on (the zoo on a CPU, or a real pair on a GPU), the
costs the confidence-threshold sweep of `python -m draftinfer confidence_report=true
round_costs=FILE` prices verified rows with (`draftinfer.evaluation.calibration`). On a shared
machine a plain phase and a speculative phase minutes apart see different loads, so here the
plain decode step and the rounds at every K are timed in *alternation*, `--reps` times, in one
process, and each K's cost is the median over repetitions of (median round time) / (that
repetition's plain step time), in plain decode steps, the unit `choose_k` reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.evaluation.config import InferConfig
from draftinfer.evaluation.run import runner_prompts
from draftinfer.files.checkpoint import load_drafter
from draftinfer.files.loading import load_native_target
from draftinfer.files.paths import resolve_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="an exported drafter directory")
    ap.add_argument("--target", default="", help="default: the target the drafter records")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per request and phase")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    device = torch.device(a.device)
    meta = json.loads((Path(a.drafter) / "config.json").read_text()).get("drafttrain", {})
    name = a.target or meta.get("target", "")
    if not name:
        ap.error("--target is required: the drafter does not record its target")
    tpath = resolve_path(name)
    target = load_native_target(tpath, device, max_batch=a.batch, max_seq_len=1024)
    drafter, _ = load_drafter(a.drafter, target.shared_weights(), device)
    cfg = InferConfig(drafter=a.drafter, num_prompts=a.batch)  # the runner's held-out prompts
    prompts = [p.ids for p in runner_prompts(cfg, target, tpath)[0]]
    decoders = {k: SpecDecoder(target, drafter, k, max_batch=a.batch) for k in ks}
    reqs = [Request(p, max_tokens=a.tokens) for p in prompts]
    for dec in decoders.values():  # warm-up
        dec.generate(reqs[:1])
    ratios: dict[int, list[float]] = {k: [] for k in ks}
    plain_ms: list[float] = []
    t0 = time.perf_counter()
    for _ in range(a.reps):
        stats: dict = {}
        greedy_generate(target, prompts, a.tokens, stats=stats)
        plain = stats["decode_seconds"] / max(stats["steps"], 1)
        plain_ms.append(1e3 * plain)
        for k, dec in decoders.items():
            _, st = dec.generate(reqs)
            ratios[k].append(statistics.median(st["round_seconds"]) / plain)
    costs = {str(k): round(statistics.median(v), 4) for k, v in ratios.items()}
    out = {
        "round_cost": costs,
        "drafter": a.drafter,
        "target": name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "batch": a.batch,
        "reps": a.reps,
        "plain_step_ms": [round(x, 3) for x in plain_ms],
        "ratios": {str(k): [round(x, 4) for x in v] for k, v in ratios.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
