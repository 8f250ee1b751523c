"""Drafting time per round against K: parallel drafting (`ptd`, one forward), EAGLE-3 chain
drafting (K forwards), multi-layer MTP (`mtp`, N=3 distinct full-size decoder layers,
K a multiple of N) and the block drafter (`dflash`, 5 target-sized layers, one forward over
K + 1 block slots), side by side in one run, on 8B-shaped drafters.

    python -m draftbench.drafting --out docs/results/$(date +%F)_h200_drafting.json
    python -m draftbench.drafting --device cpu --tiny      # smoke test

Both drafters use Llama-3-8B dimensions (hidden 4096, 32 heads / 8 KV heads, intermediate
14336, target vocabulary 128256, draft vocabulary 32000, random bf16 weights: timing does not
depend on training). The chain drafter has 1 decoder layer (EAGLE-3); the parallel drafter has
2 (the `ptd` default). One round = the first pass over the rows the last commit added (a+1 =
K/2+1 accepted rows, the typical case) + drafting K tokens; the drafter KV already holds a
`--context`-token prefix. Times are medians of CUDA-event-timed repeats after warm-up.
Correctness first: each proposer's drafts are checked against its no-cache reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from draftbench.shapes import DRAFT_VOCAB, LLAMA31_8B, TINY, bench_drafter_arch, drafter_arch

SHAPES = {
    "llama3-8b": drafter_arch(LLAMA31_8B, DRAFT_VOCAB["llama3.1-8b"]),
    "tiny": drafter_arch(TINY, DRAFT_VOCAB["tiny"]),
}
TARGETS = {"llama3-8b": LLAMA31_8B, "tiny": TINY}


def build(kind: str, target: dict, draft_vocab: int, k_max: int, device, dtype):
    from draftinfer.registry import drafter_spec

    torch.manual_seed(0)
    spec = drafter_spec(kind)
    d = spec.build(spec.config_class(**bench_drafter_arch(kind, target, draft_vocab, k_max)))
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    return d.to(device=device, dtype=dtype).eval()


def first_pass(batch: int, start: int, n: int, width: int, shape, device, drafter):
    """A padded first pass: `n` live rows at cache indices start.., padded to `width`, with
    random target features of the drafter's declared width."""
    from draftinfer.decoding.proposer import FirstPass

    F = drafter.config.features.width(shape["target_hidden_size"])
    dtype = next(drafter.parameters()).dtype
    ids = torch.randint(0, shape["vocab_size"], (batch, width), device=device)
    feats = torch.randn(batch, width, F, device=device, dtype=dtype)
    j = torch.arange(width, device=device)
    cache = torch.where(j < n, start + j, -1).expand(batch, -1).contiguous()
    return FirstPass(torch.arange(batch, device=device), ids, feats, cache, cache.clamp(min=0))


def time_round(proposer, batch: int, context: int, k: int, device, shape, repeats: int):
    """Median ms of one drafting round (first pass of k//2+1 live rows of K+1 + k drafts)."""
    from draftinfer.conventions.slots import attn_bucket

    d = proposer.drafter
    # Prefix: fill the drafter KV with `context` rows once.
    prefix = first_pass(batch, 0, context, context, shape, device, d)
    proposer.propose(prefix, torch.zeros(batch, dtype=torch.long, device=device), 1)
    fp = first_pass(batch, context, k // 2 + 1, k + 1, shape, device, d)
    caps = torch.full((batch,), k, dtype=torch.long, device=device)
    attn_len = attn_bucket(context + 2 * k + 2, proposer.max_seq_len)
    times = []
    for i in range(repeats + 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            proposer.propose(fp, caps, k, attn_len=attn_len)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            import time

            t0 = time.perf_counter()
            proposer.propose(fp, caps, k, attn_len=attn_len)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 3:
            times.append(ms)
    return statistics.median(times)


def profile_round(proposer, batch: int, context: int, k: int, device, shape) -> str:
    """The top CUDA kernels (total time over 5 rounds) of a round as `time_round` runs it."""
    from torch.profiler import ProfilerActivity, profile

    from draftinfer.conventions.slots import attn_bucket

    fp = first_pass(batch, context, k // 2 + 1, k + 1, shape, device, proposer.drafter)
    caps = torch.full((batch,), k, dtype=torch.long, device=device)
    attn_len = attn_bucket(context + 2 * k + 2, proposer.max_seq_len)
    proposer.propose(fp, caps, k, attn_len=attn_len)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            proposer.propose(fp, caps, k, attn_len=attn_len)
        torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=18, max_name_column_width=70
    )


def check(kind: str, proposer, device, shape) -> bool:
    """Drafts of the cached proposer == its no-cache reference (greedy, one request)."""
    from draftinfer.decoding.proposer import greedy_chooser

    d = proposer.drafter
    n, k = 9, 3
    fp = first_pass(1, 0, n, n, shape, device, d)
    drafts, _ = proposer.propose(fp, torch.tensor([k], device=device), k, greedy_chooser)
    ref, _ = type(proposer).reference_drafts(
        d, fp.ids[0], fp.features[0], fp.rope_pos[0], k, greedy_chooser
    )
    return drafts[0].tolist() == ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="2,3,4,5,6,7,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--kinds", default="eagle3,ptd,mtp,dflash")
    ap.add_argument(
        "--compile", action="store_true", help="compile the proposers as the engine does"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print each kind's top CUDA kernels over rounds at its largest K and batch",
    )
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_drafting: CUDA is not available; nothing timed (use --device cpu --tiny)")
        return 0
    from draftinfer.registry import drafter_spec

    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES["tiny" if a.tiny else "llama3-8b"]
    target = TARGETS["tiny" if a.tiny else "llama3-8b"]
    kinds = a.kinds.split(",")
    ks = [int(x) for x in a.ks.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    max_len = a.context + 64
    results = {
        "shape": "tiny" if a.tiny else "llama3-8b",
        "dtype": str(dtype),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "context": a.context,
        "rows": [],
    }

    def servable(kind, d, k) -> bool:
        try:
            drafter_spec(kind).check_k(d.config, k)
        except ValueError:  # CheckpointError: this drafter does not draft k per round
            return False
        return True

    for kind in kinds:
        vocab = DRAFT_VOCAB["tiny" if a.tiny else "llama3.1-8b"]
        d = build(kind, target, vocab, max(ks + [4]), device, dtype)
        make = drafter_spec(kind).proposer_class
        ok = check(kind, make(d, 1, max_len, device, dtype), device, shape)
        results[f"{kind}_matches_reference"] = ok
        if not ok and device.type != "cuda":
            print(f"{kind}: cached drafts differ from the reference", file=sys.stderr)
            return 1
        for b in batches:
            prop = make(d, b, max_len, device, dtype)
            if a.compile:
                prop.compile(dynamic=True)  # as `SpecDecoder(compile=True)` does
            for k in [k for k in ks if servable(kind, d, k)]:
                ms = time_round(prop, b, a.context, k, device, shape, a.repeats)
                results["rows"].append({"kind": kind, "batch": b, "k": k, "ms": round(ms, 4)})
            if a.profile and b == max(batches) and device.type == "cuda":
                k = max(k for k in ks if servable(kind, d, k))
                table = profile_round(prop, b, a.context, k, device, shape)
                results[f"profile_{kind}_b{b}_k{k}"] = table
                print(f"{kind} batch {b} K={k}: top CUDA kernels\n{table}", flush=True)
        del d
    lines = [
        f"drafting time per round (ms), {results['shape']} drafters, {results['device']}, "
        f"context {a.context}",
        "batch | kind   | " + " | ".join(f"K={k}" for k in ks) + " | K=max/K=min",
    ]
    for b in batches:
        for kind in kinds:
            got = {
                r["k"]: r["ms"] for r in results["rows"] if r["kind"] == kind and r["batch"] == b
            }
            ms = list(got.values())
            lines.append(
                f"{b:5d} | {kind:6s} | "
                + " | ".join(f"{got[k]:.3f}" if k in got else "-" for k in ks)
                + f" | {ms[-1] / ms[0]:.2f}x"
            )
            results[f"ratio_{kind}_b{b}"] = ms[-1] / ms[0]
    lines.append(
        "matches reference: "
        + ", ".join(f"{kd}={results[f'{kd}_matches_reference']}" for kd in kinds)
    )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
