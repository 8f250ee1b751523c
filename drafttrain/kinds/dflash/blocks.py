"""All of a batch's blocks in one drafter forward (training), with the block mask of
`draftinfer.kinds.dflash.attention` (the predicate the runner's cache mask uses too).

Layout per sequence: keys are `[T context rows | S block rows]`, queries the S block rows
(`S = anchors * n`, blocks contiguous). Each key and query carries its token index and its
block's anchor (`CONTEXT` for context rows, `PAD` for padding blocks), and `visible` decides.

Backends (`drafter.attention_backend`):
- `eager`: a dense bool mask `[B, 1, S, T + S]` and SDPA; runs and back-propagates anywhere
  (CPU training);
- `flex`: `flex_attention` with a `BlockMask` built from the same predicate as a `mask_mod`
  (compiled `create_block_mask` on CUDA, so the dense grid is never materialised there).
  Forward equality with `eager` is tested on the CPU (`tests/kinds/test_dflash_train.py`); flex has
  no backward on the CPU, which is why `auto` picks eager there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftinfer.kinds.dflash.attention import PAD, mask_flags, nonempty, visible
from draftinfer.models.layers import causal_attention


def layer_keys(config) -> list[tuple[bool, int | None]]:
    """(causal, window) of each drafter layer: the mask it needs."""
    return [
        (config.layer_causal(i), config.layer_window(i)) for i in range(config.num_hidden_layers)
    ]


def make_block_attention(
    config,
    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v) [B, T, nkv, D]
    q_index: torch.Tensor,  # [B, S] token index of each block slot
    q_anchor: torch.Tensor,  # [B, S] its block's anchor index (PAD: padding block)
    k_index: torch.Tensor,  # [B, T + S]
    k_anchor: torch.Tensor,  # [B, T + S] (CONTEXT for the first T)
    backend: str,
):
    """attn_fn(layer, q, k, v) over `[context | block]` keys for the block queries."""
    keys = layer_keys(config)
    if backend != "eager":  # flash / cudnn name TTT's kernels; blocks run flex for both
        return _flex_attention(ctx_kv, q_index, q_anchor, k_index, k_anchor, keys)
    masks = {
        key: nonempty(
            visible(
                q_index[..., None], q_anchor[..., None], k_index[:, None], k_anchor[:, None], *key
            )
        )[:, None]
        for key in set(keys)
    }  # [B, 1, S, T + S]

    def attn_eager(layer: int, q, k, v):
        kc, vc = ctx_kv[layer]
        return causal_attention(
            q,
            torch.cat([kc, k.to(kc.dtype)], 1),
            torch.cat([vc, v.to(vc.dtype)], 1),
            mask=masks[keys[layer]],
        )

    return attn_eager


def _flex_attention(ctx_kv, q_index, q_anchor, k_index, k_anchor, keys):
    from torch.nn.attention.flex_attention import create_block_mask

    from drafttrain.objectives.ttt import FLEX_BLOCK, flex_fn

    B, S = q_index.shape
    dev = q_index.device
    # Query rows padded to a multiple of FLEX_BLOCK (as `ttt_attention_flex` does): below 128
    # rows inductor lowers flex to its decoding kernel, which has no backward (a short
    # sequence with few anchors). A padding row carries anchor and index PAD: it sees the
    # context (finite), nobody sees it, and it is dropped.
    Sp = -(-S // FLEX_BLOCK) * FLEX_BLOCK
    if Sp != S:
        q_index = F.pad(q_index, (0, Sp - S), value=PAD)
        q_anchor = F.pad(q_anchor, (0, Sp - S), value=PAD)
    masks = {}
    for key in set(keys):
        # Tensor flags, not the Python key: see `visible` (a compiled mask reused across keys).
        causal_t, window_t = mask_flags(*key, dev)

        def mask_mod(b, h, q, kv, causal_t=causal_t, window_t=window_t):
            qi, qa, ki, ka = q_index[b, q], q_anchor[b, q], k_index[b, kv], k_anchor[b, kv]
            return visible(qi, qa, ki, ka, causal_t, window_t)

        masks[key] = create_block_mask(
            mask_mod, B, None, Sp, k_index.shape[1], device=dev, _compile=dev.type == "cuda"
        )
    flex = flex_fn(dev)

    # Run eagerly under a compiled decoder block (a graph break): flex is compiled on its
    # own, once, whatever the block mask of the step.
    @torch.compiler.disable
    def attn_flex(layer: int, q, k, v):
        kc, vc = ctx_kv[layer]
        kk = torch.cat([kc, k.to(kc.dtype)], 1).transpose(1, 2)
        vv = torch.cat([vc, v.to(vc.dtype)], 1).transpose(1, 2)
        qh = F.pad(q.transpose(1, 2), (0, 0, 0, Sp - S))  # [B, h, Sp, D]
        o = flex(
            qh,
            kk.to(q.dtype),
            vv.to(q.dtype),
            block_mask=masks[keys[layer]],
            enable_gqa=kk.shape[1] != q.shape[2],
        )
        return o[:, :, :S].transpose(1, 2)

    return attn_flex
