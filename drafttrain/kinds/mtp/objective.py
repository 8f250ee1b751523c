"""Multi-layer MTP objective: N modules over the whole sequence, soft cross-entropy each.

Rows (conventions 1, 4, 5): module k at row i consumes the teacher-forced token `t_{i+k+1}`
at RoPE position `pos_i + k` (`draft_step_positions`, the runner's function) with `h_in` = the
target's final hidden state `f_i` for module 0, and module k-1's output at row i (chained,
`mtp_carry`) or `f_i` again (not chained) for module k; it predicts `t_{i+k+2}`: the target's
distribution at row `i+k+1` over the full vocabulary (the head is the target's, frozen).
Attention is plain causal attention within each module (in the runner, module k's KV cache
holds exactly these rows). A row counts in module k's loss when `t_{i+k+2}` is an assistant
token. Module k's loss weight is 1 (`uniform`) or `loss_decay^k` (`geometric`).

Metrics: per-module loss and top-1 accuracy (argmax == target argmax), and the simulated
acceptance length `1 + sum_k prod_{s<=k} acc_s`.
"""

from __future__ import annotations

import torch

from draftinfer.kinds.mtp import MTPDrafter
from draftinfer.positions import draft_step_positions
from draftinfer.proposer import causal_attn
from draftinfer.target import TargetOutput
from draftinfer.window import shift_left
from drafttrain.kinds.mtp.config import MTPTrainConfig
from drafttrain.losses import DraftLoss, soft_cross_entropy, top1_agrees


class MTPObjective:
    def __init__(self, drafter: MTPDrafter, cfg: MTPTrainConfig, backend: str):
        self.drafter, self.cfg, self.backend = drafter, cfg, backend

    def module_logits(
        self, input_ids: torch.Tensor, features: torch.Tensor, rope_pos: torch.Tensor, n: int
    ) -> list[torch.Tensor]:
        """Full-vocabulary logits `[B, T, V]` of modules 0..n-1 (teacher-forced tokens)."""
        d = self.drafter
        feat = features.to(d.lm_head.weight.dtype)
        carry, out = feat, []
        for k in range(n):
            h_in = carry if (k > 0 and d.config.mtp_chain) else feat
            normed, pre = d(
                k,
                shift_left(input_ids, 1 + k),
                h_in,
                draft_step_positions(rope_pos, k),
                causal_attn,
            )
            carry = d.carry(normed, pre)
            out.append(d.logits(normed))
        return out

    def anchor_logits(self, ids, features, rope_pos, anchor: int, k: int) -> torch.Tensor:
        """Module j's logits at row `anchor` for j < k: what the runner's draft step j gives
        after committed row `anchor` (S9). `[k, V]`"""
        return torch.stack([lg[0, anchor] for lg in self.module_logits(ids, features, rope_pos, k)])

    def __call__(
        self, batch: dict[str, torch.Tensor], tgt: TargetOutput
    ) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        N = self.drafter.config.n_predict
        tlog = tgt.logits
        target_p = torch.softmax(tlog, dim=-1)  # [B, T, V]
        loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        logits = self.module_logits(batch["input_ids"], tgt.features, tgt.rope_pos, N)
        out = DraftLoss(tlog.device)
        for k, lg in enumerate(logits):
            p_k = shift_left(target_p, 1 + k)  # row i: the target's distribution at i+k+1
            valid = shift_left(loss_mask, 2 + k, False)  # t_{i+k+2} is an assistant token
            weight = 1.0 if c.loss_weights == "uniform" else c.loss_decay**k
            out.add(k, soft_cross_entropy(lg, p_k), top1_agrees(lg, p_k), valid, weight)
        return out.result(loss_mask)

    def checkpoint_meta(self) -> dict:
        c = self.cfg
        n = self.drafter.config.n_predict
        return {"serving_k": n, "loss_weights": c.loss_weights, "loss_decay": c.loss_decay}
