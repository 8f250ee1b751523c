"""The memory floor of one decode step: the bytes it must read over the copy bandwidth measured
in the same process (DESIGN section 7), for dense and routed (MoE) targets alike.

    nbytes = step_bytes(target, tokens, rows, context)      # one eager step, routes recorded
    floor_ms = nbytes / copy_bandwidth(device, 1 << 30) * 1e3

What a step must read:
- every weight except the embedding table and the routed experts, plus one embedding row per
  token (the whole table where the head is tied to it): attention, norms, routers, the dense
  first layers' MLPs and the shared experts of a DeepSeek-V3-style target;
- of each routed-experts block, the experts the step's tokens route to, each once (their
  union over the batch: what grouped products read; the router's choices are recorded from
  the step itself, so the count is the real one for these weights and tokens);
- the K/V cache each token attends to: `context + 1` positions per layer, or the layer's
  sliding window when it is shorter; under MLA (`draftinfer.models.mla.LatentAttention`) the
  latent cache, `kv_lora_rank + qk_rope_head_dim` values per position per layer (576 at
  DeepSeek-V3's and GLM-4.7-Flash's sizes), read once for every head (the absorbed path).
"""

from __future__ import annotations

import torch

from draftinfer.models.moe import MoEBlock


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.no_grad()
def routed_experts(target, tokens: torch.Tensor, rows, cache, rope, attn_len: int) -> list[int]:
    """Per routed-experts block of `target`, how many distinct experts one forward of
    `tokens [B, T]` routes to (an eager forward with the routers observed)."""
    from draftinfer.decoding.compiled import target_forward

    counts: list[int] = []
    hooks = []
    for block in (m for m in target.modules() if isinstance(m, MoEBlock)):
        router = getattr(block, block.router_name)

        def seen(module, args, out):
            counts.append(int(out[1].unique().numel()))

        hooks.append(router.register_forward_hook(seen))
    try:
        target_forward(target, tokens, rows, cache, rope, attn_len, (), None)
    finally:
        for h in hooks:
            h.remove()
    return counts


def step_bytes(target, batch: int, context: int, experts_touched: list[int]) -> dict:
    """Bytes one decode step of `batch` tokens at `context` cached positions must read (module
    docstring), by part: {weights, experts, kv, total}."""
    emb = target.get_input_embeddings().weight
    blocks = [m for m in target.modules() if isinstance(m, MoEBlock)]
    expert_params = {id(p) for b in blocks for p in b.experts.parameters()}
    weights = _nbytes(p for p in target.parameters() if p is not emb and id(p) not in expert_params)
    # One embedding row per token, or the whole table where it is also the head.
    weights += emb.nbytes if target.lm_head.weight is emb else batch * emb[0].nbytes
    experts = 0
    for block, n in zip(blocks, experts_touched, strict=True):
        per_expert = _nbytes(block.experts.parameters()) // block.experts.num_experts
        experts += n * per_expert
    kv = 0
    for m in target.modules():
        latent = getattr(m, "latent_cache", None)
        if latent is not None:  # MLA: one latent per position, shared by every head
            kv += batch * (context + 1) * latent[0, 0].nbytes
        elif hasattr(m, "k_cache") and hasattr(m, "window"):
            keys = context + 1 if m.window is None else min(context + 1, m.window)
            per_pos = m.k_cache[0, 0].nbytes + m.v_cache[0, 0].nbytes
            kv += batch * keys * per_pos
    return {"weights": weights, "experts": experts, "kv": kv, "total": weights + experts + kv}
