"""Where a training-time AL and the runner's part: acceptance at every start position against
acceptance along the runner's walk, both measured by the serving code on the target's own
greedy continuations.

    python -m draftbench.al_gap --drafter outputs/eagle3/export --num-prompts 32 --k 3 \
        --out docs/results/<date>_cpu_al_gap_eagle3.json

A training run scores a drafter at *every* position of its held-out responses (per-position
top-1 agreement with the target, multiplied out: `sim_al`). The runner only starts a round
where the previous one ended, so a stretch the drafter gets right is crossed in few rounds and
a hard stretch in many: its rounds over-sample hard positions. This measures the two on the
same tokens, with the runner's own code:

1. the target's greedy continuation of each prompt (`greedy_generate`, the runner's
   lossless reference);
2. **the walk**: the runner's rounds over those prompts (`SpecDecoder.generate`): AL and the
   per-position acceptance `python -m draftinfer` reports;
3. **every start**: one round started after each prefix of each continuation (a request whose
   prompt is the prompt plus the first `s` continuation tokens, cut after its first round):
   `a(s)`, the drafts that round accepts. Their mean over starts is what a teacher-forced
   score measures; replaying the walk over `a(s)` (start at 0, go `a(s) + 1` tokens a round)
   must give the runner's rounds exactly (`walk_replay_equal`, the measurement's own check).

The report gives per-position acceptance and AL both ways, and, when `--eval-json` names a
training run's `eval.json`, its simulated AL cut at K beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def walk(a: list[int], n: int, stopped: bool) -> list[int]:
    """The runner's rounds over a continuation of `n` tokens whose round started after token
    `s` accepts `a[s]` drafts (`draftinfer.conventions.metrics.walk_rounds`)."""
    from draftinfer.conventions.metrics import walk_rounds

    return walk_rounds(lambda s: a[s], n, stopped)


def per_position(accepted: list[int], k: int) -> list[float]:
    """P(drafts 1..j all accepted), j = 1..k, over a list of rounds."""
    n = max(len(accepted), 1)
    return [sum(a >= j for a in accepted) / n for j in range(1, k + 1)]


def measure(drafter: str, num_prompts: int, k: int, max_new_tokens: int, batch: int) -> dict:
    from draftinfer.decoding.baseline import greedy_generate
    from draftinfer.decoding.engine import Request
    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.run import load_served_drafter, runner_prompts, spec_decoder
    from draftinfer.files.checkpoint import read_drafter_config
    from draftinfer.files.loading import load_native_target
    from draftinfer.files.paths import resolve_path

    cfg = InferConfig(
        drafter=drafter,
        k=k,
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch,
        device="cpu",
        dtype="float32",
        compile=False,
        progress=False,
    )
    device = torch.device("cpu")
    _, _, meta = read_drafter_config(cfg.drafter)
    target_path = resolve_path(meta["target"])
    target = load_native_target(
        target_path, device, torch.float32, max_batch=batch, max_seq_len=cfg.max_model_len
    )
    drafter_module = load_served_drafter(cfg, target, device, torch.float32)
    loaded, tokenizer = runner_prompts(cfg, target, target_path)
    prompts = [p.ids for p in loaded]
    eos = tuple(target.config.eos_token_ids)
    t0 = time.perf_counter()
    cont = greedy_generate(target, prompts, max_new_tokens, eos)
    dec = spec_decoder(cfg, target, drafter_module, tokenizer)
    outs, _ = dec.generate(
        [Request(p, max_tokens=max_new_tokens, stop_token_ids=eos) for p in prompts]
    )
    lossless = [o.token_ids for o in outs] == cont
    walked = [list(o.accepted) for o in outs]
    # Every start: the round after each prefix of each continuation (positions with K tokens
    # still to come, so that every draft can be checked).
    starts = [(i, s) for i, c in enumerate(cont) for s in range(len(c) - 1)]
    reqs = [
        Request(prompts[i] + cont[i][:s], max_tokens=k + 2, stop_token_ids=eos) for i, s in starts
    ]
    firsts = []
    for b in range(0, len(reqs), 256):
        res, _ = dec.generate(reqs[b : b + 256])
        firsts += [o.accepted[0] if o.accepted else 0 for o in res]
    a = {i: [0] * len(c) for i, c in enumerate(cont)}
    for (i, s), acc in zip(starts, firsts, strict=True):
        a[i][s] = acc
    replay = [walk(a[i], len(c), bool(c) and c[-1] in eos) for i, c in enumerate(cont)]
    full = [a[i][s] for i, s in starts if s + k < len(cont[i]) - 1]  # K drafts checkable
    walk_rounds = [x for r in walked for x in r]
    return {
        "drafter": drafter,
        "target": meta["target"],
        "k": k,
        "prompts": len(prompts),
        "continuation_tokens": sum(len(c) for c in cont),
        "lossless": lossless,
        "walk_replay_equal": replay == walked,
        "walk": {
            "rounds": len(walk_rounds),
            "al": 1 + sum(walk_rounds) / max(len(walk_rounds), 1),
            "per_position": per_position(walk_rounds, k),
        },
        "every_start": {
            "starts": len(full),
            "al": 1 + sum(full) / max(len(full), 1),
            "per_position": per_position(full, k),
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="an exported drafter directory")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-json", type=Path, default=None, help="a training run's eval.json")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = measure(a.drafter, a.num_prompts, a.k, a.max_new_tokens, a.batch)
    if a.eval_json is not None:
        from drafttrain.jobs.runner_eval import position_accuracies, simulated_acceptance

        accs = position_accuracies(json.loads(a.eval_json.read_text()), "eval_acc_")
        al, pos = simulated_acceptance(accs, a.k)
        res["training_sim"] = {"source": str(a.eval_json), "al": al, "per_position": pos}
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    rows = [("walk (the runner's rounds)", res["walk"]), ("every start", res["every_start"])]
    if "training_sim" in res:
        rows.append(("training sim (eval.json, independent)", res["training_sim"]))
    print(f"{res['drafter']} on {res['target']}, K={a.k}, {res['prompts']} prompts")
    print(
        f"lossless {res['lossless']}, walk replayed from every-start counts: "
        f"{res['walk_replay_equal']}"
    )
    for name, r in rows:
        pos = " ".join(f"{p:.3f}" for p in r["per_position"])
        print(f"{name:<40} AL {r['al']:.3f}   per position {pos}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
