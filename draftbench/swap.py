"""The cost of a drafter hot swap (`SpecDecoder.update_drafter`) in the round, at real shapes.

    python -m draftbench.swap --out docs/results/$(date +%F)_h200_swap.json        # CUDA
    python -m draftbench.swap --device cpu --tiny --rounds 6                       # smoke test

Per kind: one `SpecDecoder` as the runner builds it on CUDA (`--compile all`, round graphs,
pipelining), Llama-3.1-8B target and 8B-sized drafters with random bf16 weights (time does not
depend on training), batch `--batch` prompts of `--context` tokens. Two drafters of one config
(seeds 1 and 2) give the updates, alternately, in the export's format (`serving_tensors`, bf16).

1. Warm-up: a run that compiles and captures the round's graphs along the whole range of
   lengths the timed runs reach (the same prompts and token budget).
2. Plain run: `--rounds` rounds, no swap (`t_round`, the engine's per-round times).
3. Swapped run: the same requests, a swap every `--swap-every` rounds through the runner's seam
   (`generate(between_rounds=...)`): staging (`update_drafter`: checks, pinning, the upload
   queued on a side stream) timed on the host, the in-place copy (`apply`, after a wait for
   the staging) with CUDA events read after the run, between two graph replays.

Checks (a failure exits 1): no graph was captured during the swapped run (weights are copied into
the tensors the captured graphs read, nothing is recaptured) while replays went on; the
swapped run's tokens equal the plain run's (the target alone decides them; both lossless).
Reported per kind: t_round median plain vs swapped, the mean extra time per swap
((sum of swapped rounds - sum of plain rounds) / swaps), t_stage and t_apply (ms), bytes
copied, graphs before/after, replays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from draftbench.round import build_drafter, prompts
from draftbench.shapes import DRAFT_VOCAB, LLAMA31_8B, TINY, random_llama_target


def timed_decoder_class():
    from draftinfer.decoding.engine import SpecDecoder

    class TimedSwapDecoder(SpecDecoder):
        """The engine, its update's two parts timed: staging (host clock, checks and
        upload) and the in-place copy (CUDA events on the round's stream)."""

        stage_ms: list[float]
        apply_ms: list[float]
        apply_events: list

        def update_drafter(self, update):
            # Host time only: staging queues its upload on a side stream, and a sync here
            # would stall the round in flight (what the benchmark measures).
            t0 = time.perf_counter()
            super().update_drafter(update)
            self.stage_ms.append((time.perf_counter() - t0) * 1e3)

        def _apply_staged(self):
            if self._staged is None:
                return False
            if self.device.type == "cuda":  # events read after the run, never synced here
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                super()._apply_staged()
                b.record()
                self.apply_events.append((a, b))
            else:
                t0 = time.perf_counter()
                super()._apply_staged()
                self.apply_ms.append((time.perf_counter() - t0) * 1e3)
            return True

    return TimedSwapDecoder


def bench_kind(kind: str, a, target, shape: dict, device, dtype) -> dict:
    from draftinfer.decoding.engine import Request
    from draftinfer.decoding.swap import DrafterUpdate
    from draftinfer.files.checkpoint import serving_tensors

    vocab = DRAFT_VOCAB["tiny" if a.tiny else "llama3.1-8b"]
    drafter = build_drafter(kind, target, shape, vocab, a.k, device, dtype)
    other = build_drafter(kind, target, shape, vocab, a.k, device, dtype)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in other.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    updates = [serving_tensors(d, torch.bfloat16) for d in (other, drafter)]
    nbytes = sum(t.numel() * t.element_size() for t in updates[0].values())
    cuda = device.type == "cuda"
    dec = timed_decoder_class()(
        target,
        drafter,
        a.k,
        max_batch=a.batch,
        max_model_len=target.max_seq_len,
        compile=a.compile if cuda else "none",
        cuda_graphs=cuda,
    )
    dec.stage_ms, dec.apply_ms, dec.apply_events = [], [], []
    ps = prompts(a.batch, a.context, target.config.vocab_size)

    def reqs():
        return [Request(p, max_tokens=a.rounds + 1) for p in ps]

    t0 = time.perf_counter()
    dec.generate(reqs())  # warm-up: compiles and captures every bucket the runs reach
    print(f"{kind}: warm-up (compile, capture) {time.perf_counter() - t0:.1f} s", flush=True)
    plain, plain_stats = dec.generate(reqs())
    graphs_before = len(dec._graphed.graphs) if dec._graphed else 0
    replays_before = dec._graphed.replays if dec._graphed else 0
    n = [0]

    def between_rounds(d):
        n[0] += 1
        if n[0] % a.swap_every == 0:
            v = d.drafter_version + 1
            d.update_drafter(DrafterUpdate(v, updates[v % 2]))

    swapped, stats = dec.generate(reqs(), between_rounds=between_rounds)
    print(f"{kind}: plain and swapped runs done {time.perf_counter() - t0:.1f} s", flush=True)
    dec.apply_ms += [a.elapsed_time(b) for a, b in dec.apply_events]  # synced at its end
    graphs_after = len(dec._graphed.graphs) if dec._graphed else 0
    replays_after = dec._graphed.replays if dec._graphed else 0
    same = all(x.token_ids == y.token_ids for x, y in zip(plain, swapped, strict=True))
    swaps = len(stats["swaps"])
    t_plain, t_swap = plain_stats["round_seconds"], stats["round_seconds"]
    return {
        "kind": kind,
        "k": a.k,
        "batch": a.batch,
        "context": a.context,
        "rounds_plain": len(t_plain),
        "rounds_swapped": len(t_swap),
        "swaps": swaps,
        "t_round_ms_plain": statistics.median(t_plain) * 1e3,
        "t_round_ms_swapped": statistics.median(t_swap) * 1e3,
        "extra_ms_per_swap": (sum(t_swap) - sum(t_plain)) * 1e3 / max(swaps, 1),
        "t_stage_ms": statistics.median(dec.stage_ms) if dec.stage_ms else None,
        "t_apply_ms": statistics.median(dec.apply_ms) if dec.apply_ms else None,
        "update_bytes": nbytes,
        "graphs_before": graphs_before,
        "graphs_after": graphs_after,
        "replays": replays_after - replays_before,
        "recaptured": graphs_after != graphs_before,
        "tokens_identical": same,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny target shape (smoke test)")
    ap.add_argument("--kinds", default="eagle3,ptd,mtp,dflash")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=48)
    ap.add_argument("--swap-every", type=int, default=4)
    ap.add_argument("--compile", default="all", choices=["none", "target", "all"])
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if a.tiny else LLAMA31_8B
    max_len = a.context + a.rounds * (a.k + 1) + 2 * (a.k + 1) + 8
    target = random_llama_target(shape, device, dtype, a.batch, max_len)
    results, bad = [], []
    for kind in a.kinds.split(","):
        r = bench_kind(kind, a, target, shape, device, dtype)
        results.append(r)
        if r["recaptured"] or not r["tokens_identical"]:
            bad.append(kind)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"drafter hot swap, {name}, batch {a.batch}, K={a.k}, every {a.swap_every} rounds")
    print("kind    t_round plain | swapped ms  extra/swap ms  stage | apply ms  MB  recaptured")
    for r in results:
        print(
            f"{r['kind']:7s} {r['t_round_ms_plain']:8.3f} | {r['t_round_ms_swapped']:8.3f}"
            f"  {r['extra_ms_per_swap']:12.3f}  {r['t_stage_ms']:6.2f} | {r['t_apply_ms']:6.3f}"
            f"  {r['update_bytes'] / 2**20:5.1f}  {r['recaptured']}"
        )
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": name, "torch": torch.__version__, "args": vars(a)}
        out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    if bad:
        print(f"FAILED: recaptured or tokens changed for {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
