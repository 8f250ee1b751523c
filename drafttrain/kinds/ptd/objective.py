"""Parallel-drafting (P-EAGLE / PTD) objective: K drafts from one forward.

Rows and slots (conventions 1, 3, 9):
- depth-0 rows are EAGLE-3's first pass: row `i` consumes `(t_{i+1}, fc(f_i))` at `pos_i` and
  predicts `t_{i+2}` (target distribution at row `i+1`);
- for a sampled *anchor* row `i`, the depth-`d` slot (d = 1..K-1) consumes the mask token and
  `fc(mask_hidden)` at position `pos_i + d` and predicts `t_{i+2+d}` (target distribution at
  row `i+1+d`): exactly what mask slot `d` computes in the runner when row `i` is the last
  committed row.

Attention (the same predicate builds the eager mask and the flex block mask): a depth-0 row
sees depth-0 rows up to itself (causal); a depth-d slot of anchor `i` sees depth-0 rows
`j <= i` and the slots of its own rollout with depth `<= d`. Nothing else.

Conditional drop-token sampling bounds memory: an anchor keeps its depth-d slot with
probability `keep_ratio` *given* it kept depth d-1 (so a kept slot always has its whole
lower rollout, as in the runner), with at least `keep_floor` of the anchors kept at every
depth and at most `max_slots_per_seq` slots per sequence. The number of slots is
`~ T * sum_d keep_ratio^d`: linear in K at a fixed budget. A budget that binds (long
sequences) is spread over the depths (`depth_reserves`), never spent on depth 1 alone, and
the per-depth slot counts are logged (`slots_d`). Sampling uses the global CPU RNG,
which checkpoints save, so resumes stay exact.
"""

from __future__ import annotations

import math

import torch

from draftinfer.conventions.window import TokenEmbeds, shift_left
from draftinfer.kinds.ptd import PTDDrafter
from draftinfer.models.layers import causal_attention
from draftinfer.models.target import TargetOutput
from drafttrain.frozen.head import target_distribution
from drafttrain.kinds.ptd.config import PTDTrainConfig
from drafttrain.objectives.fused_ce import linear_soft_ce
from drafttrain.objectives.loss_fns import SOFT_CE
from drafttrain.objectives.losses import DraftLoss
from drafttrain.objectives.position_loss import RowPart, dpace_row_weights

PAD_ANCHOR = 1 << 30  # anchor/depth of padding slots: they see depth-0 rows, nobody sees them


def ptd_mask_mod(anchor: torch.Tensor, depth: torch.Tensor):
    """mask_mod(b, h, q, k) -> may q attend to k; anchor/depth `[B, N]` per slot."""

    def mask_mod(b, h, q, k):
        aq, ak = anchor[b, q], anchor[b, k]
        dq, dk = depth[b, q], depth[b, k]
        return ((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq))

    return mask_mod


def ptd_dense_mask(anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """The same predicate as a bool `[B, N, N]` tensor (eager / CPU path)."""
    B, N = anchor.shape
    b = torch.arange(B, device=anchor.device)[:, None, None]
    i = torch.arange(N, device=anchor.device)
    return ptd_mask_mod(anchor, depth)(b, 0, i[None, :, None], i[None, None, :])


def ptd_block_mask(anchor: torch.Tensor, depth: torch.Tensor, q_blocks_per_chunk: int = 16):
    """The flex `BlockMask` of the predicate, evaluated block row by block row: at most
    `[B, 16 * 128, N]` bools at a time instead of `create_block_mask`'s dense `[B, N, N]` (and
    its int64 indexing intermediates), which at 32k tokens plus slots would not fit."""
    from drafttrain.objectives.ttt import FLEX_BLOCK, block_mask_from_blocks

    B, N = anchor.shape
    dev = anchor.device
    nb = -(-N // FLEX_BLOCK)
    Np = nb * FLEX_BLOCK
    # Padded to whole blocks; padded rows/keys are out of range (never full, never visible).
    a = torch.full((B, Np), PAD_ANCHOR, dtype=anchor.dtype, device=dev)
    dp = torch.full((B, Np), PAD_ANCHOR, dtype=depth.dtype, device=dev)
    a[:, :N], dp[:, :N] = anchor, depth
    k_in = torch.arange(Np, device=dev) < N  # [Np]
    ak, dk = a[:, None, :], dp[:, None, :]  # [B, 1, Np]
    partial = torch.zeros(B, 1, nb, nb, dtype=torch.bool, device=dev)
    full = torch.zeros_like(partial)
    for q0 in range(0, nb, q_blocks_per_chunk):
        q1 = min(nb, q0 + q_blocks_per_chunk)
        rows = slice(q0 * FLEX_BLOCK, q1 * FLEX_BLOCK)
        aq, dq = a[:, rows, None], dp[:, rows, None]  # [B, c, 1]
        q_in = (torch.arange(Np, device=dev) < N)[rows, None]
        m = (((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq))) & q_in & k_in  # [B, c, Np]
        m = m.view(B, q1 - q0, FLEX_BLOCK, nb, FLEX_BLOCK)
        partial[:, 0, q0:q1] = m.any(4).any(2)
        full[:, 0, q0:q1] = m.all(4).all(2)
    return block_mask_from_blocks(partial & ~full, full, ptd_mask_mod(anchor, depth), N)


def make_attention(anchor: torch.Tensor, depth: torch.Tensor, backend: str):
    """attn_fn(layer, q, k, v) over the combined rows+slots sequence."""
    if backend != "eager":  # flash / cudnn: TTT's dense causal kernels; ptd's mask is flex's
        from drafttrain.objectives.ttt import flex_fn

        block = ptd_block_mask(anchor, depth)
        flex = flex_fn(anchor.device)

        # Run eagerly under a compiled decoder block (a graph break): flex is compiled on its
        # own, once, whatever the block mask of the step.
        @torch.compiler.disable
        def attn_flex(_layer, q, k, v):
            o = flex(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                block_mask=block,
                enable_gqa=k.shape[2] != q.shape[2],
            )
            return o.transpose(1, 2)

        return attn_flex
    mask = ptd_dense_mask(anchor, depth)[:, None]  # [B, 1, N, N]

    def attn_eager(_layer, q, k, v):
        return causal_attention(q, k, v, mask=mask)

    return attn_eager


def depth_reserves(n: int, k: int, keep_ratio: float, need: int, max_slots: int) -> list[int]:
    """`reserve[d]` (d = 1..k-1, index 0 unused): slots held back for depths deeper than d
    when depth d is sampled, so a binding `max_slots` is spread over every depth instead of
    being spent on depth 1. Depth e may claim `min(its share, what it would keep unbounded)`,
    its share being `max_slots * keep_ratio^(e-1) / sum_e keep_ratio^(e-1)` (at least 1)."""
    weights = [keep_ratio ** (e - 1) for e in range(1, k)]
    total_w = sum(weights) or 1.0
    claim = [0] * (k + 1)
    for e in range(1, k):
        share = max(1, int(max_slots * weights[e - 1] / total_w))
        expected = max(math.ceil(n * keep_ratio**e), min(need, n))
        claim[e] = min(share, expected)
    return [sum(claim[e + 1 : k]) for e in range(k)]


def sample_slots(
    candidates: torch.Tensor, k: int, keep_ratio: float, keep_floor: float, max_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conditional drop-token sampling for one sequence.

    candidates `[n]` anchor rows -> (anchors `[S]`, depths `[S]`), depth-major order, `S <=
    max_slots`. When the budget binds, each depth keeps at most what is left after the
    deeper depths' reserves (`depth_reserves`), chosen uniformly among its eligible anchors,
    so every depth trains at every sequence length (when the budget does not bind, nothing
    is trimmed and the draws are those of unbounded sampling)."""
    anchors, depths = [], []
    prev = candidates
    need = math.ceil(keep_floor * candidates.numel())
    reserve = depth_reserves(candidates.numel(), k, keep_ratio, need, max_slots)
    total = 0
    for d in range(1, k):
        if prev.numel() == 0 or total >= max_slots:
            break
        keep = torch.rand(prev.numel()) < keep_ratio
        short = min(need, prev.numel()) - int(keep.sum())
        if short > 0:  # the floor: top up from this depth's eligible anchors
            dropped = (~keep).nonzero().flatten()
            keep[dropped[torch.randperm(dropped.numel())[:short]]] = True
        prev = prev[keep.to(prev.device)]
        quota = max(max_slots - total - reserve[d], 0)
        if prev.numel() > quota:  # the budget binds: a uniform subset, kept in row order
            pick = torch.randperm(prev.numel())[:quota].sort().values
            prev = prev[pick.to(prev.device)]
        anchors.append(prev)
        depths.append(torch.full_like(prev, d))
        total += prev.numel()
    if not anchors:
        empty = candidates.new_zeros(0)
        return empty, empty
    return torch.cat(anchors), torch.cat(depths)


class PTDObjective:
    """Rows + sampled mask slots in one forward; `trainer.loss` per depth (`dpace`: D-PACE
    weights per anchor's rollout, its depth-0 row and its slots)."""

    def __init__(self, drafter: PTDDrafter, cfg: PTDTrainConfig, backend: str, loss=SOFT_CE):
        self.drafter, self.cfg, self.backend, self.loss = drafter, cfg, backend, loss

    def forward_slots(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        rope_pos: torch.Tensor,
        slot_anchor: list[torch.Tensor],
        slot_depth: list[torch.Tensor],
        mm: TokenEmbeds | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward_slots_normed` with the head applied: (logits `[B, T + S, Dd]`, anchor,
        depth)."""
        normed, anchor, depth = self.forward_slots_normed(
            input_ids, features, rope_pos, slot_anchor, slot_depth, mm
        )
        return self.drafter.logits(normed), anchor, depth

    def forward_slots_normed(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        rope_pos: torch.Tensor,
        slot_anchor: list[torch.Tensor],
        slot_depth: list[torch.Tensor],
        mm: TokenEmbeds | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over `[T depth-0 rows | S slots]` per sequence.

        input_ids `[B, T]`, rope_pos `[B, T]` / `[3, B, T]`, target features `[B, T, 3H]`,
        slot lists per sequence, mm: the target's multimodal input embeddings, unshifted ->
        (normed hidden `[B, T + S, H]` (the head's input), anchor `[B, T + S]`, depth
        `[B, T + S]`). A depth-d slot of
        anchor i sits at `rope_pos[..., i] + d` on every axis (convention 3); depth-0 row i
        consumes t_{i+1} with its vision embedding, mask slots the mask token."""
        d = self.drafter
        B, T = input_ids.shape
        dev = input_ids.device
        S = max([int(a.numel()) for a in slot_anchor] + [0])
        N = T + S
        ids = torch.full((B, N), d.config.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :T] = shift_left(input_ids, 1)  # row i consumes t_{i+1}
        pos = torch.zeros(*rope_pos.shape[:-2], B, N, dtype=torch.long, device=dev)
        pos[..., :T] = rope_pos
        anchor = torch.full((B, N), PAD_ANCHOR, dtype=torch.long, device=dev)
        depth = torch.full((B, N), PAD_ANCHOR, dtype=torch.long, device=dev)
        anchor[:, :T] = torch.arange(T, device=dev)
        depth[:, :T] = 0
        for b in range(B):
            n = slot_anchor[b].numel()
            a, dp = slot_anchor[b].to(dev), slot_depth[b].to(dev)
            anchor[b, T : T + n], depth[b, T : T + n] = a, dp
            pos[..., b, T : T + n] = rope_pos[..., b, a] + dp  # mask slot m at p_anchor + m
        feature = torch.zeros(B, N, d.config.hidden_size, device=dev, dtype=d.fc.weight.dtype)
        feature[:, :T] = d.project_features(features)
        is_slot = depth[:, T:] < PAD_ANCHOR
        feature[:, T:] = torch.where(is_slot[..., None], d.mask_feature(), feature[:, T:])
        mm_rows = None
        if mm is not None:
            shifted = mm.shifted(1)
            mask = torch.zeros(B, N, dtype=torch.bool, device=dev)
            mask[:, :T] = shifted.mask
            embeds = shifted.embeds.new_zeros(B, N, shifted.embeds.shape[-1])
            embeds[:, :T] = shifted.embeds
            mm_rows = TokenEmbeds(mask, embeds)
        attn = make_attention(anchor, depth, self.backend)
        normed, _ = d(ids, feature, pos, attn, mm_rows)
        return normed, anchor, depth

    def anchor_logits(
        self,
        ids: torch.Tensor,
        features: torch.Tensor,
        rope_pos: torch.Tensor,
        anchor: int,
        k: int,
        mm: TokenEmbeds | None = None,
    ) -> torch.Tensor:
        """The logits training gives for the k drafts after committed row `anchor`: the row
        itself and its k-1 mask slots, `[k, Dd]` (S9)."""
        return self.anchors_logits(ids, features, rope_pos, [anchor], k, mm)[0]

    def anchors_logits(self, ids, features, rope_pos, anchors: list[int], k: int, mm=None):
        """`anchor_logits` of several distinct anchors of one sequence in one forward (each anchor's
        k - 1 mask slots side by side, as training lays them out) `[A, k, Dd]`."""
        return self.drafter.logits(self.anchors_hidden(ids, features, rope_pos, anchors, k, mm))

    def anchors_hidden(self, ids, features, rope_pos, anchors: list[int], k: int, mm=None):
        """The head's inputs of `anchors_logits` `[A, k, H]` (differentiable; on-policy
        training, `drafttrain.objectives.opd`)."""
        T, A = ids.shape[1], len(anchors)
        idx = torch.as_tensor(anchors)
        slots = [idx.repeat_interleave(k - 1)], [torch.arange(1, k).repeat(A)]
        normed, _, _ = self.forward_slots_normed(ids, features, rope_pos, *slots, mm)
        first = normed[0, idx.to(normed.device)][:, None]  # [A, 1, H]
        rest = normed[0, T : T + A * (k - 1)].reshape(A, k - 1, normed.shape[-1])
        return torch.cat([first, rest], 1)

    def __call__(
        self, batch: dict[str, torch.Tensor], tgt: TargetOutput
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c, d = self.cfg, self.drafter
        K = c.parallel_k
        input_ids = batch["input_ids"]
        B, T = input_ids.shape
        # The target's distribution over the draft vocabulary per flat row `b * T + t`.
        dist = target_distribution(tgt, d.draft_vocab_ids())
        in_draft = dist.in_vocab.view(B, T)
        loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        # Anchors worth a depth-1 slot: their t_{i+3} is an assistant token. Sampling runs on
        # the host (the global CPU RNG, checkpointed), so this reads the mask there once.
        cand = shift_left(loss_mask, 3, False).cpu()
        anchors, depths = [], []
        for b in range(B):
            a, dp = sample_slots(
                cand[b].nonzero().flatten(),
                K,
                c.keep_ratio,
                c.keep_floor,
                c.max_slots_per_seq,
            )
            anchors.append(a)
            depths.append(dp)
        # RoPE positions: the ones the target used (for Qwen3-VL its own [3, B, T] table).
        normed, anchor, depth = self.forward_slots_normed(
            input_ids, tgt.features, tgt.rope_pos, anchors, depths, TokenEmbeds.of(tgt)
        )
        # Row/slot with anchor i at depth dd predicts the target distribution at row i+1+dd,
        # read from the distribution table through an index (no gathered copy).
        real = depth < PAD_ANCHOR
        src = torch.where(real, anchor + 1 + depth, 0)  # [B, N]
        inside = real & (src < T)
        src = src.clamp(max=T - 1)
        bidx = torch.arange(B, device=src.device)[:, None]
        nxt = (src + 1).clamp(max=T - 1)
        valid = inside & (src + 1 < T) & loss_mask[bidx, nxt] & in_draft[bidx, src]
        hidden, rows = normed.flatten(0, 1), (bidx * T + src).flatten()
        group = torch.where(valid, depth, -1).flatten()
        row_w, shown = None, None
        if self.loss.weights_dpace:  # an anchor's rollout: its depth-0 row and its slots
            part = RowPart(
                hidden,
                rows,
                (bidx * T + anchor.clamp(max=T - 1)).flatten(),
                group.clamp(min=0),
                valid.flatten(),
            )
            w, plain = dpace_row_weights([part], d.lm_head.weight, dist.probs, dist.top1, B * T, K)
            row_w = w[0]
            shown = [(plain[0] * (group == dd)).sum() for dd in range(K)]
        loss_sum, hits, count = linear_soft_ce(
            hidden,
            d.lm_head.weight,
            dist.probs,
            rows,
            dist.top1,
            group,
            K,
            loss=self.loss,
            row_weight=row_w,
        )
        # Slots per depth (depth 0: every row), counted on the host from the sampled lists.
        per_depth = torch.bincount(torch.cat(depths), minlength=K)
        out = DraftLoss(src.device)
        for dd in range(K):
            w = 1.0 if row_w is not None else c.depth_decay**dd
            out.add_sums(
                dd, loss_sum[dd], hits[dd], count[dd], w, None if shown is None else shown[dd]
            )
            out.metrics[f"slots_{dd}"] = float(B * T if dd == 0 else per_depth[dd])
        return out.result(loss_mask)

    def checkpoint_meta(self) -> dict:
        c = self.cfg
        return {
            "parallel_k": c.parallel_k,
            "serving_k": c.parallel_k,
            "keep_ratio": c.keep_ratio,
            "keep_floor": c.keep_floor,
            "depth_decay": c.depth_decay,
        }
