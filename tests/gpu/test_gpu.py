"""GPU-only end-to-end checks (mark `gpu`; skipped, never silently passed, without CUDA).

- T1 in fp32 on CUDA: exact equality with plain greedy decoding, for both drafter kinds.
- T1 in bf16, margin-aware: speculative output equals plain greedy decoding up to the first
  position whose reference top-2 logit margin is below `BF16_MARGIN` (there, batched verify
  and one-token decode may legitimately round to different argmaxes).
"""

from __future__ import annotations

import math

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.sampling import SamplingParams
from draftinfer.files.loading import load_native_target
from draftinfer.registry import registered_kinds
from tests.support.prompts import random_prompts as prompts

KINDS = registered_kinds()

pytestmark = pytest.mark.gpu
BF16_MARGIN = 0.1  # logits units; bf16 rounding of a [B, K+1] verify vs a 1-token step


def _drafter(kind: str, target_dir, target, dtype):
    from tests.support.tiny_models import untrained_drafter

    return untrained_drafter(kind, target_dir, target).to("cuda", dtype)


def _margins(target, prompt: list[int], out: list[int]) -> list[float]:
    """Top-2 logit margin of the target at each generated position (teacher-forced)."""
    seq = torch.tensor([prompt + out], device="cuda")
    logits = target(
        seq,
        Slots(torch.tensor([0], device="cuda"), torch.arange(seq.shape[1], device="cuda")[None]),
    ).logits
    top2 = logits[0, len(prompt) - 1 : -1].float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_t1_fp32_cuda_exact(tiny_llama3_dir, kind):
    target = load_native_target(
        tiny_llama3_dir, "cuda", torch.float32, max_batch=8, max_seq_len=128
    )
    d = _drafter(kind, tiny_llama3_dir, target, torch.float32)
    ps = prompts(8, seed=31)
    plain = greedy_generate(target, ps, 16)
    outs = SpecDecoder(target, d, 3, max_batch=8, max_model_len=128).generate(
        [Request(p, max_tokens=16) for p in ps]
    )[0]
    assert [o.token_ids for o in outs] == plain


@pytest.mark.parametrize("kind", KINDS)
def test_t1_bf16_margin_aware(tiny_llama3_dir, kind):
    target = load_native_target(
        tiny_llama3_dir, "cuda", torch.bfloat16, max_batch=8, max_seq_len=128
    )
    d = _drafter(kind, tiny_llama3_dir, target, torch.bfloat16)
    ps = prompts(8, seed=32)
    plain = greedy_generate(target, ps, 24)
    outs = SpecDecoder(target, d, 3, max_batch=8, max_model_len=128).generate(
        [Request(p, max_tokens=24) for p in ps]
    )[0]
    checked = 0
    for p, g, o in zip(ps, plain, outs):
        margins = _margins(target, p, g)
        safe = next((i for i, m in enumerate(margins) if m < BF16_MARGIN), len(g))
        assert o.token_ids[:safe] == g[:safe], (safe, o.token_ids, g)
        checked += safe
    assert checked > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("compiled", [False, True])
def test_round_makes_no_host_sync(tiny_llama3_dir, kind, batch, compiled):
    """The round's tensor work (propose, verify forward, verification, next first pass) runs
    under `torch.cuda.set_sync_debug_mode("error")`: any host-device sync raises. K = 4
    (3 for MTP's 3 modules)."""
    target = load_native_target(
        tiny_llama3_dir, "cuda", torch.bfloat16, max_batch=8, max_seq_len=256
    )
    d = _drafter(kind, tiny_llama3_dir, target, torch.bfloat16)
    ps = prompts(batch, seed=33)
    from tests.support.kind_factories import servable

    k = 4 if servable(kind, d.config, 4) else 3  # K=4 for eagle3 / ptd, 3 for mtp (N=3)
    dec = SpecDecoder(target, d, k, max_batch=batch, max_model_len=256, compile=compiled)
    dec.generate([Request(p, max_tokens=6) for p in ps])  # warm-up: compiles (they may sync)
    dec.sync_check = True
    outs, stats = dec.generate([Request(p, max_tokens=24) for p in ps])
    assert stats["rounds"] > 0 and all(len(o.token_ids) == 24 for o in outs)
    sampled = [Request(p, SamplingParams(1.0, seed=i), max_tokens=8) for i, p in enumerate(ps)]
    assert dec.generate(sampled)[1]["rounds"] > 0  # the sampling path is sync-free too


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_b4_graph_replay_equals_eager(zoo_run, kind, dtype):
    """B4: rounds replayed from CUDA graphs (`SpecDecoder(cuda_graphs=True)`) emit exactly the
    tokens, accepted counts and drafter KV of the same compiled rounds run eagerly: a trained
    zoo drafter (drafts are accepted, so the KV refresh and the carried first pass matter),
    a batch of 4 rows with different prompt lengths, greedy and sampled requests, requests
    finishing mid-batch and a fifth one admitted into a freed row (admission writes into the
    graph's outputs). Both run one round ahead (`pipeline`, the CUDA default); a third run
    that reads every round back first (`pipeline=False`) emits the same (P1 on CUDA)."""
    from draftinfer.files.checkpoint import load_drafter
    from draftinfer.files.paths import resolve_path
    from tests.support.prompts import zoo_prompts

    target = load_native_target(
        resolve_path("zoo:llama-tiny"), "cuda", dtype, max_batch=4, max_seq_len=384
    )
    drafter, _ = load_drafter(zoo_run(kind)["export_dir"], target.shared_weights())
    drafter = drafter.to("cuda", dtype)
    ps = zoo_prompts(5, seed=21)
    reqs = [
        Request(ps[0], max_tokens=40),
        Request(ps[1], SamplingParams(0.8, top_k=20, seed=5), max_tokens=12),
        Request(ps[2], max_tokens=25),
        Request(ps[3], SamplingParams(1.0, seed=6), max_tokens=33),
        Request(ps[4], max_tokens=30),
    ]
    runs = []
    for graphs, ahead in ((False, True), (True, True), (False, False)):
        dec = SpecDecoder(
            target,
            drafter,
            3,
            max_batch=4,
            max_model_len=384,
            compile="all",
            cuda_graphs=graphs,
            pipeline=ahead,
        )
        assert dec.pipeline == ahead
        outs, stats = dec.generate(reqs)
        kv = [t.clone() for t in dec.proposer.kv_snapshot(0, 64)]
        runs.append((outs, kv, dec))
    (eager, kv_e, _), (graphed, kv_g, dec), (one_at_a_time, _, _) = runs
    assert dec._graphed.replays > 0  # rounds really came from graphs
    for outs in (graphed, one_at_a_time):
        assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
        assert [o.accepted for o in outs] == [o.accepted for o in eager]
    assert sum(a for o in eager for a in o.accepted) > 0  # the drafter's drafts were accepted
    for a, b in zip(kv_g, kv_e):
        assert torch.equal(a, b)


def test_flex_ttt_attention_matches_eager_on_cuda():
    from drafttrain.objectives.ttt import ttt_attention_eager, ttt_attention_flex
    from tests.support.ttt_cases import grads_of, ttt_inputs

    torch.manual_seed(0)
    q, k0, v0, extra, leaves = ttt_inputs(2, 300, 8, 2, 64, 3, device="cuda")
    got = ttt_attention_flex(q, k0, v0, extra)
    want = ttt_attention_eager(q, k0, v0, extra)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    # Backward too: flex's against the explicit softmax.
    up = torch.randn_like(want)
    for a, b in zip(grads_of(got, leaves, up), grads_of(want, leaves, up)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_dense_kernel_ttt_attention_matches_eager_on_cuda(kernel):
    """The flash / cudnn TTT backends in bf16 (the training dtype; their merge and diagonal
    gradients compiled) against the explicit softmax in fp32 on the same rounded inputs:
    values and every input's gradient, at a GQA shape with head_dim 128 and a length that is
    not a multiple of any tile."""
    from drafttrain.objectives.ttt import ttt_attention_eager, ttt_attention_lse
    from tests.support.ttt_cases import grads_of, ttt_inputs

    torch.manual_seed(0)
    q, k0, v0, extra, leaves = ttt_inputs(1, 1000, 8, 2, 128, 3, "cuda", torch.bfloat16)
    ref = [t.detach().float().requires_grad_() for t in leaves]
    got = ttt_attention_lse(q, k0, v0, extra, kernel=kernel)
    want = ttt_attention_eager(ref[0], ref[1], ref[2], list(zip(ref[3::2], ref[4::2])))

    def rel(a, b):  # relative error in norm: bf16 rounding is ~4e-3
        return ((a.float() - b).norm() / b.norm()).item()

    assert rel(got, want) < 1e-2
    up = torch.randn_like(want)
    errs = [rel(a, b) for a, b in zip(grads_of(got, leaves, up), grads_of(want, ref, up))]
    assert max(errs) < 2e-2, errs


def test_dense_kernel_backends_fall_back_to_flex_for_fp32_on_cuda():
    """fp32 queries (training without autocast) are not the dense kernels' to take: the
    cudnn / flash backends run flex for them, same values as the explicit softmax."""
    from drafttrain.objectives.ttt import dense_kernel_fits, ttt_attention_eager, ttt_attention_lse

    torch.manual_seed(1)
    q = torch.randn(1, 200, 8, 64, device="cuda")
    k0, v0 = torch.randn(1, 200, 2, 64, device="cuda"), torch.randn(1, 200, 2, 64, device="cuda")
    extra = [(torch.randn_like(k0), torch.randn_like(v0))]
    assert not dense_kernel_fits(q) and dense_kernel_fits(q.bfloat16())
    for kernel in ("cudnn", "flash"):
        got = ttt_attention_lse(q, k0, v0, extra, kernel=kernel)
        torch.testing.assert_close(got, ttt_attention_eager(q, k0, v0, extra), rtol=2e-4, atol=2e-4)


# Per-preset sizes of the tiny GPU training run (a block drafter has no draft vocabulary).
GPU_TRAIN_OVERRIDES = {
    "eagle3": ["drafter.draft_vocab_size=96"],
    "ptd_eagle3": ["drafter.draft_vocab_size=96"],
    "dflash": ["drafter.block_size=8", "drafter.num_layers=2", "drafter.num_anchors=16"],
}


@pytest.mark.parametrize("preset", list(GPU_TRAIN_OVERRIDES))
def test_training_steps_on_cuda_with_the_auto_backend_and_bf16(train_env, tmp_path, preset):
    """The GPU training path: bf16 target, bf16 autocast, the auto attention backend (cudnn's
    causal block and the merge kernel for EAGLE-3's TTT on Hopper, flex elsewhere; ptd's and
    dflash's masks always flex)."""
    from drafttrain.jobs.train import train
    from drafttrain.trainer.loggers import read_metrics
    from tests.support.presets import compose_preset

    cfg = compose_preset(
        preset,
        [
            f"target.name_or_path={train_env['target']}",
            f"data.path={train_env['data']}",
            f"output_dir={tmp_path}",
            "trainer.max_steps=12",
            "trainer.progress=false",
            "trainer.save_every=0",
            "trainer.log_every=4",
            "data.batch_size=4",
            "data.eval_split=null",
            "export.verify=false",
            *GPU_TRAIN_OVERRIDES[preset],
        ],
    )
    assert cfg.drafter.attention_backend == "auto"
    train(cfg)
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert all(math.isfinite(r["loss"]) for r in rows)  # neither NaN nor Inf
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.parametrize("groups,head", [(1, "trained"), (3, "trained"), (3, "frozen")])
def test_fused_soft_ce_on_cuda(groups, head):
    """The chunked fused loss on CUDA (compiled chunk kernels, bf16 matmuls under autocast):
    gradients made in forward (one group, or a frozen head) and recomputed in backward
    (several groups with a trained head) agree with the fp32 plain formula within bf16
    rounding."""
    from drafttrain.objectives.fused_ce import linear_soft_ce, linear_soft_ce_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    N, H, V, M = 3000, 256, 4000, 3100
    h = (torch.randn(N, H, device="cuda", generator=g) / 4).requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) / 4).requires_grad_(head == "trained")
    probs = torch.softmax(2 * torch.randn(M, V, device="cuda", generator=g), -1)
    rows = torch.randint(0, M, (N,), device="cuda", generator=g)
    group = torch.randint(-1, groups, (N,), device="cuda", generator=g)
    top1 = probs.argmax(-1)
    upstream = torch.tensor([0.7, -1.3, 2.0], device="cuda")[:groups]
    wrt = (h, w) if head == "trained" else (h,)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = linear_soft_ce(h, w, probs, rows, top1, group, groups, chunk_elements=700 * V)
    want = linear_soft_ce_ref(h, w, probs, rows, top1, group, groups)
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-1)
    assert torch.equal(got[2], want[2])
    ga = torch.autograd.grad((got[0] * upstream).sum(), wrt)
    gb = torch.autograd.grad((want[0] * upstream).sum(), wrt)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a.float(), b, rtol=3e-2, atol=2e-3 * b.abs().max().item())


def test_weight_gradient_accumulates_in_place_in_fp32_on_cuda():
    """`_accumulate_mm` adds a chunk's bf16 weight-gradient product into the fp32 accumulator
    in place (no new `[V, H]` output, no copy of the accumulator) and in fp32 inside the GEMM:
    equal to the fp32 sum of the exact bf16 products (a 2097-row chunk, the odd row count of
    2^26 logits of a 32000-token head)."""
    from drafttrain.objectives.fused_ce import _accumulate_mm

    g = torch.Generator(device="cuda").manual_seed(0)
    dz = torch.randn(2097, 640, device="cuda", generator=g).bfloat16()
    h = torch.randn(2097, 256, device="cuda", generator=g).bfloat16()
    acc = torch.randn(640, 256, device="cuda", generator=g)
    want = acc + dz.t().double() @ h.double()
    got = _accumulate_mm(acc, dz.t(), h)
    assert got.data_ptr() == acc.data_ptr() and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("name", ["kl", "tv", "lk"])
@pytest.mark.parametrize("groups", [1, 3])
def test_fused_losses_on_cuda(name, groups):
    """Every `trainer.loss` through the chunked fused path on CUDA (its compiled chunk kernels,
    fp32: the closed forms, not bf16 rounding, are under test), with D-PACE-style row weights,
    against autograd through the plain formula; and the memory bound: the peak stays far below
    the `[N, V]` fp32 logits the plain formula would hold."""
    from drafttrain.objectives.fused_ce import linear_soft_ce, linear_soft_ce_ref
    from drafttrain.objectives.loss_fns import LOSSES

    g = torch.Generator(device="cuda").manual_seed(0)
    N, H, V, M = 12000, 256, 4000, 3100
    h = (torch.randn(N, H, device="cuda", generator=g) / 4).requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) / 4).requires_grad_()
    probs = torch.softmax(2 * torch.randn(M, V, device="cuda", generator=g), -1)
    rows = torch.randint(0, M, (N,), device="cuda", generator=g)
    group = torch.randint(-1, groups, (N,), device="cuda", generator=g)
    rw = torch.rand(N, device="cuda", generator=g)
    top1 = probs.argmax(-1)
    up = torch.tensor([0.7, -1.3, 2.0], device="cuda")[:groups]
    loss = LOSSES[name]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = linear_soft_ce(h, w, probs, rows, top1, group, groups, 300 * V, loss, rw)
    ga = torch.autograd.grad((got[0] * up).sum(), (h, w))
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < N * V * 4 / 2, peak  # a few [300, V] chunks, never [N, V]
    want = linear_soft_ce_ref(h, w, probs, rows, top1, group, groups, loss, rw)
    gb = torch.autograd.grad((want[0] * up).sum(), (h, w))
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-3)
    for a, b in zip(ga, gb):
        tol = 1e-4 * b.abs().max().item()
        if name != "tv":
            torch.testing.assert_close(a, b, rtol=1e-3, atol=tol)
            continue
        # tv's gradient has sign(q - p): where q ~ p within the last bits, the two computations
        # take opposite signs (the fp32 plain formula and an fp64 one disagree on as many
        # elements, by up to 3% of the largest gradient; H200, 2026-11-26). A wrong closed form
        # moves most elements; these flips move about 1 in 10^4.
        off = (a - b).abs() > tol + 1e-3 * b.abs()
        assert off.float().mean() < 1e-3, off.float().mean()
        assert (a - b).abs().max() < 5e-2 * b.abs().max(), (a - b).abs().max()


def test_target_distribution_on_cuda_equals_plain_formula():
    """The compiled chunk statistics (CUDA) against the plain formula on the same bf16 head's
    logits: identical argmaxes and membership, labels within bf16 rounding."""
    import torch.nn.functional as F

    from drafttrain.frozen.head import (
        HeadLogits,
        TargetHead,
        TrainTargetOutput,
        target_distribution,
    )

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, V = 2, 700, 64, 3001
    hidden = torch.randn(B, T, H, device="cuda", generator=g).bfloat16()
    weight = torch.randn(V, H, device="cuda", generator=g).bfloat16()
    vocab = torch.randperm(V, device="cuda", generator=g)[:1000].sort().values
    tgt = TrainTargetOutput(None, None, None, None, head=HeadLogits(hidden, TargetHead(weight)))
    z = F.linear(hidden, weight).float().flatten(0, 1)
    zs = z[:, vocab]
    member = torch.zeros(V, dtype=torch.bool, device="cuda")
    member[vocab] = True
    for got, (top1, probs, in_vocab) in [
        (target_distribution(tgt, vocab), (zs.argmax(-1), zs.softmax(-1), member[z.argmax(-1)])),
        (target_distribution(tgt), (z.argmax(-1), z.softmax(-1), torch.ones_like(member[:1]))),
    ]:
        assert torch.equal(got.top1, top1) and bool((got.in_vocab == in_vocab).all())
        assert got.probs.dtype == torch.bfloat16
        torch.testing.assert_close(got.probs.float(), probs, rtol=1e-2, atol=1e-5)


def test_mixed_adamw_compiled_on_cuda_equals_eager_cpu():
    """`MixedAdamW` on CUDA (one compiled update per parameter shape) against the same
    optimizer on CPU (eager), bf16 parameters with fp32 masters and bf16 moments, the learning
    rate changing every step as under a scheduler: the same masters within fp32 rounding, and
    no recompilation after the first step (the step-dependent scalars are tensors)."""
    from torch._dynamo.utils import counters

    from drafttrain.trainer.optim import MixedAdamW

    torch.manual_seed(0)
    shapes = [(64, 48), (48,)]
    w0 = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) * 1e-2 for s in shapes] for _ in range(5)]
    kw = dict(betas=(0.9, 0.95), weight_decay=0.1, state_dtype=torch.bfloat16)
    runs = {}
    for dev in ("cpu", "cuda"):
        params = [torch.nn.Parameter(w.bfloat16().to(dev)) for w in w0]
        opt = MixedAdamW(params, lr=1e-3, **kw)
        graphs = []
        for i, gs in enumerate(grads):
            for p, g in zip(params, gs):
                p.grad = g.bfloat16().to(dev)
            opt.param_groups[0]["lr"] = 1e-3 * (i + 1) / 5
            opt.step()
            graphs.append(counters["stats"]["unique_graphs"])
        runs[dev] = ([opt.master_of(p).cpu() for p in params], graphs)
    for a, b in zip(runs["cuda"][0], runs["cpu"][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
    cuda_graphs = runs["cuda"][1]
    assert cuda_graphs[-1] == cuda_graphs[0], cuda_graphs  # compiled once, at the first step


@pytest.mark.gpu
def test_the_runners_plain_baseline_decodes_what_the_eager_loop_does(tiny_llama3_dir):
    """The report's plain baseline on CUDA (`PlainStep`: compiled, replayed from a CUDA graph
    per attention bucket) decodes the eager loop's tokens, across buckets, with graphs
    replayed (the second call reuses the first's captures), and with EOS stops read one step
    late (`_StopFlag`) the outputs are cut where the eager loop cuts them."""
    from draftinfer.decoding.baseline import PlainStep

    model = load_native_target(tiny_llama3_dir, "cuda", torch.float32, 4, 96)
    ps = prompts(4, seed=500)
    eager = greedy_generate(model, ps, 40, [])
    step = PlainStep(model, compile=True, cuda_graphs=True)
    for _ in range(2):
        assert greedy_generate(model, ps, 40, [], step_fn=step) == eager
    assert step._graphed.replays > 0 and len(step._graphed.graphs) >= 2  # two buckets or more
    eos = [eager[0][5], eager[2][11]]  # tokens the outputs reach: every row stops on one
    assert greedy_generate(model, ps, 40, eos, step_fn=step) == greedy_generate(model, ps, 40, eos)
    # Seven prompts in groups of 4 and 3 rows: one graph per batch size and bucket (a graph
    # captured for one row once met eight, in the job's verify on CUDA).
    ps7 = prompts(7, seed=501)
    assert greedy_generate(model, ps7, 40, [], step_fn=step) == greedy_generate(model, ps7, 40, [])
    assert {key[0] for key in step._graphed.graphs} == {3, 4}


def test_swap_between_graph_replays_is_not_recaptured(tmp_path):
    """A drafter hot swap between replays of the captured round (`draftbench.swap`, tiny
    shapes, every kind): no graph is captured during the swapped run while its rounds replay,
    and its tokens equal the run without swaps."""
    import json

    from draftbench import swap

    out = tmp_path / "swap.json"
    argv = ["--tiny", "--rounds", "24", "--batch", "4", "--context", "32", "--swap-every", "3"]
    assert swap.main([*argv, "--compile", "none", "--out", str(out)]) == 0
    for r in json.loads(out.read_text())["results"]:
        assert r["swaps"] >= 4 and r["replays"] > 0 and not r["recaptured"], r
        assert r["tokens_identical"], r


def test_emitted_features_from_captured_rounds_equal_a_fresh_prefill(zoo_run):
    """Online training's data on CUDA (`SpecDecoder(emit_features=True)`): rounds compiled,
    replayed from CUDA graphs and pipelined, with a drafter swap between replays, hand back
    for every committed token the target features the verify pass computed; fp32, they equal a
    fresh prefill of the whole committed sequence row for row (the CPU test is
    `tests/infer/test_emit_features.py`)."""
    from draftinfer.decoding.swap import DrafterUpdate
    from draftinfer.files.checkpoint import load_drafter
    from draftinfer.files.paths import resolve_path
    from tests.support.native_parity import prefill_features
    from tests.support.prompts import zoo_prompts

    export = zoo_run("eagle3")["export_dir"]
    target = load_native_target(
        resolve_path("zoo:llama-tiny"), "cuda", torch.float32, max_batch=4, max_seq_len=384
    )
    drafter, _ = load_drafter(export, target.shared_weights())
    drafter = drafter.to("cuda", torch.float32)
    eos = tuple(target.config.eos_token_ids)
    ps = zoo_prompts(8, seed=4)
    reqs = [Request(p, max_tokens=12 + 5 * (i % 4), stop_token_ids=eos) for i, p in enumerate(ps)]
    dec = SpecDecoder(
        target,
        drafter,
        3,
        max_batch=4,
        max_model_len=384,
        compile="all",
        cuda_graphs=True,
        emit_features=True,
    )
    update = DrafterUpdate.from_export(export, 1)
    n = [0]

    def between_rounds(d):
        n[0] += 1
        if n[0] == 3:
            d.update_drafter(update)

    outs, stats = dec.generate(reqs, between_rounds=between_rounds)
    assert dec._graphed is not None and dec._graphed.replays > 0
    assert sum(a for o in outs for a in o.accepted) > 20  # rounds committed accepted drafts
    for p, o in zip(ps, outs):
        seq = p + o.token_ids
        want = prefill_features(target, seq[:-1], dec.emit_spec)
        assert o.features.shape == want.shape
        torch.testing.assert_close(o.features.to(want.device), want, rtol=1e-3, atol=1e-3)


def test_a_failed_capture_runs_the_call_eagerly_and_the_next_call_captures():
    """A function whose first capture does something a capture forbids (a host sync, as a
    kernel loaded or tuned inside the capture does): that call still returns the eager
    result and changes the persistent state once; the next call captures and replays; a
    second failure of the same key raises."""
    from draftinfer.decoding.graphs import GraphedFunction

    state = torch.zeros(4, device="cuda")
    spoil = {"n": 1}

    def fn(x, key):
        state.add_(x)  # persistent, updated in place: must change once per call
        if spoil["n"] and torch.cuda.is_current_stream_capturing():
            spoil["n"] -= 1
            torch.cuda.synchronize()  # forbidden while capturing
        return (state * 2,)

    g = GraphedFunction(fn)
    one = torch.ones(4, device="cuda")
    assert torch.equal(g((one,), "k")[0], torch.full((4,), 2.0, device="cuda"))  # warm-up
    with pytest.warns(UserWarning, match="capture of .* failed"):
        out = g((one,), "k")[0]  # the capture fails: run eagerly
    assert torch.equal(out, torch.full((4,), 4.0, device="cuda")) and not g.graphs
    assert list(g.capture_retries) == [("k",)]
    out = g((one,), "k")[0]  # captured now
    assert torch.equal(out, torch.full((4,), 6.0, device="cuda")) and ("k",) in g.graphs
    out = g((one,), "k")[0]  # replayed
    assert torch.equal(out, torch.full((4,), 8.0, device="cuda")) and g.replays == 2
    spoil["n"] = 1
    key2 = "other"
    g.capture_retries[(key2,)] = "failed before"
    with pytest.raises(Exception):  # noqa: B017 (the device's own error type)
        g._capture_or_none((key2,), (one,), (key2,))


@pytest.mark.parametrize("option", ["dspark", "derived"])
@pytest.mark.parametrize("batch", [1, 8])
def test_captured_round_with_confidence_cut_makes_no_host_sync(tiny_llama3_dir, option, batch):
    """`verify_threshold` on, compiled and replayed from CUDA graphs: the rounds run under
    `torch.cuda.set_sync_debug_mode("error")` (any host-device sync raises), graphs are
    replayed, and the cut happened (rounds verified fewer than K drafts). DSpark's head gives
    the confidences (`option="dspark"`), or an eagle3 drafter's derived ones; greedy and
    sampled requests; the per-draft confidences are copied back (`record_confidence`)."""
    target = load_native_target(
        tiny_llama3_dir, "cuda", torch.bfloat16, max_batch=8, max_seq_len=256
    )
    if option == "dspark":
        from tests.support.dflash import randomize_heads
        from tests.support.tiny_models import untrained_drafter

        d = randomize_heads(untrained_drafter("dflash", tiny_llama3_dir, target, dspark=True))
        d = d.to("cuda", torch.bfloat16)
        assert d.confidence_head is not None
    else:
        d = _drafter("eagle3", tiny_llama3_dir, target, torch.bfloat16)
    ps = prompts(batch, seed=34)
    k = 4
    dec = SpecDecoder(
        target,
        d,
        k,
        max_batch=batch,
        max_model_len=256,
        compile="all",
        cuda_graphs=True,
        verify_threshold=0.5,
        record_confidence=True,
    )
    dec.generate([Request(p, max_tokens=12) for p in ps])  # warm-up: compiles and captures
    dec.sync_check = True
    replays = dec._graphed.replays
    outs, stats = dec.generate([Request(p, max_tokens=24) for p in ps])
    assert stats["rounds"] > 0 and all(len(o.token_ids) == 24 for o in outs)
    assert dec._graphed.replays > replays
    assert any(p < k for o in outs for p in o.proposed)  # the cut happened
    assert all(len(c) == k for o in outs for c in o.confidences)
    sampled = [Request(p, SamplingParams(1.0, seed=i), max_tokens=8) for i, p in enumerate(ps)]
    assert dec.generate(sampled)[1]["rounds"] > 0  # the sampling path is sync-free too
