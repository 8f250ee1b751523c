"""Proposers: turn a drafter into K drafts per request per round.

A proposer owns the drafter's KV cache. Each round it receives the *first pass* of every
active request: the drafter rows that the last commit made final, i.e. row `i` consuming
`(t_{i+1}, f_i)` at position `pos_i` with the *target's* features (convention 1). Writing
those rows refreshes the drafter KV at committed positions from target features, replacing
whatever the previous round's chain wrote there from its own guesses (convention 6). The
last first-pass row yields draft 1; the chain then feeds each draft back with the drafter's
own pre-norm output as the carried feature (convention 5) at `pos_last + step`
(`draft_step_positions`, convention 4), with positions and masks rebuilt for every step
(convention 7).

Shapes: rows `[B]` (cache rows), first-pass tensors padded to `[B, T]` with position -1 at
padding slots, `num_drafts [B]` the per-request draft cap (near `max_model_len` or
`max_tokens` a request drafts fewer than K).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftinfer.drafters.layers import causal_attention
from draftinfer.errors import CheckpointError
from draftinfer.kv_cache import StaticKVCache
from draftinfer.positions import draft_step_positions

# choose(draft_logits [B, Dd], step) -> (draft ids in the draft vocabulary [B],
#                                        q over the draft vocabulary [B, Dd] or None)
DraftChooser = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]


def greedy_chooser(logits: torch.Tensor, step: int) -> tuple[torch.Tensor, None]:
    return logits.argmax(-1), None


def _causal(_layer, q, k, v):
    return causal_attention(q, k, v)


class _Proposer:
    """What every proposer shares: the drafter's KV cache, the check that the checkpoint's
    drafting mode matches (S8), and recording the K drafts (and q) step by step."""

    parallel: bool  # whether this proposer runs parallel (mask_hidden) drafters
    mode_error: str

    def __init__(
        self, drafter, max_batch: int, max_seq_len: int, device: torch.device, dtype: torch.dtype
    ):
        if drafter.parallel != self.parallel:
            raise CheckpointError(self.mode_error)
        c = drafter.config
        self.drafter, self.max_seq_len = drafter, max_seq_len
        self.cache = StaticKVCache(
            c.num_hidden_layers,
            max_batch,
            max_seq_len,
            c.num_key_value_heads,
            c.head_dim,
            device,
            dtype,
        )

    def _record(
        self,
        drafts: torch.Tensor,
        qs: torch.Tensor | None,
        step: int,
        logits: torch.Tensor,
        live: torch.Tensor,
        choose: DraftChooser,
    ):
        """Pick draft `step` from logits `[B, Dd]`; requests past their cap (`live` False)
        get 0 and q = 0. Returns the (lazily allocated) q buffer `[B, k, Dd]` or None."""
        choice, q = choose(logits, step)
        drafts[:, step] = torch.where(live, self.drafter.draft_to_target(choice), 0)
        if q is not None:
            if qs is None:
                qs = torch.zeros(*drafts.shape, q.shape[-1], dtype=q.dtype, device=q.device)
            qs[:, step] = q * live[:, None]
        return qs


class Eagle3ChainProposer(_Proposer):
    """Chain drafting with an EAGLE-3 drafter: K drafter forwards per round."""

    kind = "eagle3"
    parallel = False
    mode_error = "this drafter has mask_hidden (parallel drafting); it cannot run in chain mode"

    @torch.no_grad()
    def propose(
        self,
        rows: torch.Tensor,
        ids: torch.Tensor,
        aux: torch.Tensor,
        positions: torch.Tensor,
        num_drafts: torch.Tensor,
        k: int,
        choose: DraftChooser = greedy_chooser,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> draft target ids `[B, k]` (0 past a request's cap) and, when `choose` returns q,
        the draft-vocabulary probabilities `[B, k, Dd]` (zeros past the cap)."""
        d = self.drafter
        B = rows.shape[0]
        ar = torch.arange(B, device=rows.device)
        feature = d.project_aux(aux.to(d.fc.weight.dtype))
        normed, pre = d(ids, feature, positions, self.cache.bind(positions, rows))
        last = (positions >= 0).sum(1) - 1  # [B] index of each request's last first-pass row
        base = positions[ar, last]  # [B] position of that row (pos_i, convention 1)
        logits = d.logits(normed[ar, last])  # [B, Dd]
        carried = pre[ar, last][:, None]  # [B, 1, H]
        drafts = torch.zeros(B, k, dtype=torch.long, device=rows.device)
        qs = None
        for step in range(k):
            if step > 0:
                pos = draft_step_positions(base, step)[:, None]  # [B, 1], rebuilt every step
                pos = torch.where(num_drafts[:, None] > step, pos, torch.full_like(pos, -1))
                tok = drafts[:, step - 1 : step]
                normed, carried = d(tok, carried, pos, self.cache.bind(pos, rows))
                logits = d.logits(normed[:, 0])
            qs = self._record(drafts, qs, step, logits, num_drafts > step, choose)
        return drafts, qs

    @staticmethod
    @torch.no_grad()
    def reference_drafts(
        d, ids: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, n: int, choose: DraftChooser
    ) -> tuple[list[int], list]:
        """No-cache reference for one request: rows `[R]` (ids, carried features `[R, H]`,
        positions) -> n drafts, recomputing the drafter over all rows for every step."""
        drafts, qs = [], []
        base = pos[-1:]
        for step in range(n):
            normed, pre = d(ids[None], feats[None], pos[None], _causal)
            choice, q = choose(d.logits(normed[:, -1]), step)
            tok = int(d.draft_to_target(choice)[0])
            drafts.append(tok)
            qs.append(q)
            # The chained draft: its own pre-norm output, one position further.
            ids = torch.cat([ids, ids.new_tensor([tok])])
            feats = torch.cat([feats, pre[0, -1:]])
            pos = torch.cat([pos, draft_step_positions(base, step + 1)])
        return drafts, qs


class ParallelProposer(_Proposer):
    """Parallel drafting (`ptd`): ONE drafter forward per round yields K drafts.

    The first pass is laid out as `valid | bonus | K-1 mask slots | rejected-as-padding`
    (`draftkernels.parallel_layout`, convention 9): the last committed row gives draft 1 and
    mask slot `m` (token `mask_token_id`, feature `fc(mask_hidden)`, position `p_last + m`)
    gives draft `m + 1`. Committed rows still carry target features, so the same forward also
    refreshes the drafter KV at committed positions (convention 6); mask-slot KV past the
    committed length is stale after the commit and overwritten before it is read.
    """

    kind = "ptd"
    parallel = True
    mode_error = (
        "this drafter has no mask_hidden (a chain EAGLE-3 drafter); it cannot run in parallel mode"
    )

    @torch.no_grad()
    def propose(
        self,
        rows: torch.Tensor,
        ids: torch.Tensor,
        aux: torch.Tensor,
        positions: torch.Tensor,
        num_drafts: torch.Tensor,
        k: int,
        choose: DraftChooser = greedy_chooser,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from draftkernels.parallel_layout import parallel_layout

        d = self.drafter
        if k > d.config.parallel_k:
            raise CheckpointError(
                f"k={k} exceeds the K={d.config.parallel_k} this parallel drafter was trained for"
            )
        B = rows.shape[0]
        n_valid = (positions >= 0).sum(1)
        out_ids, out_pos, src, sample_idx, _ = parallel_layout(
            ids.contiguous(),
            n_valid,
            positions[:, 0].contiguous(),
            num_drafts.contiguous(),
            k,
            d.config.mask_token_id,
            self.max_seq_len,
        )
        feature = d.project_aux(aux.to(d.fc.weight.dtype))  # [B, T, H]
        bidx = torch.arange(B, device=rows.device)[:, None]
        feat = feature[bidx, src.clamp(min=0)]  # [B, T + K - 1, H]
        feat = torch.where((src == -1)[..., None], d.mask_feature().to(feat.dtype), feat)
        normed, _ = d(out_ids, feat, out_pos, self.cache.bind(out_pos, rows))
        logits = d.logits(normed[bidx, sample_idx.clamp(min=0)])  # [B, K, Dd]
        drafts = torch.zeros(B, k, dtype=torch.long, device=rows.device)
        qs = None
        for step in range(k):
            qs = self._record(drafts, qs, step, logits[:, step], sample_idx[:, step] >= 0, choose)
        return drafts, qs

    @staticmethod
    @torch.no_grad()
    def reference_drafts(
        d, ids: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, n: int, choose: DraftChooser
    ) -> tuple[list[int], list]:
        """No-cache reference: rows + n-1 mask slots at `p_last + m` in one causal forward
        (positions increase along the sequence, so plain causal attention is exactly the
        parallel pattern: a mask slot sees every row and the lower mask slots)."""
        if n == 0:
            return [], []
        m = torch.arange(1, n, device=ids.device)
        ids = torch.cat([ids, torch.full_like(m, d.config.mask_token_id)])
        feats = torch.cat([feats, d.mask_feature()[None].expand(n - 1, -1).to(feats.dtype)])
        pos = torch.cat([pos, pos[-1] + m])
        normed, _ = d(ids[None], feats[None], pos[None], _causal)
        logits = d.logits(normed[0, -n:])  # last row, then the mask slots
        drafts, qs = [], []
        for step in range(n):
            choice, q = choose(logits[step : step + 1], step)
            drafts.append(int(d.draft_to_target(choice)[0]))
            qs.append(q)
        return drafts, qs


PROPOSERS: dict[str, type] = {"eagle3": Eagle3ChainProposer, "ptd": ParallelProposer}
