"""Parallel drafting (`ptd`): ONE drafter forward per round yields K drafts.

The first pass is laid out as `valid (pending row last) | K-1 mask slots | rejected-as-padding`
(`draftkernels.parallel_layout`, convention 9): the last committed row gives draft 1 and
mask slot `m` (token `mask_token_id`, feature `fc(mask_hidden)`, cache index and RoPE
position `p_last + m` on every axis) gives draft `m + 1`. Committed rows still carry target
features, so the same forward also refreshes the drafter KV at committed positions
(convention 6); mask-slot KV past the committed length is stale after the commit and is
overwritten before it is read.
"""

from __future__ import annotations

import torch
from draftkernels.parallel_layout import parallel_layout

from draftinfer.decoding.proposer import (
    DraftChooser,
    FirstPass,
    causal_attn,
    greedy_chooser,
    last_valid,
)
from draftinfer.files.errors import CheckpointError
from draftinfer.kinds.eagle3.proposer import Eagle3ChainProposer, pad_rows


class ParallelProposer(Eagle3ChainProposer):
    """Shares the chain proposer's cache, admit and compiled forward; drafts in one forward."""

    mode = "parallel drafting"

    @torch.no_grad()
    def propose(
        self,
        first_pass: FirstPass,
        num_drafts: torch.Tensor,
        k: int,
        choose: DraftChooser = greedy_chooser,
        attn_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        d, fp = self.drafter, first_pass
        if k > d.config.parallel_k:
            raise CheckpointError(
                f"k={k} exceeds the K={d.config.parallel_k} this parallel drafter was trained for"
            )
        B = fp.ids.shape[0]
        dev = fp.ids.device
        n_valid = (fp.cache_pos >= 0).sum(1)
        out_ids, out_cache, src, sample_idx, _ = parallel_layout(
            fp.ids.contiguous(),
            n_valid,
            fp.cache_pos[:, 0].contiguous(),
            num_drafts.contiguous(),
            k,
            d.config.mask_token_id,
            self.max_seq_len,
        )
        # RoPE positions: committed rows keep their own; mask slot m sits at p_last + m on
        # every axis (convention 3), counted from the request's last committed row.
        ar = torch.arange(B, device=dev)
        rope_last = fp.rope_pos[..., ar, last_valid(fp.cache_pos)]  # [B] / [3, B]
        cols = torch.arange(out_ids.shape[1], device=dev)
        m = cols[None, :] - (n_valid - 1)[:, None]  # [B, W] mask slot number
        src0 = src.clamp(min=0)
        index = src0.expand(*fp.rope_pos.shape[:-2], *src0.shape)  # [B, W] / [3, B, W]
        rope_rows = torch.gather(fp.rope_pos, -1, index)
        rope = torch.where(src >= 0, rope_rows, rope_last[..., None] + m)
        feature = d.project_features(fp.features)  # [B, T, H]
        feat = feature[ar[:, None], src0]  # [B, W, H]
        feat = torch.where((src == -1)[..., None], d.mask_feature().to(feat.dtype), feat)
        normed, _ = self._run(out_ids, feat, rope, fp.rows, out_cache, attn_len)
        logits = d.logits(normed[ar[:, None], sample_idx.clamp(min=0)])  # [B, K, Dd]
        drafts = torch.zeros(B, k, dtype=torch.long, device=dev)
        return drafts, self._record_all(drafts, logits, sample_idx >= 0, choose)

    @staticmethod
    @torch.no_grad()
    def reference_drafts(drafter, ids, features, rope_pos, n, choose, mm=None):
        """No-cache reference: rows + n-1 mask slots at `p_last + m` in one causal forward
        (positions increase along the sequence, so plain causal attention is exactly the
        parallel pattern: a mask slot sees every row and the lower mask slots). `mm`: as
        `Eagle3ChainProposer.reference_drafts` (rows only; mask slots consume the mask token)."""
        d = drafter
        if n == 0:
            return [], []
        m = torch.arange(1, n, device=ids.device)
        ids = torch.cat([ids, torch.full_like(m, d.config.mask_token_id)])
        feats = d.project_features(features)
        feats = torch.cat([feats, d.mask_feature()[None].expand(n - 1, -1).to(feats.dtype)])
        rope_pos = torch.cat([rope_pos, rope_pos[..., -1:] + m], dim=-1)
        rows_mm = None if mm is None else pad_rows(mm, len(ids))
        normed, _ = d(ids[None], feats[None], rope_pos[..., None, :], causal_attn, rows_mm)
        logits = d.logits(normed[0, -n:])  # last row, then the mask slots
        ids_t = d.draft_vocab_ids()
        drafts, qs = [], []
        for step in range(n):
            choice, q = choose(logits[step : step + 1], step)
            drafts.append(int(ids_t[choice][0]))
            qs.append(q)
        return drafts, qs
