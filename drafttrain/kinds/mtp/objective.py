"""Multi-layer MTP objective: N modules over the whole sequence, each scored with `trainer.loss`.

Rows (conventions 1, 4, 5): module k at row i consumes the teacher-forced token `t_{i+k+1}`
at RoPE position `pos_i + k` (`mrv2` layout: `pos_i`; `module_positions`, the runner's
function) with `h_in` = the target's final hidden state `f_i` for module 0, and module k-1's
output at row i (chained,
`mtp_carry`) or `f_i` again (not chained) for module k; it predicts `t_{i+k+2}`: the target's
distribution at row `i+k+1` over the full vocabulary (the head is the target's, frozen).
Attention is plain causal attention within each module (in the runner, module k's KV cache
holds exactly these rows). A row counts in module k's loss when `t_{i+k+2}` is an assistant
token. A row's loss is `trainer.loss` (`drafttrain.objectives.loss_fns`, soft cross-entropy by default);
module k's loss weight is 1 (`uniform`) or `loss_decay^k` (`geometric`), or D-PACE per row
(`trainer.loss=dpace`, the anchor being row i).

Metrics: per-module loss and top-1 accuracy (argmax == target argmax), and the simulated
acceptance length `1 + sum_k prod_{s<=k} acc_s`.
"""

from __future__ import annotations

import torch

from draftinfer.conventions.window import TokenEmbeds, shift_left
from draftinfer.decoding.proposer import causal_attn
from draftinfer.kinds.mtp import MTPDrafter
from draftinfer.models.target import TargetOutput
from drafttrain.frozen.head import target_distribution
from drafttrain.kinds.mtp.config import MTPTrainConfig
from drafttrain.objectives.loss_fns import SOFT_CE
from drafttrain.objectives.losses import DraftLoss
from drafttrain.objectives.position_loss import RowPart, score_positions


class MTPObjective:
    def __init__(self, drafter: MTPDrafter, cfg: MTPTrainConfig, backend: str, loss=SOFT_CE):
        self.drafter, self.cfg, self.backend, self.loss = drafter, cfg, backend, loss

    def module_normed(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        rope_pos: torch.Tensor,
        n: int,
        mm: TokenEmbeds | None = None,
    ) -> list[torch.Tensor]:
        """The normed hidden states `[B, T, H]` (the shared head's input) of modules 0..n-1
        (teacher-forced tokens; `mm`: the target's multimodal input embeddings, unshifted:
        module k's row i consumes token i+k+1 and so its embedding)."""
        d = self.drafter
        feat = features.to(d.lm_head.weight.dtype)
        carry, out = feat, []
        for k in range(n):
            h_in = carry if (k > 0 and d.config.mtp_chain) else feat
            normed, pre = d(
                k,
                shift_left(input_ids, 1 + k),
                h_in,
                d.config.module_positions(rope_pos, k),
                causal_attn,
                None if mm is None else mm.shifted(1 + k),
            )
            carry = d.carry(normed, pre)
            if self.cfg.detach_carry:
                carry = carry.detach()
            out.append(normed)
        return out

    def module_logits(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        rope_pos: torch.Tensor,
        n: int,
        mm: TokenEmbeds | None = None,
    ) -> list[torch.Tensor]:
        """Full-vocabulary logits `[B, T, V]` of modules 0..n-1 (teacher-forced tokens)."""
        d = self.drafter
        return [d.logits(x) for x in self.module_normed(input_ids, features, rope_pos, n, mm)]

    def anchor_draft_limit(self) -> int:
        """The most drafts `anchor_logits` gives: one per module (the runner's K > N module
        reuse, `step % N`, is not in the trainer's forward)."""
        return self.drafter.config.n_predict

    def anchor_logits(self, ids, features, rope_pos, anchor: int, k: int, mm=None) -> torch.Tensor:
        """Module j's logits at row `anchor` for j < k: what the runner's draft step j gives
        after committed row `anchor` (S9). `[k, V]`"""
        return self.anchors_logits(ids, features, rope_pos, [anchor], k, mm)[0]

    def anchors_logits(self, ids, features, rope_pos, anchors: list[int], k: int, mm=None):
        """`anchor_logits` of several anchors of one sequence in one pass `[A, k, V]`."""
        return self.drafter.logits(self.anchors_hidden(ids, features, rope_pos, anchors, k, mm))

    def anchors_hidden(self, ids, features, rope_pos, anchors: list[int], k: int, mm=None):
        """The head's inputs of `anchors_logits` `[A, k, H]` (differentiable; on-policy
        training, `drafttrain.objectives.opd`)."""
        idx = torch.as_tensor(anchors, device=ids.device)
        normed = self.module_normed(ids, features, rope_pos, k, mm)
        return torch.stack([h[0, idx] for h in normed], 1)

    def __call__(
        self, batch: dict[str, torch.Tensor], tgt: TargetOutput
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c, d = self.cfg, self.drafter
        N = d.config.n_predict
        dist = target_distribution(tgt)  # the whole vocabulary, per flat row b * T + t
        B, T = dist.shape
        loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        mm = TokenEmbeds.of(tgt)
        normed = self.module_normed(batch["input_ids"], tgt.features, tgt.rope_pos, N, mm)
        flat = torch.arange(B * T, device=loss_mask.device).view(B, T)
        parts = []
        for k, x in enumerate(normed):
            # Row i: the target's distribution at i+k+1 (an index, no shifted copy); counted
            # when t_{i+k+2} is an assistant token.
            valid = torch.zeros_like(loss_mask)
            valid[:, : max(T - 2 - k, 0)] = loss_mask[:, 2 + k :]
            rows = (flat + 1 + k).clamp(max=B * T - 1).flatten()
            position = torch.full_like(rows, k)  # anchor: row i (D-PACE's layout)
            parts.append(RowPart(x.flatten(0, 1), rows, flat.flatten(), position, valid.flatten()))
        out = DraftLoss(loss_mask.device)
        weights = [1.0 if c.loss_weights == "uniform" else c.loss_decay**k for k in range(N)]
        score_positions(
            out, parts, d.lm_head.weight, dist.probs, dist.top1, self.loss, weights, B * T
        )
        return out.result(loss_mask)

    def checkpoint_meta(self) -> dict:
        c = self.cfg
        n = self.drafter.config.n_predict
        return {"serving_k": n, "loss_weights": c.loss_weights, "loss_decay": c.loss_decay}
