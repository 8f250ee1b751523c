"""Tensor-parallel ranks for the CPU tests: `spawn_ranks(fn, world, *args)` runs
`fn(rank, world, *args)` in `world` fresh processes joined in a gloo process group (one
intra-op thread each: the box's two cores are shared), and the rank bodies the tests run (the
sharded target against the whole one; the runner's speculative decoding). Each rank writes a
JSON file into `out_dir`; the test reads and asserts in the parent.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn, world: int, port: int, init: bool, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    if init:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn, world: int, *args, init: bool = True) -> None:
    """`fn(rank, world, *args)` in `world` spawned processes, torchrun's environment set
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), in a gloo group (`init=False`:
    none; `fn` joins from the environment, as the runner does). Raises if a rank raises."""
    mp.spawn(_rank_main, args=(fn, world, free_port(), init, args), nprocs=world, join=True)


def _write(out_dir: str, rank: int, result: dict) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def read_ranks(out_dir: Path, world: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


# ---- the sharded target against the whole one -----------------------------------------------
def target_numerics(rank: int, world: int, target_dir: str, out_dir: str, compiled: bool) -> None:
    """On each rank: the whole target and this rank's shard, fed the same prefill (two rows of
    7 and 5 tokens, the second right-padded), decode (1 slot) and verify (4 slots) forwards with
    layer-input taps and the final hidden state; the largest |difference| of logits and features
    over the valid slots, per shape; each rank's KV-cache head count; with `compiled`, the
    sharded decode forward under `torch.compile(fullgraph=True)` (no graph break, no fallback)
    against the eager shard."""
    from draftinfer.conventions.slots import Slots
    from draftinfer.files.loading import load_native_target
    from draftinfer.models.target import FeatureSpec
    from draftinfer.models.tensor_parallel import apply_tensor_parallel

    whole = load_native_target(target_dir, "cpu", torch.float32, max_batch=2, max_seq_len=32)
    shard = load_native_target(target_dir, "cpu", torch.float32, max_batch=2, max_seq_len=32)
    apply_tensor_parallel(shard)
    n = whole.config.num_layers
    feats = FeatureSpec(layer_inputs=(0, n // 2, n - 1), final_hidden="post_norm")
    gen = torch.Generator().manual_seed(0)
    V = whole.config.vocab_size
    rows = torch.tensor([0, 1])
    result: dict = {
        "kv_heads": shard.model.layers[0].self_attn.k_cache.shape[2],
        "kv_heads_whole": whole.model.layers[0].self_attn.k_cache.shape[2],
    }

    def compare(name: str, cache_pos: torch.Tensor) -> None:
        ids = torch.randint(0, V, cache_pos.shape, generator=gen)
        slots = Slots(rows, cache_pos)
        a, b = whole(ids, slots, feats), shard(ids, slots, feats)
        valid = cache_pos >= 0
        result[name] = {
            "logits": (a.logits - b.logits)[valid].abs().max().item(),
            "features": (a.features - b.features)[valid].abs().max().item(),
            "logit_scale": a.logits[valid].abs().max().item(),
        }

    prefill = torch.tensor([list(range(7)), [0, 1, 2, 3, 4, -1, -1]])
    compare("prefill", prefill)
    compare("decode", torch.tensor([[7], [5]]))
    compare("verify", torch.tensor([[8, 9, 10, 11], [6, 7, 8, 9]]))
    if compiled:
        step = torch.compile(shard.forward, fullgraph=True)
        pos = torch.tensor([[12], [10]])
        ids = torch.randint(0, V, pos.shape, generator=gen)
        # The same slots twice (a decode step redone writes the same K/V): compiled, then eager.
        got = step(ids, Slots(rows, pos, attn_len=16), feats)
        ref = shard(ids, Slots(rows, pos, attn_len=16), feats)
        result["compiled_decode"] = {
            "logits": (got.logits - ref.logits).abs().max().item(),
            "features": (got.features - ref.features).abs().max().item(),
        }
    _write(out_dir, rank, result)


# ---- the runner's speculative decoding under tp ------------------------------------------------
def write_decoded(rank: int, world: int, cfg_fields: dict, out_dir: str) -> None:
    """`decode_with_runner` of `cfg_fields` into `out_dir/rank{rank}.json`, plus the
    report `run_eval` returns (as a dict)."""
    from dataclasses import asdict

    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.run import run_eval

    cfg = InferConfig(**cfg_fields)
    result = decode_with_runner(cfg)
    result["report"] = asdict(run_eval(cfg))
    _write(out_dir, rank, result)


def decode_with_runner(cfg) -> dict:
    """The runner's pieces as `run_eval` assembles them (target, under `tp` sharded; drafter;
    prompts; speculative decoder), at temperature `cfg.temperature`: tokens and accepted counts
    per request."""
    from draftinfer.decoding.engine import Request
    from draftinfer.decoding.sampling import SamplingParams
    from draftinfer.evaluation.ranks import join_ranks
    from draftinfer.evaluation.run import (
        load_served_drafter,
        load_target,
        pick_device,
        pick_dtype,
        resolve_fast_path,
        runner_prompts,
        served_drafter_config,
        spec_decoder,
    )
    from draftinfer.files.paths import resolve_path

    device = join_ranks(cfg.tp, pick_device(cfg.device))  # tp > 1: the group, from the env
    cfg = resolve_fast_path(cfg, device)
    dtype = pick_dtype(cfg.dtype, device)
    _, _, meta = served_drafter_config(cfg)
    target_path = resolve_path(cfg.target or meta["target"])
    target = load_target(cfg, target_path, device, dtype)
    drafter = load_served_drafter(cfg, target, device, dtype)
    loaded, tokenizer = runner_prompts(cfg, target, target_path)
    eos = tuple(target.config.eos_token_ids)
    requests = [
        Request(
            p.ids,
            SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed + i),
            max_tokens=cfg.max_new_tokens,
            stop_token_ids=eos,
        )
        for i, p in enumerate(loaded)
    ]
    outs, _ = spec_decoder(cfg, target, drafter, tokenizer).generate(requests)
    return {
        "tokens": [o.token_ids for o in outs],
        "accepted": [list(o.accepted) for o in outs],
    }
