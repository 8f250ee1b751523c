"""GPU-only end-to-end checks (mark `gpu`; skipped, never silently passed, without CUDA).

- T1 in fp32 on CUDA: exact equality with plain greedy decoding, for both drafter kinds.
- T1 in bf16, margin-aware: speculative output equals plain greedy decoding up to the first
  position whose reference top-2 logit margin is below `BF16_MARGIN` (there, batched verify
  and one-token decode may legitimately round to different argmaxes).
"""

from __future__ import annotations

import pytest
import torch

from draftinfer.engine import Request, SpecDecoder
from draftinfer.models import greedy_generate, load_native_target
from draftinfer.registry import registered_kinds
from draftinfer.sampling import SamplingParams
from draftinfer.slots import Slots
from tests.prompts import random_prompts as prompts

KINDS = registered_kinds()

pytestmark = pytest.mark.gpu
BF16_MARGIN = 0.1  # logits units; bf16 rounding of a [B, K+1] verify vs a 1-token step


def _drafter(kind: str, target_dir, target, dtype):
    from tests.tiny_models import untrained_drafter

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
    from tests.test_kinds import servable

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
    graph's outputs)."""
    from draftinfer.checkpoint import load_drafter
    from draftinfer.paths import resolve_path
    from tests.prompts import zoo_prompts

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
    for graphs in (False, True):
        dec = SpecDecoder(
            target, drafter, 3, max_batch=4, max_model_len=384, compile="all", cuda_graphs=graphs
        )
        outs, stats = dec.generate(reqs)
        kv = [t.clone() for t in dec.proposer.kv_snapshot(0, 64)]
        runs.append((outs, kv, dec))
    (eager, kv_e, _), (graphed, kv_g, dec) = runs
    assert dec._graphed.replays > 0  # rounds really came from graphs
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert [o.accepted for o in graphed] == [o.accepted for o in eager]
    assert sum(a for o in eager for a in o.accepted) > 0  # the drafter's drafts were accepted
    for a, b in zip(kv_g, kv_e):
        assert torch.equal(a, b)


def test_flex_ttt_attention_matches_eager_on_cuda():
    from drafttrain.ttt import ttt_attention_eager, ttt_attention_flex

    torch.manual_seed(0)
    B, T, nh, nkv, D = 2, 300, 8, 2, 64
    q = torch.randn(B, T, nh, D, device="cuda")
    k0, v0 = torch.randn(B, T, nkv, D, device="cuda"), torch.randn(B, T, nkv, D, device="cuda")
    extra = [(torch.randn_like(k0), torch.randn_like(v0)) for _ in range(3)]
    torch.testing.assert_close(
        ttt_attention_flex(q, k0, v0, extra),
        ttt_attention_eager(q, k0, v0, extra),
        rtol=2e-4,
        atol=2e-4,
    )


@pytest.mark.parametrize("preset", ["eagle3", "ptd_eagle3"])
def test_training_steps_on_cuda_with_flex_and_bf16(train_env, tmp_path, preset):
    """The GPU training path: bf16 target, bf16 autocast, flex attention (auto backend)."""
    from drafttrain.loggers import read_metrics
    from drafttrain.train import train
    from tests.test_config import compose_preset

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
            "drafter.draft_vocab_size=96",
            "data.eval_split=null",
            "export.verify=false",
        ],
    )
    assert cfg.drafter.attention_backend == "auto"
    train(cfg)
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert all(r["loss"] == r["loss"] for r in rows)  # finite, not NaN
    assert rows[-1]["loss"] < rows[0]["loss"]
