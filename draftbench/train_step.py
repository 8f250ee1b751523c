"""Training-step benchmark (DESIGN 7): our trainer's step vs vllm-project/speculators 0.9.0,
side by side in one process, at Llama-3.1-8B draft shapes.

    python -m draftbench.train_step \
        --out docs/results/$(date +%F)_h200_train_step.json        # CUDA
    python -m draftbench.train_step --device cpu --tiny --out /tmp/bench_train.json  # smoke

The dflash row beside speculators' DFlash (default optimizer and AdamW) on one GPU, the peer
installed as `draftbench/peer_speculators.py` says; `--budget-s 300` skips a row that would
start after 5 minutes (not timed on a GPU yet: the compilations are most of it):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    python -m draftbench.train_step --seqs 3072 --kinds dflash:15 --no-ac-variant \
        --budget-s 300 --out docs/results/$(date +%F)_h100_train_step_dflash.json

What one of *our* steps is: the kind's real objective (`drafttrain/kinds/<kind>/objective.py`)
with the trainer's row loss (`trainer.loss`, else the kind's default) on one sequence of
`seq_len` tokens (batch 1), backward, gradient clipping, the optimizer step, with the
trainer's own choices of the 8B presets (`conf/drafttrain/eagle3_llama3_8b.yaml`,
`ptd_eagle3_llama3_8b.yaml`, `dflash_llama3_8b.yaml`: parameter dtype, master weights,
moment dtype, torch.compile, activation checkpointing; `drafttrain.trainer.wrap`, `drafttrain.trainer.optim`),
under the trainer's bf16 autocast. The drafter has random weights (1 decoder layer for
eagle3, the preset's for ptd and dflash; hidden 4096, 32/8 heads, ffn 14336, target vocab
128256, draft vocab 32000 for eagle3 and ptd, the whole vocabulary for dflash). The target side
is synthesized: random features for the drafter's taps (`[1, T, 3H]` for eagle3 and ptd,
`[1, T, 5H]` for dflash's five) and a random final hidden state `[1, T, H]` with a random bf16
head `[V, H]`, handed over as the `TrainTargetOutput` a frozen target returns, so the
target's distribution is computed inside the step exactly as in training
(`drafttrain.frozen.head`), while no 8B target forward is timed (the peer also starts from
precomputed hidden states). dflash (`--kinds dflash:K`, K = block size - 1 drafts, the
naming of `draftbench/round.py`: `dflash:15` is the preset's block of 16): the architecture its
trainer derives from the preset (`TrainSpec.arch`: 5 layers, z-lab's taps [1, 8, 15, 22, 29],
mask token 128002), the target's head copied into its frozen `lm_head`, up to `num_anchors`
(512) blocks per sequence drawn by the objective from the assistant tokens (the first T / 32
tokens are a prompt), every block in one forward (flex attention on CUDA), exp-decay
per-slot weights (gamma 7); the row reports `anchors` (blocks per step), `block_rows`
(anchors x block size), `block_al` and per-slot accuracy.

Rows: eagle3 (TTT 7), ptd (K = 4 and 8, with the per-depth slot counts) and dflash (given
with `--kinds`) at seq 2048 / 8192 / 16384 / 32768 (`--seqs`), each also with the drafter's
`lm_head` frozen (`ours+fh`, what `trainer.freeze=[lm_head]` trains, the peer's setting: the
like-for-like row; not for dflash, whose head is the target's and never trained;
`--no-fh-variant` skips them), eagle3 again with activation checkpointing at the first two
lengths (`ours+ac`, the same compiled blocks wrapped; `--no-ac-variant` skips them), and the
peer's EAGLE-3, P-EAGLE and DFlash steps (`draftbench/peer_speculators.py`,
`draftbench/peer_speculators_dflash.py`; skipped with the reason when speculators is not
installed; EAGLE-3 and DFlash also with `--optimizer adamw` at the first length).
Per row: tokens/s (median over timed steps of seq_len / step time), step ms, peak
`torch.cuda.max_memory_allocated` GiB (reset before each timed step, so weights, grads and
optimizer state count). An out-of-memory or a failure is a row, not a crash. The peer resets
torch.compile's caches on entry and exit, so its first EAGLE-3 row runs before ours and the
rest after ours. `--budget-s` bounds the wall time: rows that would start later are reported
as skipped. `--backends flex,flash,cudnn` runs each of our rows once per TTT attention backend
(`drafter.attention_backend`, `drafttrain/objectives/ttt.py`; default: the preset's, `auto`). Results go
to `--out` (JSON) and a markdown table is printed last. `--profile DIR`
adds, after each of our rows, one step timed phase by phase and one under `torch.profiler`
(CUDA kernel time by family and the top kernels) to `DIR/profile_*.txt`. `--gemm-floor` adds,
after each of our rows and the peer's EAGLE-3 rows, one more step's matrix products replayed
alone (`draftbench/gemm_floor.py`) as the row's `gemm_floor`, and a second table: step ms,
the GEMM floor, and for EAGLE-3 the step time the issue's speed bar allows (`SPEED_BARS`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from draftbench import shapes as registry


def _shapes(target: dict, draft_vocab: int, **override) -> dict:
    """A registry target's dimensions (`NativeConfig` field names) under this script's names."""
    names = dict(
        hidden="hidden_size",
        heads="num_heads",
        kv_heads="num_kv_heads",
        head_dim="head_dim",
        intermediate="intermediate_size",
        vocab="vocab_size",
        target_layers="num_layers",
        rms_norm_eps="rms_norm_eps",
        rope_theta="rope_theta",
        rope_scaling="rope_scaling",
        max_position_embeddings="max_position_embeddings",
    )
    return {**{k: target[v] for k, v in names.items()}, "draft_vocab": draft_vocab, **override}


# Llama-3.1-8B target, EAGLE-3 draft shapes (draft vocab 32000); a tiny one for CPU smoke runs.
SHAPES = {
    "llama3.1-8b": _shapes(registry.LLAMA31_8B, registry.DRAFT_VOCAB["llama3.1-8b"]),
    "tiny": _shapes(
        registry.TINY, 128, target_layers=8, rope_scaling=None, max_position_embeddings=4096
    ),
}
# Each kind's 8B preset and the drafter-config field that K sets per objective (None: K is
# an architecture field, dflash's block of K + 1 slots, so each K builds its own drafter).
PRESETS = {
    "eagle3": "eagle3_llama3_8b",
    "ptd": "ptd_eagle3_llama3_8b",
    "dflash": "dflash_llama3_8b",
}
K_FIELD = {"eagle3": "ttt_steps", "ptd": "parallel_k", "dflash": None}
GIB = 2**30


def compose(preset: str, overrides: list[str]):
    """The preset's resolved config (`drafttrain.jobs.config.TrainConfig`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from drafttrain.__main__ import CONF_DIR, register_configs, to_train_config

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_train_config(hydra_compose(config_name=preset, overrides=overrides))


def eagle_arch(kind: str, dc, s: dict, k: int):
    """An EAGLE-family drafter's config at shapes `s`: the preset's layers, EAGLE-3's taps
    (2, L // 2, L - 3), the draft vocabulary (`k` is the objective's, not the drafter's)."""
    from draftinfer.registry import drafter_spec

    L = s["target_layers"]
    extra = {}
    if kind == "ptd":
        extra = {"mask_token_id": s["vocab"] - 1, "parallel_k": dc.parallel_k}
    return drafter_spec(kind).config_class(
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        vocab_size=s["vocab"],
        draft_vocab_size=s["draft_vocab"],
        target_hidden_size=s["hidden"],
        aux_layer_ids=[2, L // 2, L - 3],
        num_hidden_layers=dc.num_layers,
        rms_norm_eps=s["rms_norm_eps"],
        rope_theta=s["rope_theta"],
        rope_scaling=s["rope_scaling"],
        max_position_embeddings=s["max_position_embeddings"],
        **extra,
    )


def block_arch(kind: str, dc, s: dict, k: int):
    """A block drafter's config as its trainer derives it (`TrainSpec.arch`: the preset's
    layers, taps, mask token and options) from a target of shapes `s`, with a block of
    `k + 1` slots (K = k drafts). A preset mask token the (tiny) vocabulary lacks becomes
    its last id (which id does not change the cost)."""
    from types import SimpleNamespace

    from drafttrain.registry import train_spec

    dc = copy.copy(dc)
    dc.block_size = k + 1
    if dc.mask_token_id is not None and dc.mask_token_id >= s["vocab"]:
        dc.mask_token_id = s["vocab"] - 1
    info = SimpleNamespace(
        hidden_size=s["hidden"],
        num_layers=s["target_layers"],
        vocab_size=s["vocab"],
        max_position_embeddings=s["max_position_embeddings"],
    )
    hf = SimpleNamespace(
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        intermediate_size=s["intermediate"],
        rms_norm_eps=s["rms_norm_eps"],
        rope_theta=s["rope_theta"],
        rope_scaling=s["rope_scaling"],
    )
    target = SimpleNamespace(info=info, config=hf)
    return train_spec(kind).arch(dc, SimpleNamespace(target=target, tokenizer=None))


ARCH = {"eagle3": eagle_arch, "ptd": eagle_arch, "dflash": block_arch}


class Ours:
    """One drafter of a kind (random weights, the preset's trainer choices applied) and its
    optimizer, reused across sequence lengths (one compilation, as in a real run)."""

    def __init__(self, kind: str, cfg, shapes: dict, device: torch.device, seed: int, k: int):
        from draftinfer.registry import drafter_spec
        from drafttrain.objectives.loss_fns import row_loss
        from drafttrain.objectives.ttt import pick_backend
        from drafttrain.registry import train_spec
        from drafttrain.trainer.optim import build_optimizer
        from drafttrain.trainer.wrap import apply_training_wrappers

        torch.manual_seed(seed)
        s, dc, tc = shapes, cfg.drafter, cfg.trainer
        self.kind, self.cfg, self.device, self.shapes = kind, cfg, device, shapes
        self.spec = train_spec(kind)
        # The trainer's row loss (`trainer.loss`, else the kind's default: dpace for eagle3,
        # ptd and dflash), as `drafttrain.jobs.train` builds the objective.
        self.loss = row_loss(tc.loss or self.spec.default_loss)
        self.arch = arch = ARCH[kind](kind, dc, s, k)
        dt = torch.bfloat16 if device.type == "cuda" else torch.float32
        # The target's head (random, bf16 on CUDA as a frozen 8B target's): [V, H].
        self.head_weight = torch.randn(s["vocab"], s["hidden"], device=device, dtype=dt)
        self.head_weight.mul_(4.0 / s["hidden"] ** 0.5)  # target logits of std ~4
        with torch.device(device):
            d = drafter_spec(kind).build(arch)
            if getattr(d, "d2t", None) is not None:  # a draft vocabulary: random ids
                ids = torch.randperm(s["vocab"])[: s["draft_vocab"]].sort().values
                d.d2t.copy_(ids - torch.arange(s["draft_vocab"]))
                d.t2d.zero_()
                d.t2d[ids] = True
        # A drafter that scores with the target's own head (frozen) holds a copy of it, as
        # its `init_drafter` attaches it (fp32 before the trainer's cast).
        self.head_trainable = d.lm_head.weight.requires_grad
        if not self.head_trainable and d.lm_head.weight.shape == self.head_weight.shape:
            with torch.no_grad():
                d.lm_head.weight.copy_(self.head_weight.float())
        apply_training_wrappers(d, self.spec.blocks(d), tc)
        self.drafter = d.train()
        self.params = [p for p in d.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, tc)
        # The trainer's choice (`drafter.attention_backend`, auto: flex on CUDA, eager on the
        # CPU); `--backends` times others in the same call.
        self.backend = pick_backend(cfg.drafter.attention_backend, device)
        self.autocast = device.type == "cuda" and tc.mixed_precision in ("auto", "bf16")
        self.target_dtype = dt
        self.trainable = sum(p.numel() for p in self.params)

    def objective(self, k: int):
        dc = copy.copy(self.cfg.drafter)
        if K_FIELD[self.kind]:
            setattr(dc, K_FIELD[self.kind], k)
        return self.spec.objective(self.drafter, dc, self.backend, self.loss)

    def inputs(self, seq_len: int, seed: int):
        from drafttrain.frozen.head import HeadLogits, TargetHead, TrainTargetOutput

        g = torch.Generator(device="cpu").manual_seed(seed)
        s, dev, T = self.shapes, self.device, seq_len
        ids = torch.randint(0, s["vocab"], (1, T), generator=g).to(dev)
        loss_mask = torch.ones(1, T, dtype=torch.long, device=dev)
        loss_mask[:, : max(1, T // 32)] = 0  # a prompt
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones(1, T, dtype=torch.long, device=dev),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(T, device=dev)[None],
        }
        dt = self.target_dtype
        width = self.arch.features.width(s["hidden"])  # the taps, concatenated
        features = torch.randn(1, T, width, device=dev, dtype=dt)
        final = torch.randn(1, T, s["hidden"], device=dev, dtype=dt)
        tgt = TrainTargetOutput(
            None,
            features,
            batch["position_ids"],
            torch.zeros(1, T, 0, device=dev, dtype=dt),
            head=HeadLogits(final, TargetHead(self.head_weight)),
        )
        return batch, tgt

    def step(self, objective, batch, tgt):
        tc = self.cfg.trainer
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, metrics = objective(batch, tgt)
        loss.backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def free(self) -> None:
        self.drafter = self.optimizer = self.params = self.head_weight = None


@contextmanager
def checkpointed(ours: Ours, on: bool):
    """Within: the drafter's blocks under activation checkpointing (wrapping the same,
    already compiled forwards: no new compilation); restored after."""
    from drafttrain.trainer.wrap import apply_activation_checkpointing

    blocks = ours.spec.blocks(ours.drafter) if on else []
    saved = [b.forward for b in blocks]
    apply_activation_checkpointing(blocks)
    try:
        yield
    finally:
        for b, f in zip(blocks, saved):
            b.forward = f


@contextmanager
def head_frozen(ours: Ours, on: bool):
    """Within: the drafter's `lm_head` frozen as `trainer.freeze=[lm_head]` freezes it (the
    peer's setting: speculators 0.9.0 trains neither head nor embeddings), its optimizer
    state set aside so the peak counts what a frozen-head run holds; restored after."""
    head = [ours.drafter.lm_head.weight] if on else []
    state = {p: ours.optimizer.state.pop(p) for p in head if p in ours.optimizer.state}
    trained = [p.requires_grad for p in head]
    for p in head:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, was in zip(head, trained):
            p.requires_grad_(was)
            p.grad = None
        ours.optimizer.state.update(state)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ours(ours: Ours, k: int, seq_len: int, steps: int, warmup: int, seed: int) -> dict:
    from drafttrain.objectives.losses import metric_values

    dev = ours.device
    cuda = dev.type == "cuda"
    objective = ours.objective(k)
    batch, tgt = ours.inputs(seq_len, seed)
    step_ms, peaks, metrics = [], [], None
    for i in range(warmup + steps):
        sync(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        metrics = ours.step(objective, batch, tgt)
        sync(dev)
        dt = time.perf_counter() - t0
        if i >= warmup:
            step_ms.append(dt * 1e3)
            peaks.append(torch.cuda.max_memory_allocated(dev) / GIB if cuda else 0.0)
    m = metric_values(metrics)
    row = {
        "tokens_per_s": statistics.median(seq_len / (ms / 1e3) for ms in step_ms),
        "step_ms": step_ms,
        "step_ms_median": statistics.median(step_ms),
        "peak_gib": max(peaks),
        "loss": m["loss"],
        "sim_al": m["sim_al"],
    }
    if ours.kind == "ptd":
        row["slots"] = {d: int(m[f"slots_{d}"]) for d in range(k)}
        row["acc"] = {d: m[f"acc_{d}"] for d in range(k)}
    if "anchors" in m:  # a block drafter: blocks (anchors) per sequence, slots per block
        block = ours.arch.block_size
        row["anchors"] = int(round(m["anchors"]))
        row["block_size"] = block
        row["block_rows"] = row["anchors"] * block
        row["block_al"] = m["block_al"]
        row["acc"] = {s: m[f"acc_{s}"] for s in range(1, block) if f"acc_{s}" in m}
    return row


def profile_ours(ours: Ours, k: int, seq_len: int, seed: int) -> dict:
    """One more step of ours (after its timed ones, so compiled and warm), twice: phase by
    phase between synchronizations (the target's distribution alone, then the objective's
    forward, backward, clipping, optimizer), and whole under `torch.profiler` for the CUDA
    kernels, summed by family. Returns {"text": report, "summary": one line}."""
    from torch.profiler import ProfilerActivity, profile

    from drafttrain.frozen.head import target_distribution

    dev, tc = ours.device, ours.cfg.trainer
    objective = ours.objective(k)
    batch, tgt = ours.inputs(seq_len, seed)
    phases: dict[str, float] = {}

    def timed(name, fn):
        sync(dev)
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        phases[name] = (time.perf_counter() - t0) * 1e3
        return out

    timed(
        "target_distribution (inside forward)",
        lambda: target_distribution(tgt, ours.drafter.draft_vocab_ids()),
    )
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=ours.autocast):
        loss, _ = timed("forward", lambda: objective(batch, tgt))
    timed("backward", loss.backward)
    if tc.grad_clip > 0:
        timed("clip", lambda: torch.nn.utils.clip_grad_norm_(ours.params, tc.grad_clip))
    timed("optimizer", ours.optimizer.step)
    ours.optimizer.zero_grad(set_to_none=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        ours.step(objective, batch, tgt)
        sync(dev)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or dev.type != "cuda"]
    attr = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) / 1e3 or 1.0
    families: dict[str, float] = {}
    for e in events:
        fam = kernel_family(e.key)
        families[fam] = families.get(fam, 0.0) + getattr(e, attr) / 1e3
    lines = [f"# profile: ours {ours.kind} K={k} seq {seq_len}", "", "## phases (ms)"]
    lines += [f"{v:10.2f}  {n}" for n, v in phases.items()]
    lines += ["", f"## kernel time by family (ms; total {total:.1f})"]
    lines += [
        f"{v:10.2f}  {100 * v / total:5.1f}%  {n}"
        for n, v in sorted(families.items(), key=lambda x: -x[1])
    ]
    lines += [
        "",
        "## top kernels",
        prof.key_averages().table(sort_by=attr, row_limit=45, max_name_column_width=90),
    ]
    summary = (
        f"profile {ours.kind} K={k} seq {seq_len}: "
        + ", ".join(f"{n.split(' ')[0]} {v:.1f}" for n, v in phases.items())
        + " | "
        + ", ".join(f"{n} {v:.1f}" for n, v in sorted(families.items(), key=lambda x: -x[1])[:6])
    )
    return {"text": "\n".join(lines) + "\n", "summary": summary}


def floor_ours(ours: Ours, k: int, seq_len: int, seed: int) -> dict:
    """One more step of ours, its GEMMs then replayed alone (`draftbench.gemm_floor`)."""
    from draftbench.gemm_floor import floor_of

    objective = ours.objective(k)
    batch, tgt = ours.inputs(seq_len, seed)
    return floor_of(lambda: ours.step(objective, batch, tgt), ours.device)


def floor_line(row: dict) -> str:
    """The row's GEMM floor in one line (or its error)."""
    from draftbench.gemm_floor import summary

    f = row.get("gemm_floor")
    return summary(f) if isinstance(f, dict) else f"GEMM floor failed: {f}"


def kernel_family(name: str) -> str:
    """A CUDA kernel's family, by its name (for the profile's breakdown)."""
    n = name.lower()
    for fam, keys in (
        ("flex attention", ("flex", "attention")),
        ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "wgmma", "matmul")),
        ("triton (inductor fused)", ("triton",)),
        ("reduce", ("reduce",)),
        (
            "elementwise / copy",
            ("elementwise", "copy", "cat", "fill", "index", "gather", "scatter"),
        ),
    ):
        if any(key in n for key in keys):
            return fam
    return "other"


def guarded(fn, base: dict, device: torch.device, cleanup=None) -> dict:
    """`fn()`'s row (`base` keys win); an out-of-memory or any failure becomes a row with
    `oom` / `error`; `cleanup()` runs after either."""
    row, error, oom = None, None, False
    try:
        row = fn()
    except torch.OutOfMemoryError as e:
        oom, error = True, (str(e).splitlines() or ["CUDA out of memory"])[0][:300]
    except Exception as e:  # noqa: BLE001 - a benchmark row must not end the run
        oom = "out of memory" in str(e).lower()
        error = f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[-1][:300]
        traceback.print_exc(limit=6, file=sys.stderr)
    if cleanup is not None:
        cleanup()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if row is not None:
        return {**row, **base, "oom": False}
    return {**base, "oom": oom, "error": error, "tokens_per_s": None, "peak_gib": None}


def peer_row(
    kind: str, k: int, seq_len: int, args, shapes: dict, device, optimizer: str = "muon", cfg=None
) -> dict:
    from draftbench import peer_speculators as peer

    s = shapes
    common = dict(
        seq_len=seq_len,
        hidden=s["hidden"],
        heads=s["heads"],
        kv_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        intermediate=s["intermediate"],
        vocab=s["vocab"],
        draft_vocab=s["draft_vocab"],
        steps=args.steps,
        warmup=args.warmup,
        device=str(device),
        dtype=torch.bfloat16,
        seed=args.seed,
    )
    if kind == "eagle3":
        out = peer.eagle3_train_step_bench(
            ttt_steps=k, optimizer=optimizer, gemm_floor=args.gemm_floor, **common
        )
    elif kind == "dflash":
        out = dflash_peer(k, seq_len, shapes, cfg.drafter, optimizer, common)
    else:
        out = peer.peagle_train_step_bench(k=k, **common)
    if out.get("step_ms"):
        out["step_ms_median"] = statistics.median(out["step_ms"])
    return out


def dflash_peer(k: int, seq_len: int, shapes: dict, dc, optimizer: str, common: dict) -> dict:
    """speculators 0.9.0's DFlash step at our row's shape: the preset's layers and taps, a
    block of k + 1, the whole target vocabulary (its CLI default and ours), and as many
    anchors as ours draws: it computes `max_anchors` blocks whatever the sequence holds, so
    it gets min(num_anchors, its anchor candidates) (num_anchors at seq 3072)."""
    from draftbench import peer_speculators_dflash as peer
    from draftinfer.kinds.dflash.taps import default_dflash_ids

    block = k + 1
    ids = list(dc.target_layer_ids) or default_dflash_ids(shapes["target_layers"], dc.num_layers)
    candidates = seq_len - max(1, seq_len // 32) - block  # its batch's prompt rule is ours
    return peer.dflash_train_step_bench(
        **{**common, "draft_vocab": None},
        block_size=block,
        num_layers=dc.num_layers,
        target_layer_ids=ids,
        max_anchors=max(1, min(dc.num_anchors, candidates)),
        optimizer=optimizer,
    )


PEER_ADAMW = ("eagle3", "dflash")  # kinds whose peer also runs with --optimizer adamw


def plan(
    seqs: list[int],
    kinds: list[tuple[str, int]],
    peer_ok: bool,
    ac_variant: bool,
    fh_variant: bool = False,
) -> list[tuple]:
    """Row order (most wanted first, in case the budget ends the run): the peer's EAGLE-3 at
    the first length (before ours compile: the peer resets torch.compile), ours grouped by
    kind (one drafter and one compilation per kind, per K for dflash; lengths in the given
    order, ptd's Ks interleaved, each followed by the same step with the head frozen, `ours+fh`, as the peer
    trains, where the kind trains its head at all; eagle3 then again with activation
    checkpointing at the first two lengths, `ours+ac`, the same compiled blocks), then the
    rest of the peer's, length by length. The peer's EAGLE-3 and DFlash at the first length
    run twice: with its CLI's default optimizer (Muon on the 2-D weights, AdamW on the rest)
    and with `--optimizer adamw` (`peer+adamw`, the optimizer our trainer uses)."""
    rows = []
    first = ("eagle3", 7, seqs[0])
    if peer_ok and ("eagle3", 7) in kinds:
        rows += [("peer", *first), ("peer+adamw", *first)]
    impls = ("ours", "ours+fh") if fh_variant else ("ours",)
    for name in dict.fromkeys(kind for kind, _ in kinds):
        ks = [k for kind, k in kinds if kind == name]
        # K in the architecture (dflash's block): one drafter per K, its lengths together.
        for group in [ks] if K_FIELD.get(name) else [[k] for k in ks]:
            for s in seqs:
                rows += [(i, name, k, s) for k in group for i in impls]
        if ac_variant and name == "eagle3":
            rows += [("ours+ac", kind, k, s) for s in seqs[:2] for kind, k in kinds if kind == name]
    if peer_ok:
        for s in seqs:
            for kind, k in kinds:
                if (kind, k, s) != first:
                    rows.append(("peer", kind, k, s))
                    if kind in PEER_ADAMW and s == seqs[0]:
                        rows.append(("peer+adamw", kind, k, s))
    return rows


VARIANT_LABELS = {"ours+ac": " (act. ckpt)", "ours+fh": " (head frozen, as the peer)"}


def markdown(rows: list[dict]) -> str:
    def cell(r, key, fmt):
        if r is None:
            return "-"
        if r.get("skipped"):
            return "skipped"
        if r.get("oom"):
            return "OOM"
        if r.get(key) is None:
            return "error"
        return fmt.format(r[key])

    ours = {
        (r["kind"], r["k"], r["seq_len"], r["impl"], r.get("backend") or ""): r
        for r in rows
        if not r["impl"].startswith("peer")
    }
    peer = {(r["kind"], r["k"], r["seq_len"]): r for r in rows if r["impl"] == "peer"}
    adamw = {(r["kind"], r["k"], r["seq_len"]): r for r in rows if r["impl"] == "peer+adamw"}
    lines = [
        "| kind | K | seq | ours tok/s | peer tok/s | speed ours/peer | ours GiB | peer GiB "
        "| mem ours/peer | peer (AdamW) tok/s | speed ours/peer (AdamW) "
        "| ours slots per depth (dflash: blocks x slots) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ok(r) -> bool:
        return r is not None and bool(r.get("tokens_per_s")) and not r.get("skipped")

    for key in sorted(ours):
        o, p = ours[key], peer.get(key[:3])
        speed = mem = "-"
        if ok(o) and ok(p):
            speed = f"{o['tokens_per_s'] / p['tokens_per_s']:.2f}x"
            if p.get("peak_gib"):
                mem = f"{o['peak_gib'] / p['peak_gib']:.2f}x"
        a = adamw.get(key[:3])
        speed_a = f"{o['tokens_per_s'] / a['tokens_per_s']:.2f}x" if ok(o) and ok(a) else "-"
        slots = "/".join(str(v) for v in o.get("slots", {}).values()) or "-"
        if o.get("anchors"):  # a block drafter: its blocks x slots per block
            slots = f"{o['anchors']} blocks x {o['block_size']}"
        peer_name = {"ptd": "peagle"}.get(key[0], key[0])
        lines.append(
            f"| {key[0]}{VARIANT_LABELS.get(key[3], '')}{f' [{key[4]}]' if key[4] else ''} "
            f"| {key[1]} | {key[2]} "
            f"| {cell(o, 'tokens_per_s', '{:.0f}')} "
            f"| {cell(p, 'tokens_per_s', '{:.0f}')} ({peer_name}) | {speed} "
            f"| {cell(o, 'peak_gib', '{:.1f}')} | {cell(p, 'peak_gib', '{:.1f}')} | {mem} "
            f"| {cell(a, 'tokens_per_s', '{:.0f}')} | {speed_a} | {slots} |"
        )
    return "\n".join(lines)


# The training bars (EAGLE-3 at seq 8192, TTT 7): our tokens/s over the AdamW
# peer's, head trained (ours) and head frozen (ours+fh); the floor table's budget column.
SPEED_BARS = {("eagle3", "ours"): 1.3, ("eagle3", "ours+fh"): 1.4}


def floor_table(rows: list[dict]) -> str:
    """The rows with a GEMM floor: step ms, the floor (ms, TFLOP, TFLOP/s), its share of the
    step, and for EAGLE-3 the step time the speed bar allows (the AdamW peer's step over
    the bar's factor, `SPEED_BARS`). Empty when no row has one."""
    with_floor = [r for r in rows if isinstance(r.get("gemm_floor"), dict)]
    if not with_floor:
        return ""
    adamw = {(r["kind"], r["k"], r["seq_len"]): r for r in rows if r["impl"] == "peer+adamw"}
    lines = [
        "| row | K | seq | step ms | GEMM floor ms | floor / step | TFLOP | TFLOP/s "
        "| bar's step budget ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in with_floor:
        f, step = r["gemm_floor"], r.get("step_ms_median")
        a = adamw.get((r["kind"], r["k"], r["seq_len"]))
        bar = SPEED_BARS.get((r["kind"], r["impl"]))
        budget = "-"
        if bar and a and a.get("step_ms_median"):
            budget = f"{a['step_ms_median'] / bar:.1f} ({bar}x AdamW peer)"
        share = f"{f['floor_ms'] / step:.2f}" if step else "-"
        rate = f"{f['tflop_per_s']:.0f}" if f.get("tflop_per_s") else "-"
        tag = f" [{r['backend']}]" if r.get("backend") else ""
        lines.append(
            f"| {r['impl']} {r['kind']}{tag} | {r['k']} | {r['seq_len']} "
            f"| {f'{step:.1f}' if step else '-'} "
            f"| {f['floor_ms']:.1f} | {share} | {f['tflop']:.1f} | {rate} | {budget} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON results (rewritten after every row)")
    ap.add_argument("--table-from", help="print the markdown table of a results JSON and exit")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (CPU smoke)")
    ap.add_argument("--seqs", default=None, help="comma list (default 8192,32768,2048,16384)")
    ap.add_argument("--kinds", default="eagle3:7,ptd:4,ptd:8", help="kind:K comma list")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no row after this")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument(
        "--impls",
        help="only these rows' impls, comma list (e.g. peer,peer+adamw: the peer's rows in a "
        "call of their own when ours and the peer's compilations do not fit one call)",
    )
    ap.add_argument(
        "--no-ac-variant",
        action="store_true",
        help="skip the eagle3 rows with activation checkpointing on (ours+ac)",
    )
    ap.add_argument(
        "--no-fh-variant",
        action="store_true",
        help="skip the rows with the drafter's lm_head frozen, as the peer trains (ours+fh)",
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="after each of our rows, profile one more step: phase times and the top CUDA "
        "kernels to DIR/profile_<impl>_<kind><k>_<seq>.txt",
    )
    ap.add_argument(
        "--gemm-floor",
        action="store_true",
        help="after each of our rows and the peer's EAGLE-3 rows, one more step's matrix "
        "products replayed alone (draftbench/gemm_floor.py): the step's GEMM time, a floor "
        "under its time; reported per row (gemm_floor) and as a column",
    )
    ap.add_argument(
        "--backends",
        help="time each of our rows once per attention backend, comma list (e.g. flex,flash,"
        "cudnn: drafter.attention_backend, drafttrain/objectives/ttt.py); default: the preset's",
    )
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        help="config override for both presets, e.g. trainer.activation_checkpointing=true",
    )
    args = ap.parse_args()
    if args.table_from:
        rows = json.loads(Path(args.table_from).read_text())["rows"]
        print(markdown(rows))
        if floors := floor_table(rows):
            print("\n" + floors)
        return
    if not args.out:
        ap.error("--out is required")
    t_start = time.perf_counter()
    device = torch.device(args.device)
    shapes = SHAPES["tiny" if args.tiny else "llama3.1-8b"]
    if args.seqs:
        seqs = [int(x) for x in args.seqs.split(",")]
    else:
        seqs = [128, 256] if args.tiny else [8192, 32768, 2048, 16384]
    kinds = [(k.split(":")[0], int(k.split(":")[1])) for k in args.kinds.split(",")]
    overrides = list(args.override)
    if (args.tiny or device.type != "cuda") and not any(
        o.startswith("trainer.compile=") for o in overrides
    ):
        overrides.append("trainer.compile=false")  # CPU: no inductor warm-up in a smoke run
    # One drafter per kind, several compiled instances of the same layer code: allow them.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    peer_ok, peer_reason = not args.no_peer, "--no-peer"
    if peer_ok:
        try:
            from draftbench import peer_speculators

            reason = peer_speculators.available()
        except ImportError as e:
            reason = f"draftbench.peer_speculators does not import: {e}"
        if isinstance(reason, str) and reason:
            peer_ok, peer_reason = False, reason
    if not peer_ok:
        print(f"peer skipped: {peer_reason}", flush=True)

    configs = {kind: compose(PRESETS[kind], overrides) for kind in {k for k, _ in kinds}}
    rows: list[dict] = []
    ours_by_kind: dict[str, Ours] = {}
    ac_variant = not args.no_ac_variant and not any(
        c.trainer.activation_checkpointing for c in configs.values()
    )
    fh_variant = not args.no_fh_variant and not any(
        "lm_head" in c.trainer.freeze for c in configs.values()
    )
    todo = plan(seqs, kinds, peer_ok, ac_variant, fh_variant)
    if args.impls:
        todo = [r for r in todo if r[0] in args.impls.split(",")]
    backends = args.backends.split(",") if args.backends else [None]
    todo = [(*r, b) for r in todo for b in ([None] if r[0].startswith("peer") else backends)]
    for impl, kind, k, seq, backend in todo:
        base = {"impl": impl, "kind": kind, "k": k, "seq_len": seq}
        if backend:
            base["backend"] = backend
        key = kind if K_FIELD[kind] else (kind, k)  # one drafter (and compilation) per key
        if impl == "ours+fh" and key in ours_by_kind and not ours_by_kind[key].head_trainable:
            continue  # the kind never trains its head (dflash: the target's): no such row
        # Seconds a row may need: the peer compiles afresh each call; ours once per key.
        need = 90 if impl.startswith("peer") else (30 if key in ours_by_kind else 120)
        if time.perf_counter() - t_start + need > args.budget_s:
            rows.append({**base, "skipped": True, "tokens_per_s": None, "peak_gib": None})
            print(f"skipped (budget): {base}", flush=True)
            continue
        t0 = time.perf_counter()
        if impl.startswith("peer"):
            for other in list(ours_by_kind):  # free our weights before the peer measures
                ours_by_kind.pop(other).free()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            optimizer = "adamw" if impl == "peer+adamw" else "muon"
            fn = partial(peer_row, kind, k, seq, args, shapes, device, optimizer, configs[kind])
            row = guarded(fn, base, device)
            if "gemm_floor" in row:
                print(f"{impl} {kind} K={k} seq {seq}: {floor_line(row)}", flush=True)
        else:
            for other in [o for o in ours_by_kind if o != key]:
                ours_by_kind.pop(other).free()
            gc.collect()
            if key not in ours_by_kind:
                ours_by_kind[key] = Ours(kind, configs[kind], shapes, device, args.seed, k)
            ours = ours_by_kind[key]
            if backend:
                from drafttrain.objectives.ttt import pick_backend

                ours.backend = pick_backend(backend, device)
            tc = configs[kind].trainer
            base["settings"] = {
                "param_dtype": tc.param_dtype,
                "master_weights": tc.master_weights,
                "optimizer_dtype": tc.optimizer_dtype,
                "compile": tc.compile,
                "activation_checkpointing": tc.activation_checkpointing,
                "num_layers": configs[kind].drafter.num_layers,
                "trainable_params": ours.trainable,
                "backend": ours.backend,
                "loss": ours.loss.name,
            }
            if kind == "ptd":
                dc = configs[kind].drafter
                base["settings"].update(
                    keep_ratio=dc.keep_ratio,
                    keep_floor=dc.keep_floor,
                    max_slots_per_seq=dc.max_slots_per_seq,
                )
            if kind == "dflash":
                dc = configs[kind].drafter
                base["settings"].update(
                    block_size=ours.arch.block_size,
                    num_anchors=dc.num_anchors,
                    loss_weights=dc.loss_weights,
                    gamma=dc.gamma,
                    tap_layer_ids=list(ours.arch.tap_layer_ids),
                )
            if impl == "ours+ac":
                base["settings"]["activation_checkpointing"] = True
            if impl == "ours+fh":
                base["settings"]["freeze"] = ["lm_head"]
                base["settings"]["trainable_params"] -= ours.drafter.lm_head.weight.numel()
            with checkpointed(ours, impl == "ours+ac"), head_frozen(ours, impl == "ours+fh"):
                row = guarded(
                    partial(time_ours, ours, k, seq, args.steps, args.warmup, args.seed + seq),
                    base,
                    device,
                    cleanup=partial(ours.optimizer.zero_grad, set_to_none=True),
                )
                if args.gemm_floor and not row.get("error"):
                    floor = guarded(
                        partial(floor_ours, ours, k, seq, args.seed + seq),
                        {},
                        device,
                        cleanup=partial(ours.optimizer.zero_grad, set_to_none=True),
                    )
                    floor.pop("oom", None)
                    row["gemm_floor"] = floor if not floor.get("error") else floor["error"]
                    print(f"{impl} {kind} K={k} seq {seq}: {floor_line(row)}", flush=True)
                if args.profile and not row.get("error"):
                    tag = f"_{backend}" if backend else ""
                    name = f"profile_{impl.replace('+', '_')}_{kind}{k}_{seq}{tag}.txt"
                    text = guarded(
                        partial(profile_ours, ours, k, seq, args.seed + seq),
                        {},
                        device,
                        cleanup=partial(ours.optimizer.zero_grad, set_to_none=True),
                    )
                    Path(args.profile).mkdir(parents=True, exist_ok=True)
                    (Path(args.profile) / name).write_text(text.get("text") or str(text))
                    print(text.get("summary") or text.get("error"), flush=True)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        brief = {
            key: row.get(key)
            for key in (
                "impl",
                "backend",
                "kind",
                "k",
                "seq_len",
                "tokens_per_s",
                "peak_gib",
                "oom",
            )
        }
        extra = {f: row.get(f) for f in ("slots", "anchors", "block_rows") if f in row}
        print(json.dumps({**brief, **extra, "error": row.get("error")}))
        sys.stdout.flush()
        write_result(args, device, shapes, peer_ok, peer_reason, overrides, configs, rows, t_start)
    write_result(args, device, shapes, peer_ok, peer_reason, overrides, configs, rows, t_start)
    print(markdown(rows))
    if floors := floor_table(rows):
        print("\n" + floors)


def write_result(args, device, shapes, peer_ok, peer_reason, overrides, configs, rows, t_start):
    """The JSON so far (rewritten after every row: a killed run keeps its rows)."""
    result = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shapes": shapes,
        "peer": None if peer_ok else peer_reason,
        "overrides": overrides,
        "trainer": {k: dataclasses.asdict(c.trainer) for k, c in configs.items()},
        "rows": rows,
        "wall_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
