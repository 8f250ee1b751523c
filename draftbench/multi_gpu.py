"""DESIGN D1 on a host with 2+ GPUs: `accelerate launch` with each engine (DeepSpeed ZeRO-2,
ZeRO-3, FSDP2, DDP) trains `eagle3` against a Llama-3-shaped target; its per-step losses are
compared with a 1-GPU run of the same global batch, a resume from the mid-run checkpoint is
compared with the uninterrupted run, the export is compared with the 1-GPU export's format,
and throughput 1 vs 2 GPUs is reported.

    python -m draftbench.multi_gpu --out results/ [--engines zero2,zero3] [--steps 50]

The target is built here with random weights (Llama-3 vocabulary 128256, GQA 4:1, rope theta
500000; `--hidden/--layers` size it) and the zoo's tokenizer and chat data, so the check runs
offline. Writes `multi_gpu.json` and each run's metrics under `--out`, prints a table last.
The engines' launcher files are a checkout's `conf/launch/accelerate/<engine>.yaml` (`--launch-dir`;
the runs start in the checkout, where their DeepSpeed paths `conf/launch/deepspeed/*.json` resolve).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from draftinfer.files.paths import ZOO_DIR


def build_target(path: Path, hidden: int, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return
    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=int(hidden * 3.5),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    zoo = ZOO_DIR / "llama-tiny"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(zoo / name, path / name)


def run(cmd: list[str], log: Path, cwd: Path, timeout: int = 900) -> float:
    t0 = time.perf_counter()
    with log.open("w") as f:
        r = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if r.returncode != 0:
        tail = log.read_text()[-4000:]
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({r.returncode}):\n{tail}")
    return time.perf_counter() - t0


def train_cmd(engine: str, out: Path, args, *extra: str) -> list[str]:
    job = [
        "-m",
        "drafttrain",
        "conf=eagle3",
        f"target.name_or_path={args.target}",
        "data.path=zoo:chat",
        f"data.batch_size={args.batch}",
        f"data.max_length={args.max_length}",
        "drafter.draft_vocab_size=32000",
        f"trainer.max_steps={args.steps}",
        "trainer.log_every=1",
        f"trainer.save_every={args.steps // 2}",
        "trainer.keep_last=3",
        "trainer.warmup_steps=5",
        "trainer.progress=false",
        "export.enabled=false",
        f"output_dir={out}",
        *extra,
    ]
    if engine == "1gpu":
        return [sys.executable, *job]
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    return [
        *launch,
        "--config_file",
        str(args.launch_dir / f"{engine}.yaml"),
        "--num_processes",
        "2",
        *job,
    ]


def losses(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return {r["step"]: r for r in rows if "loss" in r}


def export_format(run_dir: Path) -> dict:
    from safetensors import safe_open

    subprocess.run(
        [sys.executable, "-m", "drafttrain.export", str(run_dir)],
        check=True,
        capture_output=True,
    )
    exp = run_dir / "export"
    cfg = json.loads((exp / "config.json").read_text())
    with safe_open(str(exp / "model.safetensors"), "pt") as f:
        tensors = {
            k: [str(f.get_slice(k).get_dtype()), f.get_slice(k).get_shape()] for k in f.keys()
        }
    files = sorted(p.name for p in exp.iterdir())
    return {"config": cfg, "tensors": tensors, "files": files}


def check_engine(engine: str, args) -> tuple[dict, dict]:
    out = args.work / engine
    shutil.rmtree(out, ignore_errors=True)
    wall = run(train_cmd(engine, out, args), args.out / f"{engine}.log", args.checkout)
    full = losses(out)
    shutil.copy(out / "metrics.jsonl", args.out / f"{engine}_metrics.jsonl")
    tok_s = [full[s]["tokens_per_s"] for s in sorted(full) if s > 5]
    entry = {
        "wall_s": wall,
        "losses": [full[s]["loss"] for s in sorted(full)],
        "tokens_per_s": sum(tok_s) / len(tok_s),
    }
    if not (engine == "1gpu" and args.skip_baseline_resume):
        # Resume: restart from the mid-run checkpoint as after a kill there.
        res = args.work / f"{engine}_resumed"
        shutil.rmtree(res, ignore_errors=True)
        shutil.copytree(out, res)
        mid = args.steps // 2
        shutil.rmtree(res / "checkpoints" / f"step_{args.steps:06d}")
        (res / "checkpoints" / "latest").write_text(f"step_{mid:06d}")
        (res / "metrics.jsonl").unlink()
        run(
            train_cmd(engine, res, args, "resume=true"),
            args.out / f"{engine}_resume.log",
            args.checkout,
        )
        resumed = losses(res)
        entry["resume_max_abs_diff"] = max(
            abs(resumed[s]["loss"] - full[s]["loss"]) for s in resumed
        )
        entry["resume_steps"] = sorted(resumed)
    return entry, export_format(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engines", default="zero2,zero3,fsdp2,ddp")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--match-steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path("/tmp/d1"))
    ap.add_argument("--skip-baseline-resume", action="store_true")
    ap.add_argument("--launch-dir", type=Path, default=Path("conf/launch/accelerate"))
    args = ap.parse_args()
    args.launch_dir = args.launch_dir.resolve()
    if not (args.launch_dir / "ddp.yaml").is_file():
        ap.error(
            f"{args.launch_dir} holds no launcher files: run from a checkout or pass --launch-dir"
        )
    args.checkout = args.launch_dir.parents[2]  # where `conf/launch/deepspeed/*.json` resolve
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    args.target = args.work / "target"
    build_target(args.target, args.hidden, args.layers)

    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    engines = ["1gpu", *[e for e in args.engines.split(",") if e]]
    base_fmt = None
    for engine in engines:
        try:
            entry, fmt = check_engine(engine, args)
        except (SystemExit, subprocess.SubprocessError) as e:  # record it, go on
            results["runs"][engine] = {"error": str(e)[-2000:]}
            print(f"{engine} failed: {str(e)[-600:]}")
            continue
        if base_fmt is None:
            base_fmt = fmt
        else:
            base = results["runs"]["1gpu"]["losses"][: args.match_steps]
            got = entry["losses"][: args.match_steps]
            entry["match_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(got, base))
            entry["export_same_format"] = (
                fmt["tensors"] == base_fmt["tensors"]
                and fmt["files"] == base_fmt["files"]
                and fmt["config"].keys() == base_fmt["config"].keys()
            )
        results["runs"][engine] = entry
        (args.out / "multi_gpu.json").write_text(json.dumps(results, indent=1))

    b = results["runs"]["1gpu"]["tokens_per_s"]
    print(f"\nD1: eagle3, {args.steps} steps, global batch {args.batch}, target {args.target}")
    print(
        f"{'engine':8} {'GPUs':>4} {'tok/s':>9} {'x 1GPU':>7} {'max rel dL (1..20)':>19} "
        f"{'resume |dL|':>11} {'export fmt':>10}"
    )
    for engine, e in results["runs"].items():
        if "error" in e:
            print(f"{engine:8} failed (see {engine}.log)")
            continue
        gpus = 1 if engine == "1gpu" else 2
        print(
            f"{engine:8} {gpus:>4} {e['tokens_per_s']:>9.0f} {e['tokens_per_s'] / b:>7.2f} "
            f"{e.get('match_max_rel_diff', 0.0):>19.4f} {e.get('resume_max_abs_diff', float('nan')):>11.2e} "
            f"{str(e.get('export_same_format', True)):>10}"
        )


if __name__ == "__main__":
    main()
