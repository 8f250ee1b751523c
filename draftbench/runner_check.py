"""The runner as a user meets it, at Llama-3.1-8B shapes on a GPU: the documented command with no
speed flags, twice in two processes, beside `draftbench.round` in the same call.

    python -m draftbench.runner_check --work /tmp/rc --out $OUT/runner_check.json   # CUDA
    python -m draftbench.runner_check --tiny --device cpu --work /tmp/rc              # smoke

1. A target directory as a user has one: `config.json` (Llama-3.1-8B's fields), random bf16
   weights in safetensors shards, the zoo's tokenizer (its ids fit the 128256-row vocabulary);
   and an exported drafter of `--kind` for it (random weights, `write_drafter`).
2. `python -m draftinfer drafter=<export> target=<dir> batch_size=1 ...` with no speed flags,
   twice, each a fresh process: the report's fast path, plain baseline, times, speedup and
   warm-up (the second process finds inductor's caches the first one wrote).
3. `python -m draftbench.round` for the same kind and K at batch 1 (the runner's default
   settings, `--graph-only --fuse-only`), whose `runner_step_ms` times the runner's own
   `PlainStep` and whose round is the same `SpecDecoder`.
The table printed last: the report's speedup against AL * t_plain_step / t_round from the
times it prints, and each of the report's times against the benchmark's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from draftbench.round import build_drafter
from draftbench.shapes import DRAFT_VOCAB, LLAMA31_8B, TINY, hf_config_dict, random_llama_target
from draftinfer.files.paths import ZOO_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_target(path: Path, shape: dict, device, shard_bytes: int = 4 << 30) -> None:
    """A Llama target directory with random bf16 weights (norms 1, the rest N(0, 0.02))."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model = random_llama_target(shape, device, torch.bfloat16, 1, 64)
    zoo = ZOO_DIR / "llama-tiny"
    zoo_cfg = json.loads((zoo / "config.json").read_text())
    cfg = {
        **hf_config_dict(shape),
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": zoo_cfg.get("bos_token_id"),
        "eos_token_id": zoo_cfg.get("eos_token_id"),
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (zoo / name).is_file():
            shutil.copy2(zoo / name, path / name)
    shards, shard, size = [], {}, 0
    for name, p in model.named_parameters():
        shard[name] = p.detach().to("cpu").contiguous()
        size += p.numel() * p.element_size()
        if size >= shard_bytes:
            shards.append(shard)
            shard, size = {}, 0
    if shard:
        shards.append(shard)
    index = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def write_export(
    path: Path, target_dir: Path, shape: dict, kind: str, k: int, draft_vocab: int, device
) -> None:
    """An exported drafter of `kind` for the target (random weights, bf16)."""
    from draftinfer.files.checkpoint import write_drafter
    from draftinfer.files.loading import load_native_target

    target = load_native_target(target_dir, device, torch.bfloat16, max_batch=1, max_seq_len=64)
    drafter = build_drafter(kind, target, shape, draft_vocab, k, device, torch.bfloat16)
    write_drafter(path, drafter, {"target": str(target_dir)}, torch.bfloat16)
    del target, drafter
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run(cmd: list[str], log: Path) -> tuple[int, float]:
    t0 = time.perf_counter()
    with log.open("w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    return r.returncode, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/runner_check"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--kind", default="eagle3")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--bench-rounds", type=int, default=16, help="draftbench.round --rounds")
    a = ap.parse_args()
    # The zoo tokenizer's ids run to 4096: the tiny shape's vocabulary is widened to hold them.
    shape = dict(TINY, vocab_size=4096) if a.tiny else LLAMA31_8B
    draft_vocab = DRAFT_VOCAB["tiny" if a.tiny else "llama3.1-8b"]
    target_dir, export_dir = a.work / "target", a.work / f"export_{a.kind}"
    t0 = time.perf_counter()
    if a.processes and not (target_dir / "model.safetensors.index.json").is_file():
        write_target(target_dir, shape, a.device)
    if a.processes:
        write_export(export_dir, target_dir, shape, a.kind, a.k, draft_vocab, a.device)
    res: dict = {"kind": a.kind, "k": a.k, "build_s": round(time.perf_counter() - t0, 1)}
    res["runs"] = []
    for i in range(a.processes):
        report = a.work / f"report_{i}.json"
        cmd = [
            sys.executable, "-m", "draftinfer", f"drafter={export_dir}", f"target={target_dir}",
            f"k={a.k}", "batch_size=1", f"num_prompts={a.prompts}",
            f"max_new_tokens={a.new_tokens}", "max_model_len=1024", f"report={report}",
            "plot=none", "progress=false", f"device={a.device}",
        ]  # fmt: skip
        rc, wall = run(cmd, a.work / f"draftinfer_{i}.log")
        row = {"rc": rc, "wall_s": round(wall, 1)}
        if rc == 0:
            row.update(json.loads(report.read_text()))
        res["runs"].append(row)
    if not a.skip_bench:
        bench = a.work / "round.json"
        cmd = [
            sys.executable, "-m", "draftbench.round", "--batches", "1", "--kinds", a.kind,
            "--ks", f"{a.kind}:{a.k}", "--graph-only", "--fuse-only", "--peer-dir", "/none",
            "--rounds", str(a.bench_rounds),
            "--out", str(bench), "--device", a.device,
        ] + (["--tiny"] if a.tiny else [])  # fmt: skip
        rc, wall = run(cmd, a.work / "round.log")
        res["round"] = {"rc": rc, "wall_s": round(wall, 1)}
        if rc == 0:
            res["round"].update(json.loads(bench.read_text()))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2))
    print_table(res)
    return 0 if all(r["rc"] == 0 for r in res["runs"]) else 1


def print_table(res: dict) -> None:
    bench_plain = bench_round = float("nan")
    rnd = res.get("round", {})
    for target in rnd.get("targets") or ([rnd] if "plain" in rnd else []):
        for p in target.get("plain", {}).values():
            bench_plain = p.get("runner_step_ms", bench_plain)
        for r in target.get("rows", []):
            bench_round = r.get("t_round_ms", bench_round)
    print(f"\nthe runner at {res['kind']} K={res['k']}, batch 1 (build {res['build_s']} s)")
    print(
        "process | rc | wall s | warm-up s | fast path | baseline | AL | t_plain ms | "
        "t_round ms | speedup | AL*t_plain/t_round | plain/bench | round/bench"
    )
    for i, r in enumerate(res["runs"]):
        if r["rc"] != 0:
            print(f"{i} | {r['rc']} | {r['wall_s']} | failed")
            continue
        al, tp, tr = r["acceptance_length"], r["t_plain_step_ms"], r["t_round_ms"]
        print(
            f"{i} | 0 | {r['wall_s']} | {r['warmup_s']:.1f} | {r['fast_path']} | "
            f"{r['baseline']} | {al:.3f} | {tp:.3f} | {tr:.3f} | {r['speedup']:.3f} | "
            f"{al * tp / tr:.3f} | {tp / bench_plain:.3f} | {tr / bench_round:.3f}"
        )
    print(f"bench: runner plain step {bench_plain:.3f} ms, round {bench_round:.3f} ms")
    for i, r in enumerate(res["runs"]):
        extra = r.get("extra", {})
        print(f"process {i}: plain warm-up {extra.get('warmup_plain_s', float('nan')):.1f} s;")
        print(f"  compile: {json.dumps(extra.get('compile'))}")


if __name__ == "__main__":
    sys.exit(main())
