"""One speculative round vs one plain decode step, through the real engine, at real shapes.

    python -m draftbench.round --out docs/results/$(date +%F)_h200_round.json        # CUDA
    python -m draftbench.round --device cpu --tiny --batches 1 --ks 2,3        # smoke test
    python -m draftbench.round --kinds dflash --ks dflash:7 --verify-threshold 0.5   # the cut

Shapes: the target is Llama-3.1-8B (32 layers, hidden 4096, 32/8 heads, ffn 14336, vocab
128256, llama3 RoPE); drafters are 8B-sized EAGLE-3 (1 layer) and ptd (2 layers, K <= 8), draft
vocabulary 32000. Weights are random bf16 (time does not depend on training).

MLA + MoE (`--targets glm-4.7-flash`, `draftbench.shapes.GLM_4_7_FLASH`; ~60 GB in bf16, one
GPU): no gpt-fast peer (its MoE model has no latent attention); the plain step is measured
against the copy bandwidth of this process (`floor`: the weights a step reads, i.e. attention,
the dense first layer, the shared experts, the routed experts its tokens touch, plus the
latent cache, 576 values per position per layer), printed as achieved bandwidth and fraction
of the copy bandwidth; `--reference-targets llama3.1-8b` times the dense target's plain step
first in the same process (no rounds), its fraction printed beside. `--kinds mtp` on it is the
target's own MTP layer, as `drafter=native` serves it (N = 1, reused at K > 1: `--ks 1,2,3`).
The target attends through `draftinfer.models.mla.LatentAttention` (the runner's fused
attention kernel does not take MLA): torch ops (`index_put_` write, gather of the rows,
SDPA over the 576-wide latent with a boolean mask, `kv_b_proj` absorbed by einsum), no host
sync; the sync check and the graphed rounds are the GPU run's to confirm.

    python -m draftbench.round --targets glm-4.7-flash --reference-targets llama3.1-8b \
        --kinds mtp --ks 1,2,3 --batches 1,8 --plain runner \
        --out docs/results/$(date +%F)_h200_round_glm47flash_mtp.json

- t_plain: one compiled plain decode step (`torch.compile(target_forward, dynamic=False)`),
  the median over a run of steps at advancing positions (CUDA-event timed per step, the host
  queueing the next step without a sync between them, as in generation), in the same
  process.
- t_round(kind, K, batch): `SpecDecoder.generate` over `--context`-token prompts; each round
  ends in the engine's one readback, so the wall time between consecutive readbacks is the
  round (the engine records it); the median after warm-up. The engine launches each round
  before reading the previous one back (`--pipeline on`, its CUDA default), so that time is
  the device's time per round; `--pipeline off` waits for each readback before the next
  launch (the host's part of a round then adds to it; `both` times each way). Positions advance as in real
  generation (with random weights almost every draft is rejected: one new position per
  round, never a revisited length; a round's cost does not depend on how many drafts were
  accepted, its shapes are fixed). The target's verify forward (and, with `--compile all`,
  the drafter forwards) is compiled with dynamic shapes and bucketed attention lengths; with
  `--round-graphs on` (the default; `both` times each configuration both ways) the engine
  replays the whole round from a CUDA graph captured per attention bucket
  (`SpecDecoder(cuda_graphs=True)`, `draftinfer.decoding.graphs`).
- t_gptfast (`--peer-dir`, default `peers/gpt-fast`, fetched by `scripts/fetch_peers.sh`):
  gpt-fast's compiled decode step (`draftbench.decode_peer`: its `model.py`, its generate.py's
  `decode_one_token` and inductor settings, CUDA graphs) at the same batch and context, in the
  same process, before our target is built: the best plain decoder a user could run instead
  (DESIGN section 7). The table leads with t_round / t_gptfast.
- ratio = t_round / t_plain; the speedup at acceptance length a is a * t_plain / t_round.
- `--breakdown`: where a graphed round's time goes, each piece replayed from a CUDA graph
  (`draftbench.timing.graph_ms`) at the round's shapes: the target's verify forward over K+1
  slots (compiled as the engine compiles it), the proposer's `propose` (after a real run, so
  its caches hold a prompt), and the rest of the round (verification, next first pass, the
  upload and readback, host work) as t_round minus the two. The rest splits into
  `t_bookkeeping_ms` (the whole round's tensor work replayed as one graph, minus verify and
  propose) and `t_host_ms` (t_round minus that graph: time the device waits for the host).
  `--profile N` adds the top device kernels of verify and propose (N graph replays under
  torch.profiler, us per call), printed after the table. Under programmatic dependent launch
  (`--inductor default`) a kernel starts before the one ahead of it ends and its duration
  counts the wait: the sums then exceed the piece's time (a dflash verify's kernels summed to
  9.7 ms of its 5.8 on an H100, 2026-11-27); attribute with `--inductor nopdl`.
- `--fuse`: also time every configuration on the runner's CUDA default GEMMs
  (`draftinfer.evaluation.run.serving_transforms`): target's and drafters' q/k/v and gate/up fused
  (`draftinfer.models.transforms.fuse_projections`, the same weights) and GEMMs of <= 16 rows
  of target and drafters by the skinny-GEMM kernel (`use_skinny_gemm`; `--no-skinny`: cuBLAS),
  SwiGLU's product as the gate/up GEMM's epilogue (`--swiglu on`, the runner's default; `off`
  runs it after the GEMM, `both` times each way in one process), the target's decoder layers'
  RMSNorms and residual adds inside those GEMMs (`--norms on`, the runner's default; `off`, `both`).

Before timing: a sync check (K=4, each kind, each batch, rounds under
`torch.cuda.set_sync_debug_mode("error")`) and a losslessness check (speculative tokens equal
plain greedy tokens up to the first position whose top-2 margin is below 0.1 logits, bf16).
The table is printed last; full numbers go to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from draftkernels.runtime import enable_pdl, pdl

from draftbench.shapes import (
    DRAFT_VOCAB,
    GLM_4_7_FLASH,
    GPT_OSS_20B,
    LLAMA31_8B,
    QWEN3_30B_A3B,
    QWEN3_VL_8B,
    TINY,
    TINY_GLM_4_7_FLASH,
    TINY_GPT_OSS,
    TINY_QWEN3_MOE,
    TINY_VL,
    bench_drafter_arch,
    hf_config,
    moe_peer_shape,
    native_shape,
    random_llama_target,
    random_native_target,
    vl_native_shape,
)
from draftinfer.decoding.compiled import RUNNER_CUDA_OPTIONS, runner_compile_options


def build_drafter(kind: str, target, shape: dict, draft_vocab: int, k_max: int, device, dtype):
    from draftinfer.registry import drafter_spec

    spec = drafter_spec(kind)
    arch = bench_drafter_arch(kind, shape, draft_vocab, k_max)
    torch.manual_seed(1)
    d = spec.build(spec.config_class(**arch))
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    spec.attach_shared(d, target.shared_weights())
    return d.to(device=device, dtype=dtype).eval()


def build_released_drafter(target, shape: dict, device, dtype):
    """The drafter the target's own checkpoint ships, as `drafter=native` serves it
    (`draftinfer.files.checkpoint.released_drafter_config`: GLM-4.7-Flash's and DeepSeek-V3's
    MTP layer `model.layers.{L}`, the family's own layer, N = `num_nextn_predict_layers`,
    `step % N` for K > N), random weights (vectors as built, the rest N(0, 0.02), seed 1), built
    on the meta device and materialised on `device` (no fp32 copy on the host)."""
    from draftinfer.models.rope import RotaryEmbedding
    from draftinfer.registry import FAMILIES, drafter_spec

    config = hf_config(shape).to_dict()
    if not config.get("architectures"):
        config["architectures"] = [type(target).__name__]
    family = FAMILIES.for_architectures(config["architectures"])
    spec = drafter_spec("mtp")
    arch = spec.released_arch(config, family)
    if arch is None:
        raise SystemExit(f"bench_round: {config['architectures'][0]} ships no MTP layer")
    with torch.device("meta"):
        d = spec.build(arch)
    d = d.to(dtype=dtype).to_empty(device=device)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            elif name.endswith("bias"):
                p.zero_()
            else:  # norms
                p.fill_(1.0)
    for m in d.modules():  # the rotary's tables, computed again (`to_empty` left them unset)
        if isinstance(m, RotaryEmbedding):
            m.reset_parameters(device)
    spec.attach_shared(d, target.shared_weights())
    return d.eval()


def plain_step_ms(
    target,
    batch: int,
    context: int,
    steps: int,
    device,
    mode: str | None = None,
    reqs=None,
    options: dict | None = None,
) -> tuple[float, list]:
    """Median ms of one compiled greedy decode step at advancing positions, and its tokens.
    `mode="reduce-overhead"`: the step replayed as a CUDA graph (inductor's); `mode="runner"`:
    the runner's own plain baseline (`draftinfer.decoding.baseline.PlainStep`: compiled with
    dynamic shapes, replayed from our CUDA graph per attention bucket), what `python -m
    draftinfer`'s report measures speculative decoding against."""
    from draftinfer.conventions.slots import Slots, attn_bucket
    from draftinfer.decoding.compiled import compiled, target_forward

    rows = torch.arange(batch, device=device)
    if reqs is None:
        reqs = [(p, None) for p in prompts(batch, context, target.config.vocab_size)]
    ids = torch.tensor([r[0] for r in reqs], device=device)
    # Eager prefill, per request in 512-token chunks through the target's prefill seam (with
    # each request's image): exactly the engine's prefill, so both paths start from the same
    # bf16 numerics.
    last = []
    for b in range(batch):
        pos = torch.arange(context, device=device)[None]
        plan = target.prefill_plan(ids[b : b + 1], pos, rows[b : b + 1], [reqs[b][1]])
        for s in range(0, context, 512):
            cols = slice(s, min(s + 512, context))
            inputs, rope = plan.chunk(cols)
            logits = target(inputs, Slots(rows[b : b + 1], pos[:, cols], rope)).logits
        last.append(logits[0, -1])
    last = torch.stack(last).float()
    tok = last.argmax(-1)
    attn_len = attn_bucket(context + steps + 16, target.max_seq_len)
    options = runner_compile_options(options, device)  # None: the runner's default
    opts = {"options": options} if options else {}
    runner = None
    if mode == "runner":
        from draftinfer.decoding.baseline import PlainStep

        runner = PlainStep(target, True, device.type == "cuda", options)
        step = None
    elif mode is None:
        step = compiled(target_forward, dynamic=False, **opts)
    else:  # CUDA graphs need static cache addresses
        for layer in target.model.layers:
            for name in ("k_cache", "v_cache", "latent_cache"):  # MLA: the latent alone
                if getattr(layer.self_attn, name, None) is not None:
                    torch._dynamo.mark_static_address(getattr(layer.self_attn, name))
        if options:  # torch.compile takes a mode or options, not both
            opts = {"options": {**options, "triton.cudagraphs": True}}
        else:
            opts = {"mode": mode}
        step = compiled(target_forward, dynamic=False, **opts)
    top2 = last.topk(2, dim=-1).values
    toks, gaps = [tok], [top2[:, 0] - top2[:, 1]]
    events, times = [], []
    # No host sync between steps (as in generation, and as `decode_peer` times gpt-fast): the
    # host queues step s + 1 while the device runs step s, so CUDA events around a step time
    # the device, not the host's launch of a graph replay after a sync.
    for s in range(steps):
        cache = torch.full((batch, 1), context + s, device=device)
        rope = target.rope_positions(cache, rows)  # M-RoPE: cache + mrope_delta, 3 axes
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
        t0 = time.perf_counter()
        if runner is not None:
            logits = runner(tok[:, None], cache, rows, attn_len)
        else:
            logits, _ = step(target, tok[:, None], rows, cache, rope, attn_len, (), None)
        logits = logits.clone()  # a graph replay overwrites its output buffer
        if device.type == "cuda":
            end.record()
            events.append((start, end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
        top2 = logits[:, 0].float().topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
        tok = logits[:, 0].argmax(-1)
        toks.append(tok)
    if events:
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    table = torch.stack(toks, 1).tolist()
    margins = torch.stack(gaps).tolist()  # [step][row]
    return statistics.median(times[3:]), [table, margins]


@torch.no_grad()
def gpt_fast_step(shape, batch, context, steps, device, dtype, max_len, peer_dir, moe=None) -> dict:
    """gpt-fast's compiled, CUDA-graphed decode step at `batch` x `context` (its generate.py's
    `decode_one_token` and inductor settings; `draftbench.decode_peer`), timed in this process
    and freed again: {ms (median), warmup_s, same_first_token_as_eager}. `moe`: the
    `mixtral-moe/model.py` Transformer with these `ModelArgs` (`shapes.moe_peer_shape`) in
    place of the dense one (then also `step_bytes`, its floor's numerator: `draftbench.floor`
    with each token's top-k experts gathered, as its `ConditionalFeedForward` reads them)."""
    from types import SimpleNamespace

    from draftbench import decode_peer as dp

    if moe is None:
        gf = dp.load_gpt_fast(peer_dir)
        model = dp.build_gpt_fast(gf, shape, device, dtype, batch, max_len)
    else:
        gf = dp.load_gpt_fast(peer_dir, "mixtral-moe/model.py")
        model = dp.build_gpt_fast_moe(gf, moe, device, dtype, batch, max_len)
    vocab = model.tok_embeddings.weight.shape[0]
    ids = torch.tensor(prompts(batch, context, vocab), device=device)
    # Prefill in chunks: the MoE model gathers each token's experts' weights (eager, a
    # 600-token prompt would gather 37 GB at gpt-oss-20b's sizes).
    chunk = context if moe is None else 16
    for s in range(0, context, chunk):
        pos = torch.arange(s, min(s + chunk, context), device=device)
        logits = model(ids[:, pos], pos)
    tok0 = logits[:, -1].argmax(-1)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        pos = torch.tensor([context], device=device)
        eager_first = dp.gpt_fast_decode_one_token(model, tok0.view(-1, 1).int(), pos).long()
    a = SimpleNamespace(compile=True, context=context, steps=steps, profile=0)
    with torch._inductor.config.patch(dp.GPT_FAST_INDUCTOR):
        r = dp.run_gpt_fast(model, a, device, tok0, eager_first, warm=3)
    keep = ("ms", "ms_mean", "warmup_s", "same_first_token_as_eager")
    out = {k: r[k] for k in keep}
    if moe is not None:
        out["step_bytes"] = peer_moe_step_bytes(model, moe, batch, max_len)
    dp.reset_compile_state()
    del model
    torch.cuda.empty_cache()
    return out


def peer_moe_step_bytes(model, moe: dict, batch: int, max_len: int) -> int:
    """Bytes gpt-fast's MoE step reads at `batch`: every weight but the embedding table and the
    experts, one embedding row per token, `batch * top-k` experts per layer (gathered per
    token), and its whole K/V cache (it attends over all `max_len` positions, masked)."""

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    emb = model.tok_embeddings.weight
    experts = [p for layer in model.layers for p in layer.block_sparse_moe.cond_ffn.parameters()]
    ids = {id(p) for p in experts}
    weights = nbytes(p for p in model.parameters() if p is not emb and id(p) not in ids)
    per_layer = nbytes(model.layers[0].block_sparse_moe.cond_ffn.parameters())
    per_expert = per_layer // moe["num_experts"]
    routed = len(model.layers) * batch * moe["num_activated_experts"] * per_expert
    kv = nbytes(b for layer in model.layers for b in layer.attention.kv_cache.buffers())
    return weights + batch * emb[0].nbytes + routed + kv


def breakdown_ms(dec, target, k: int, context: int, profile: int = 0) -> dict:
    """Device ms of the pieces of a round at its shapes, each replayed from a CUDA graph: the
    target's verify forward over K+1 slots and a one-slot forward through the same compiled
    function, and the proposer's `propose` on the decoder's last first pass. `profile` > 0:
    also the top device kernels of verify and propose per call (`profile` graph replays under
    torch.profiler), as `kernels_verify` / `kernels_one_slot` (a plain step's kernels) /
    `kernels_propose`."""
    from draftbench.decode_peer import kernel_table
    from draftbench.timing import captured, graph_ms
    from draftinfer.conventions.slots import attn_bucket
    from draftinfer.decoding.proposer import greedy_chooser

    B, dev = dec.max_batch, dec.device
    rows, f = dec.rows, dec.features
    attn_len = attn_bucket(min(context + 64 + k, dec.max_model_len), dec.max_model_len)
    out = {}
    for name, T in (("verify", k + 1), ("one_slot", 1)):
        ids = torch.randint(5, 1000, (B, T), device=dev)
        cache = context + torch.arange(T, device=dev)[None].expand(B, T)
        rope = target.rope_positions(cache, rows)

        def fwd(ids=ids, cache=cache, rope=rope):
            dec._target_fwd(
                target, ids, rows, cache, rope, attn_len, f.layer_inputs, f.final_hidden
            )

        out[f"t_{name}_ms"] = round(graph_ms(fwd), 4)
        if profile:
            g = captured(fwd)
            out[f"kernels_{name}"] = kernel_table(dev, profile, lambda s, g=g: g.replay())
    fp = dec.fp
    num = torch.full((B,), k, dtype=torch.long, device=dev)

    def propose():
        dec.proposer.propose(fp, num, k, greedy_chooser, attn_len)

    out["t_propose_ms"] = round(graph_ms(propose), 4)
    if profile:
        g = captured(propose)
        out["kernels_propose"] = kernel_table(dev, profile, lambda s: g.replay())
    # The whole round's tensor work (the graphed function itself) on the last round's state:
    # t_round minus this is host time the device waits through (input upload, launch,
    # readback, the host's bookkeeping); this minus verify and propose is the bookkeeping
    # kernels inside the round.
    # Every row live at the prompt's length, set by the host (the upload's four rows).
    up = torch.tensor([[context + 64] * B, [64] * B, [1] * B, [1] * B], device=dev)
    state = (*dec.fp.tensors(), dec.pending_token, dec.carry, up)
    out["t_round_graph_ms"] = round(graph_ms(lambda: dec._round_tensors(*state, attn_len, True)), 4)
    return out


# `--inductor`: settings our compiled round (and plain step) runs with. `default`: the
# runner's compiled CUDA default, programmatic dependent launch for inductor's kernels and
# ours (both set by the one switch `draftkernels.runtime.enable_pdl`; `InferConfig.pdl`) and
# inductor's combo kernels (independent kernels, e.g. a layer's query RoPE and its key RoPE +
# cache write, horizontally fused into one launch; `draftinfer.decoding.compiled.RUNNER_CUDA_OPTIONS`,
# the default since 2026-11-27); `nopdl` without PDL; `nocombo` without combo kernels (the
# default before that); `cdt` the default plus coordinate descent tuning; `pdl` and
# `combo` name what `default` is now (still accepted).
INDUCTOR_OPTIONS = {
    "default": None,
    "nopdl": None,
    "pdl": None,
    "nocombo": {},
    "cdt": {**RUNNER_CUDA_OPTIONS, "coordinate_descent_tuning": True},
    "combo": None,
}
KERNEL_PDL = {"default", "pdl", "nocombo", "cdt", "combo"}


@torch.no_grad()
def floor(target, batch: int, context: int, device) -> dict:
    """The memory floor of one plain decode step of `target` at `batch` x `context`
    (`draftbench.floor`: the experts counted from one eager step's routes of random tokens),
    over the copy bandwidth measured here: {bytes by part, bandwidth B/s, floor_ms}."""
    from draftbench.decode_peer import copy_bandwidth
    from draftbench.floor import routed_experts, step_bytes
    from draftinfer.conventions.slots import attn_bucket

    rows = torch.arange(batch, device=device)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(5, target.config.vocab_size, (batch, 1), generator=g).to(device)
    cache = torch.full((batch, 1), context, device=device)
    rope = target.rope_positions(cache, rows)
    attn_len = attn_bucket(context + 1, target.max_seq_len)
    touched = routed_experts(target, tokens, rows, cache, rope, attn_len)
    parts = step_bytes(target, batch, context, touched)
    bw = copy_bandwidth(device, 1 << 30)
    return {
        **parts,
        "experts_touched": touched,
        "bandwidth": bw,
        "floor_ms": round(parts["total"] / bw * 1e3, 4),
    }


def prompts(batch: int, context: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(5, vocab, (batch, context), generator=g).tolist()


def image_prompts(target, batch: int, context: int, grid=(1, 32, 32)):
    """`context`-token prompts with one image each (`grid` patches, `t*h*w / merge^2` image
    tokens between vision start/end, 16 text tokens after it) -> (ids, mm_inputs) per request,
    pixel values random (time does not depend on them). None for a text target."""
    hf = getattr(target.config, "hf_config", None)
    if hf is None:
        return None
    v = hf.vision_config
    t, h, w = grid
    n_img = t * h * w // v.spatial_merge_size**2
    g = torch.Generator().manual_seed(6)
    special = min(hf.image_token_id, hf.video_token_id, hf.vision_start_token_id)
    out = []
    for ids in prompts(batch, context, special):
        head = context - n_img - 2 - 16
        ids = ids[:head] + [hf.vision_start_token_id] + [hf.image_token_id] * n_img
        ids = ids + [hf.vision_end_token_id] + prompts(1, 16, special)[0]
        dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
        mm = {
            "pixel_values": torch.randn(t * h * w, dim, generator=g),
            "image_grid_thw": torch.tensor([list(grid)]),
            "mm_token_type_ids": torch.tensor([int(i == hf.image_token_id) for i in ids]),
        }
        out.append((ids, mm))
    return out


def run_spec(
    target,
    drafter,
    k,
    batch,
    context,
    rounds,
    device,
    compile_mode,
    sync_check=False,
    reqs=None,
    graphs=False,
    options=None,
    pipeline=None,
    verify_threshold=None,
):
    from draftinfer.decoding.engine import Request, SpecDecoder

    dec = SpecDecoder(
        target,
        drafter,
        k,
        max_batch=batch,
        max_model_len=target.max_seq_len,
        compile=compile_mode,
        cuda_graphs=graphs,
        compile_options=options,
        pipeline=pipeline,
        verify_threshold=verify_threshold,
    )
    if reqs is None:
        reqs = [(p, None) for p in prompts(batch, context, target.config.vocab_size)]
    dec.sync_check = False  # warm-up: compile, autotune, allocate (these may sync)
    dec.generate([Request(p, max_tokens=6, mm_inputs=mm) for p, mm in reqs])
    dec.sync_check = sync_check
    outs, stats = dec.generate([Request(p, max_tokens=rounds + 1, mm_inputs=mm) for p, mm in reqs])
    return outs, stats, dec


TARGETS = {  # name -> (builder, shape); DRAFT_VOCAB[name] is the drafters' vocabulary
    "llama3.1-8b": ("llama", LLAMA31_8B),
    "qwen3-vl-8b": ("vl", QWEN3_VL_8B),
    "gpt-oss-20b": ("moe", GPT_OSS_20B),
    "qwen3-30b-a3b": ("moe", QWEN3_30B_A3B),
    # MLA + MoE: no gpt-fast peer (section 7: against the copy bandwidth); `--kinds mtp` times
    # the target's own MTP layer (`build_released_drafter`).
    "glm-4.7-flash": ("mla", GLM_4_7_FLASH),
    "tiny": ("llama", TINY),
    "tiny-vl": ("vl", TINY_VL),
    "tiny-gpt-oss": ("moe", TINY_GPT_OSS),
    "tiny-qwen3-moe": ("moe", TINY_QWEN3_MOE),
    "tiny-glm-4.7-flash": ("mla", TINY_GLM_4_7_FLASH),
}


def bench_target(name: str, a, device, dtype, batches, ks, kinds) -> dict:
    """Every row of the table for one target (built here, freed by the caller)."""
    builder, shape = TARGETS[name]
    max_len = 1024 if a.context + a.rounds + 32 <= 1024 else 2048
    t0 = time.perf_counter()
    res = {
        "shape": name,
        "prompts": "one image each" if builder == "vl" else "text",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "context": a.context,
        "compile": a.compile,
        "round_graphs": a.round_graphs,
        "skinny_gemm": not a.no_skinny,
        "gpt_fast": {},
        "plain": {},
        "sync_check": {},
        "lossless": {},
        "rows": [],
    }
    # gpt-fast first, alone on the device and on a process that has compiled nothing yet:
    # its dense model for a dense target, its mixtral-moe model for a MoE one; none for a
    # Qwen3-VL or an MLA target (gpt-fast has neither vision nor latent attention).
    moe = moe_peer_shape(shape) if builder == "moe" else None
    peer_file = a.peer_dir / ("mixtral-moe/model.py" if moe else "model.py")
    peer = device.type == "cuda" and builder in ("llama", "moe") and peer_file.is_file()
    for b in batches if peer else []:
        res["gpt_fast"][b] = gpt_fast_step(
            shape, b, a.context, a.rounds + 8, device, dtype, max_len, a.peer_dir, moe
        )
        print(json.dumps({"gpt_fast": b, **res["gpt_fast"][b]}), flush=True)
    if builder == "vl":
        from transformers import Qwen3VLConfig

        hf = Qwen3VLConfig(**shape)
        target = random_native_target(hf, device, dtype, max(batches), max_len)
        dshape = vl_native_shape(shape)
    elif builder in ("moe", "mla"):
        target = random_native_target(hf_config(shape), device, dtype, max(batches), max_len)
        dshape = native_shape(target.config, shape["drafter_mlp"])
    else:
        target = random_llama_target(shape, device, dtype, max(batches), max_len)
        dshape = shape
    # The memory floor of a plain step (a Qwen3-VL target's text decoder is not counted apart).
    res["floor"] = {b: floor(target, b, a.context, device) for b in batches if builder != "vl"}
    for b, g in res["gpt_fast"].items():
        if "step_bytes" in g:
            g["floor_ms"] = round(g["step_bytes"] / res["floor"][b]["bandwidth"] * 1e3, 4)
    print(json.dumps({"floor": res["floor"]}), flush=True)
    drafters = {}
    for kind in kinds:
        if kind == "mtp" and builder == "mla":  # the released layer (`drafter=native`)
            drafters[kind] = build_released_drafter(target, shape, device, dtype)
            res["mtp_drafter"] = f"released (drafter=native), N={drafters[kind].config.n_predict}"
            continue
        vocab = DRAFT_VOCAB[name]
        drafters[kind] = build_drafter(kind, target, dshape, vocab, max(ks[kind]), device, dtype)
    res["build_s"] = round(time.perf_counter() - t0, 1)
    swiglus = {"on": [True], "off": [False], "both": [False, True]}[a.swiglu]
    normss = {"on": [True], "off": [False], "both": [False, True]}[a.norms]
    combos = [(s, n) for s in swiglus for n in (normss if s else [False])]
    for fused in [True] if a.fuse_only else [False, True] if a.fuse else [False]:
        for i, (swiglu, norms) in enumerate(combos if fused else [(False, False)]):
            if fused:
                from draftinfer.models.transforms import fuse_projections, use_skinny_gemm

                for module in [target, *drafters.values()]:
                    if i == 0:  # same weights, one GEMM for q/k/v and for gate/up
                        fuse_projections(module)
                    use_skinny_gemm(module, on=not a.no_skinny, swiglu=swiglu, norms=norms)
                torch._dynamo.reset()  # recompile every function over the changed modules
            sw = fused and swiglu
            nm = False  # the target's layers run their norms in the GEMMs (CUDA only)
            if fused:
                from draftinfer.models.transforms import NormFusedDecoderLayer

                nm = any(isinstance(m, NormFusedDecoderLayer) for m in target.modules())
                if norms and not nm and len(normss) > 1:
                    print("--norms both: this target's layers cannot fuse their norms here")
                    continue
            for j, setting in enumerate(a.inductor.split(",")):
                if j:
                    torch._dynamo.reset()
                enable_pdl(setting in KERNEL_PDL)  # for what is compiled and captured next
                for b in batches:
                    bench_batch(
                        a, res, target, drafters, b, ks, device, sw, name, fused, setting, nm
                    )
                enable_pdl(False)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    return res


def bench_batch(
    a, res, target, drafters, b, ks, device, swiglu, name, fused, setting="default", norms=False
) -> None:
    """The plain steps and every (kind, K, graphs) round at batch `b` under the inductor
    `setting`, appended to `res`."""
    tag = f"{b}{' fused' if fused else ''}{' swiglu' if swiglu else ''}{' norms' if norms else ''}"
    tag += "" if setting == "default" else f" {setting}"
    opts = INDUCTOR_OPTIONS[setting]
    reqs = image_prompts(target, b, a.context)
    t1 = time.perf_counter()
    graph_ms, ms = float("nan"), float("nan")
    if a.plain == "runner" and device.type == "cuda":
        # Only the runner's baseline: the reference tokens and the round's cost unit.
        ms, (plain_tokens, margins) = plain_step_ms(
            target, b, a.context, a.rounds + 8, device, "runner", reqs, opts
        )
        res["plain"][tag] = {"ms": float("nan"), "runner_step_ms": round(ms, 4)}
        res["plain"][tag]["first_call_s"] = round(time.perf_counter() - t1, 1)
    elif not a.graph_only or device.type != "cuda":
        ms, (plain_tokens, margins) = plain_step_ms(
            target, b, a.context, a.rounds + 8, device, reqs=reqs, options=opts
        )
    if a.plain != "runner" or device.type != "cuda":
        res["plain"][tag] = {"ms": round(ms, 4), "first_call_s": round(time.perf_counter() - t1, 1)}
    if device.type == "cuda" and not a.no_graph and a.plain != "runner":
        graph_ms, (graph_tokens, graph_margins) = plain_step_ms(
            target, b, a.context, a.rounds + 8, device, "reduce-overhead", reqs, opts
        )
        res["plain"][tag]["cuda_graph_ms"] = round(graph_ms, 4)
        runner_ms, _ = plain_step_ms(
            target, b, a.context, a.rounds + 8, device, "runner", reqs, opts
        )
        res["plain"][tag]["runner_step_ms"] = round(runner_ms, 4)
        if a.graph_only:
            plain_tokens, margins = graph_tokens, graph_margins
        else:
            res["plain"][tag]["cuda_graph_same_tokens"] = graph_tokens == plain_tokens
    fl = res.get("floor", {}).get(b)
    if fl:  # the plain step's achieved bandwidth: the floor's bytes over its time
        base = plain_base_ms(res["plain"][tag])
        res["plain"][tag]["achieved_bandwidth"] = round(fl["total"] / base * 1e3)
        res["plain"][tag]["fraction_of_copy"] = round(fl["floor_ms"] / base, 4)
    gf_ms = res["gpt_fast"].get(b, {}).get("ms", float("nan"))
    for kind, d in drafters.items():
        k4 = 4 if 4 in ks[kind] else max(ks[kind])
        # Sync check: any host-device sync inside a round raises.
        if a.no_sync_check:
            res["sync_check"][f"{kind} K={k4} b={tag}"] = "skipped"
        else:
            try:
                run_spec(
                    target,
                    d,
                    k4,
                    b,
                    a.context,
                    4,
                    device,
                    a.compile,
                    True,
                    reqs,
                    False,
                    opts,
                    verify_threshold=a.verify_threshold,
                )
                res["sync_check"][f"{kind} K={k4} b={tag}"] = "no sync"
            except RuntimeError as e:
                res["sync_check"][f"{kind} K={k4} b={tag}"] = f"SYNC: {str(e).splitlines()[0]}"
        modes = {"on": [True], "off": [False], "both": [False, True]}[a.round_graphs]
        ahead = {"on": [True], "off": [False], "both": [False, True]}[a.pipeline]
        for k, graphs, pipe in ((k, g, p) for k in ks[kind] for g in modes for p in ahead):
            if graphs and device.type != "cuda":
                continue
            t2 = time.perf_counter()
            outs, stats, dec = run_spec(
                target,
                d,
                k,
                b,
                a.context,
                a.rounds,
                device,
                a.compile,
                reqs=reqs,
                graphs=graphs,
                options=opts,
                pipeline=pipe,
                verify_threshold=a.verify_threshold,
            )
            rt = stats["round_seconds"][2:]
            t_round = statistics.median(rt) * 1e3
            # Lossless up to the first low-margin position (bf16 batched-verify rounding):
            # margins[j][i] is row i's top-2 margin where token j was chosen.
            ok, notes = True, []
            for i, o in enumerate(outs):
                ref = plain_tokens[i]
                safe = next((j for j, m in enumerate(margins) if m[i] < 0.1), len(margins))
                n = min(safe, len(o.token_ids), len(ref))
                first = next((j for j in range(n) if o.token_ids[j] != ref[j]), None)
                if first is not None:
                    ok = False
                    notes.append(
                        {
                            "row": i,
                            "first_mismatch": first,
                            "margin": round(margins[first][i], 4),
                            "safe": safe,
                        }
                    )
            res["lossless"][f"{kind} K={k} b={tag}{'' if pipe else ' no-pipeline'}"] = (
                ok if ok else notes
            )
            acc = [x for o in outs for x in o.accepted]
            row = {
                "target": name,
                "kind": kind,
                "k": k,
                "batch": b,
                "fused": fused,
                "swiglu": swiglu,
                "norms": norms,
                "round_graphs": graphs,
                "pipeline": pipe,
                "inductor": setting,
                "pdl": pdl(device),
                "t_round_ms": round(t_round, 4),
                "t_gptfast_ms": gf_ms,
                "ratio_vs_gptfast": round(t_round / gf_ms, 3),
                "t_plain_ms": round(ms, 4),
                "ratio": round(t_round / ms, 3),
                # The round in plain steps of the runner's own baseline (`PlainStep`, what
                # `python -m draftinfer` measures against), else the best plain step timed.
                "round_cost": round(t_round / plain_base_ms(res["plain"][tag]), 4),
                "t_plain_graph_ms": round(graph_ms, 4),
                "ratio_vs_graph": round(t_round / graph_ms, 3),
                "speedup_at_al3": round(3 * min(ms, graph_ms, gf_ms) / t_round, 3),
                "rounds_timed": len(rt),
                "mean_accepted": sum(acc) / max(len(acc), 1),
                # The confidence cut (`SpecDecoder(verify_threshold=)`; None: the whole block)
                # and the rows its verify forwards scored per round (drafts verified + 1).
                "verify_threshold": a.verify_threshold,
                "verified_rows_per_round": round(
                    sum(p + 1 for o in outs for p in o.proposed)
                    / max(sum(len(o.proposed) for o in outs), 1),
                    3,
                ),
                "wall_s": round(time.perf_counter() - t2, 1),
            }
            if a.breakdown and graphs:
                row.update(breakdown_ms(dec, target, k, a.context, a.profile))
                row["t_rest_ms"] = round(t_round - row["t_verify_ms"] - row["t_propose_ms"], 4)
                row["t_host_ms"] = round(t_round - row["t_round_graph_ms"], 4)
                row["t_bookkeeping_ms"] = round(
                    row["t_round_graph_ms"] - row["t_verify_ms"] - row["t_propose_ms"], 4
                )
            res["rows"].append(row)
            print(json.dumps({c: v for c, v in row.items() if not c.startswith("kernels_")}))
            sys.stdout.flush()
            del dec


def plain_base_ms(plain: dict) -> float:
    """The runner's plain baseline where it was timed, else the best plain step timed."""
    if "runner_step_ms" in plain:
        return plain["runner_step_ms"]
    return min(plain.get("cuda_graph_ms", float("inf")), plain["ms"])


def write_costs(res: dict, out_dir: Path) -> list[Path]:
    """One `round_costs=` file per (kind, batch, configuration) of a target's rows:
    `{out_dir}/{target}_{kind}_b{batch}[_{tag}].json` with `round_cost: {K: t_round /
    t_plain}` (`draftinfer.conventions.metrics.choose_k`) and where it was measured."""
    groups: dict[str, dict] = {}
    for r in res["rows"]:
        if not r["pipeline"]:
            continue
        tag = "".join(f"_{n}" for n in ("fused", "swiglu", "norms") if r.get(n)) + (
            "" if r["round_graphs"] else "_nographs"
        )
        if r.get("inductor", "default") != "default":
            tag += f"_{r['inductor']}"
        name = f"{res['shape']}_{r['kind']}_b{r['batch']}{tag}"
        g = groups.setdefault(
            name,
            {
                "target": res["shape"],
                "kind": r["kind"],
                "batch": r["batch"],
                "device": res["device"],
                "torch": res["torch"],
                "dtype": res["dtype"],
                "context": res["context"],
                "round_graphs": r["round_graphs"],
                "fused": r["fused"],
                "round_cost": {},
                "t_round_ms": {},
            },
        )
        g["round_cost"][str(r["k"])] = r["round_cost"]
        g["t_round_ms"][str(r["k"])] = r["t_round_ms"]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, g in groups.items():
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(g, indent=2) + "\n")
        paths.append(path)
    return paths


def print_summary(res: dict, batches, kinds) -> None:
    """One table per target, led by t_round / t_gptfast (DESIGN section 7)."""
    print(
        f"\nround vs plain decode, {res['shape']} ({res['prompts']} prompts), {res['device']}, "
        f"compile={res['compile']}"
    )
    for b, f in res.get("floor", {}).items():
        parts = ", ".join(f"{k} {f[k] / 1e9:.2f}" for k in ("weights", "experts", "kv"))
        print(
            f"batch {b}: floor {f['floor_ms']:.3f} ms ({f['total'] / 1e9:.2f} GB: {parts}; "
            f"copy {f['bandwidth'] / 1e12:.2f} TB/s)"
        )
    for b, g in res["gpt_fast"].items():
        own = f", {g['floor_ms'] / g['ms']:.0%} of its own floor" if "floor_ms" in g else ""
        print(f"batch {b}: gpt-fast compiled step {g['ms']:.3f} ms{own}")
    for tag, p in res["plain"].items():
        b = int(tag.split()[0])
        fl = res.get("floor", {}).get(b, {}).get("floor_ms")
        gf = res["gpt_fast"].get(b, {}).get("ms")
        base = plain_base_ms(p)
        print(
            f"batch {tag}: ours plain step {p['ms']:.3f} ms compiled, "
            f"{p.get('cuda_graph_ms', float('nan')):.3f} ms compiled + CUDA graph, "
            f"{p.get('runner_step_ms', float('nan')):.3f} ms the runner's baseline (PlainStep)"
            + (
                f"; {fl / base:.0%} of the floor ({p['achieved_bandwidth'] / 1e12:.2f} TB/s)"
                if fl
                else ""
            )
            + (f"; {base / gf:.3f}x gpt-fast's step" if gf else "")
        )
    cols = ["kind", "k", "batch", "fused", "swiglu", "norms", "round_graphs", "pipeline"]
    if any(r.get("inductor", "default") != "default" for r in res["rows"]):
        cols.append("inductor")
    cols.append("pdl")
    if any(r.get("verify_threshold") is not None for r in res["rows"]):
        cols += ["verify_threshold", "verified_rows_per_round"]
    cols += ["t_round_ms"]
    cols += ["ratio_vs_gptfast"]
    cols += ["ratio_vs_graph", "ratio", "round_cost"]
    extra = [
        "t_verify_ms",
        "t_one_slot_ms",
        "t_propose_ms",
        "t_rest_ms",
        "t_bookkeeping_ms",
        "t_host_ms",
    ]
    cols += [c for c in extra if any(c in r for r in res["rows"])]
    print(" | ".join(cols))
    for r in res["rows"]:
        print(" | ".join(str(r.get(c, "")) for c in cols))
    for r in res["rows"]:
        for part in ("verify", "propose"):
            table = r.get(f"kernels_{part}")
            if table:
                print(f"\n{r['kind']} K={r['k']} b={r['batch']}: top kernels of {part}, us a call")
                for t in table:
                    print(f"{t['us_per_step']:9.2f} {t['calls_per_step']:6.1f}  {t['kernel']}")
    print("sync check:", json.dumps(res["sync_check"]))
    bad = {k: v for k, v in res["lossless"].items() if v is not True}
    print("lossless (margin-aware):", not bad, "" if not bad else json.dumps(bad)[:600])
    print(f"total {res['total_s']} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="same as --targets tiny")
    ap.add_argument(
        "--targets",
        default="llama3.1-8b",
        help=f"comma-separated, timed one after the other in this process: {', '.join(TARGETS)}",
    )
    ap.add_argument(
        "--reference-targets",
        default="",
        help="comma-separated targets timed first with plain steps only (no rounds): their "
        "fraction of the copy bandwidth is printed beside the targets' (e.g. llama3.1-8b, "
        "the dense target, beside glm-4.7-flash)",
    )
    ap.add_argument("--batches", default="1,8")
    ap.add_argument(
        "--ks",
        default="",
        help="override every K list (2,3) or per kind (eagle3:3,ptd:4,mtp:3,dflash:7)",
    )
    ap.add_argument("--kinds", default="eagle3,ptd,mtp")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--compile", default="all", choices=["none", "target", "all"])
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph plain step")
    ap.add_argument(
        "--round-graphs",
        default="on",
        choices=["on", "off", "both"],
        help="replay the round from CUDA graphs (SpecDecoder(cuda_graphs=True)); CUDA only",
    )
    ap.add_argument(
        "--pipeline",
        default="on",
        choices=["on", "off", "both"],
        help="launch each round before reading the previous one back (SpecDecoder(pipeline=))",
    )
    ap.add_argument("--peer-dir", type=Path, default=Path("peers/gpt-fast"))
    ap.add_argument("--breakdown", action="store_true", help="verify / propose / rest per round")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="with --breakdown: the top kernels of verify and propose over this many replays",
    )
    ap.add_argument("--fuse", action="store_true", help="also time a fused-projection target")
    ap.add_argument("--fuse-only", action="store_true", help="time only the fused target")
    ap.add_argument(
        "--no-skinny", action="store_true", help="fused target on cuBLAS, not the skinny GEMM"
    )
    ap.add_argument(
        "--swiglu",
        default="on",
        choices=["on", "off", "both"],
        help="fused target: SwiGLU's product as the gate/up skinny GEMM's epilogue "
        "(`use_skinny_gemm(swiglu=...)`, the default); both = time each way, in this process",
    )
    ap.add_argument(
        "--norms",
        default="on",
        choices=["on", "off", "both"],
        help="fused target with the SwiGLU epilogue: its decoder layers' norms and residual "
        "adds inside the skinny GEMMs (`use_skinny_gemm(norms=...)`, the default); both = "
        "time each way, in this process",
    )
    ap.add_argument(
        "--inductor",
        default="default",
        help="inductor settings of our compiled round and plain step, comma-separated, each "
        f"timed in this process ({', '.join(INDUCTOR_OPTIONS)}; default: the runner's, with "
        "programmatic dependent launch and inductor's combo kernels; nopdl: without PDL; "
        "nocombo: without combo kernels; cdt: plus coordinate descent)",
    )
    ap.add_argument(
        "--graph-only",
        action="store_true",
        help="time our plain step only as a CUDA graph (skip the compiled step without one)",
    )
    ap.add_argument(
        "--verify-threshold",
        type=float,
        default=None,
        help="confidence-driven verification (SpecDecoder(verify_threshold=)): cut each "
        "block where the cumulative per-draft confidence falls below this; rows record "
        "verified_rows_per_round (random weights: the derived confidence is ~1/vocab, so "
        "every round verifies 0 drafts; what is timed is the round with the cut on)",
    )
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--costs-out",
        type=Path,
        default=None,
        help="write one round-cost file per target, kind and batch here (the runner's "
        "`round_costs=`: the report then names the best K for its measured acceptance)",
    )
    ap.add_argument(
        "--plain",
        default="all",
        choices=["all", "runner"],
        help="plain steps timed on CUDA: all (compiled, + CUDA graph, the runner's PlainStep) "
        "or only the runner's PlainStep (its tokens are then the lossless reference)",
    )
    ap.add_argument(
        "--no-sync-check",
        action="store_true",
        help="skip the uncaptured K=4 sync-check rounds (a captured round cannot sync)",
    )
    a = ap.parse_args()
    if a.verify_threshold is not None and not 0.0 < a.verify_threshold <= 1.0:
        ap.error(f"--verify-threshold must be in (0, 1], got {a.verify_threshold}")
    if a.profile and any(x in KERNEL_PDL for x in a.inductor.split(",")):
        print(
            "bench_round: --profile under programmatic dependent launch counts each kernel's "
            "wait for the one before it; --inductor nopdl attributes time"
        )
    bad = [x for x in a.inductor.split(",") if x not in INDUCTOR_OPTIONS]
    if bad:
        ap.error(f"--inductor: unknown setting {bad[0]!r} (known: {', '.join(INDUCTOR_OPTIONS)})")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_round: CUDA is not available; nothing timed (use --device cpu --tiny)")
        return 0
    from torch._dynamo import config as dynamo_config

    dynamo_config.cache_size_limit = 64
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = ["tiny"] if a.tiny else a.targets.split(",")
    refs = [n for n in a.reference_targets.split(",") if n]
    unknown = [n for n in refs + names if n not in TARGETS]
    if unknown:
        ap.error(f"unknown target {unknown[0]!r} (known: {', '.join(TARGETS)})")
    batches = [int(x) for x in a.batches.split(",")]
    ks = {
        "eagle3": list(range(1, 8)),
        "ptd": list(range(2, 9)),
        "mtp": [3, 6],
        "dflash": [7, 15],
    }
    if a.ks and ":" in a.ks:  # per kind: eagle3:3,ptd:4,mtp:3,dflash:7,15
        per, kind = [], None
        for x in a.ks.split(","):
            kind, k = x.split(":") if ":" in x else (kind, x)
            if kind is None:
                ap.error(f"--ks {a.ks!r}: {x!r} names no kind (kind:K first)")
            per.append((kind, int(k)))
        ks = {kind: [k for kk, k in per if kk == kind] or ks[kind] for kind in ks}
    elif a.ks:
        ks = {kind: [int(x) for x in a.ks.split(",")] for kind in ks}
    kinds = [k for k in a.kinds.split(",") if k]  # empty: plain steps only
    results = []
    for name, its_kinds in [(n, []) for n in refs] + [(n, kinds) for n in names]:
        results.append(bench_target(name, a, device, dtype, batches, ks, its_kinds))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    from torch._dynamo.utils import counters

    out = results[0] if len(results) == 1 else {"targets": results}
    out["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break")}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    for res in results if a.costs_out else []:
        for path in write_costs(res, a.costs_out):
            print(f"round costs: {path}")
    for res in results:
        print_summary(res, batches, kinds)
    if len(results) > 1:
        print("\nfraction of the copy bandwidth a plain step reaches (floor bytes / step time):")
        for res in results:
            for tag, p in res["plain"].items():
                if "fraction_of_copy" in p:
                    print(f"  {res['shape']} b={tag}: {p['fraction_of_copy']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
