"""EAGLE-3 training objective: training-time test (TTT) unrolling, scored with `trainer.loss`.

Batch preparation (conventions 1, 4, 5): with target tokens `t_0..t_{T-1}`, target features
`f_i` (the concatenated aux taps at token `i`) and target positions `pos_i`, drafter row `i`
at TTT step `k` (0-based)

- consumes token `t_{i+1+k}` (teacher-forced) at position `pos_i + k`
  (`draftinfer.conventions.positions.draft_step_positions`, the function the runner uses),
- consumes the carried feature `fc(f_i)` at step 0, its own step-(k-1) pre-norm output after,
- predicts `t_{i+2+k}`: the target's distribution at row `i+1+k`, restricted to the draft
  vocabulary and renormalized (soft labels).

A row counts in step k's loss when the predicted token `t_{i+2+k}` is an assistant token
(loss mask) and the target's own top-1 at row `i+1+k` lies in the draft vocabulary (a draft
model cannot be right where the target's choice is unrepresentable). Each row's loss is
`trainer.loss` (`drafttrain.objectives.loss_fns`, soft cross-entropy by default); step losses are
weighted by `decay^k` (by D-PACE per row instead with `trainer.loss=dpace`).

Metrics: per-step accuracy (draft argmax == target argmax over counted rows) and the
*simulated* acceptance length `1 + sum_k prod_{s<=k} acc_s`, which is what chained greedy
drafting would accept if step errors were independent.
"""

from __future__ import annotations

import torch

from draftinfer.conventions.positions import draft_step_positions
from draftinfer.conventions.window import TokenEmbeds, shift_left
from draftinfer.kinds.eagle3 import Eagle3Config, Eagle3Drafter
from draftinfer.models.rope import rope_from_hf
from draftinfer.models.target import TargetOutput
from drafttrain.frozen.head import target_distribution
from drafttrain.jobs.errors import ConfigError
from drafttrain.kinds.eagle3.config import Eagle3TrainConfig
from drafttrain.objectives.loss_fns import SOFT_CE
from drafttrain.objectives.losses import DraftLoss
from drafttrain.objectives.position_loss import RowPart, score_positions
from drafttrain.objectives.ttt import TTTAttention


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default taps: low, middle and high layers (2, L//2, L-3)."""
    return [2, num_layers // 2, num_layers - 3]


def drafter_config_from_target(
    cfg: Eagle3TrainConfig, target, config_cls=Eagle3Config, **extra
) -> Eagle3Config:
    """Architecture from the target's sizes plus the drafter config's overrides; a one-line
    `ConfigError` when they cannot fit."""
    info, tc = target.info, target.config
    H = info.hidden_size
    hidden = cfg.hidden_size or H
    if hidden != H:
        raise ConfigError(
            f"drafter hidden_size {hidden} does not fit target hidden_size {H}: "
            "the drafter reuses the target's token embeddings"
        )
    heads = cfg.num_attention_heads or tc.num_attention_heads
    kv = cfg.num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads
    head_dim = cfg.head_dim or getattr(tc, "head_dim", None) or H // tc.num_attention_heads
    if heads % kv:
        raise ConfigError(
            f"drafter num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    if cfg.draft_vocab_size > info.vocab_size or cfg.draft_vocab_size < 1:
        raise ConfigError(
            f"draft_vocab_size {cfg.draft_vocab_size} does not fit the target "
            f"vocabulary of {info.vocab_size}"
        )
    if cfg.num_layers < 1:
        raise ConfigError(f"drafter num_layers must be >= 1, got {cfg.num_layers}")
    aux = list(cfg.aux_layer_ids) or default_aux_layer_ids(info.num_layers)
    bad = [j for j in aux if not 0 <= j < info.num_layers]
    if bad:
        raise ConfigError(
            f"aux_layer_ids {bad} out of range for a target with {info.num_layers} decoder layers"
        )
    # The target's own rope (strict: a key we do not implement is an error), so a Qwen3-VL
    # target's drafter gets its interleaved M-RoPE.
    theta, scaling = rope_from_hf(tc, head_dim)
    return config_cls(
        hidden_size=hidden,
        intermediate_size=cfg.intermediate_size or tc.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=info.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=H,
        aux_layer_ids=aux,
        num_hidden_layers=cfg.num_layers,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        # Never shorter than the target's: a short value corrupts RoPE in engines (DESIGN 4).
        max_position_embeddings=info.max_position_embeddings,
        norm_before_residual=cfg.norm_before_residual,
        **extra,
    )


@torch.no_grad()
def init_from_target(drafter: Eagle3Drafter, target, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Frozen shared embeddings; lm_head rows and final norm start from the target's."""
    shared = target.shared_weights()
    drafter.embed_tokens.weight.copy_(shared["input_embeddings"].float())
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    ids = drafter.draft_vocab_ids().to(shared["output_embeddings"].device)
    drafter.lm_head.weight.copy_(shared["output_embeddings"].float()[ids])
    norm = target.final_norm_weight()
    if norm is not None and norm.numel() == drafter.norm.weight.numel():
        drafter.norm.weight.copy_(norm.float())


class Eagle3Objective:
    """Unrolled TTT forward + loss for one batch."""

    def __init__(self, drafter: Eagle3Drafter, cfg: Eagle3TrainConfig, backend: str, loss=SOFT_CE):
        self.drafter, self.cfg, self.backend, self.loss = drafter, cfg, backend, loss

    def unroll_normed(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        rope_pos: torch.Tensor,
        steps: int,
        mm: TokenEmbeds | None = None,
    ) -> list[torch.Tensor]:
        """TTT forward: the normed hidden states `[B, T, H]` (the head's input) of each step
        0..steps-1. input_ids `[B, T]`, target features `[B, T, 3H]`, rope_pos `[B, T]` /
        `[3, B, T]`, mm: the target's multimodal input embeddings, unshifted
        (`TokenEmbeds.of`)."""
        attn = TTTAttention(self.backend)
        feature = self.drafter.project_features(features)  # [B, T, H]
        out = []
        for k in range(steps):
            # Token side shifted (row i consumes t_{i+1+k}, with its vision embedding), the
            # position not: pos_i + k (conventions 1, 3, 4).
            tokens = shift_left(input_ids, 1 + k)
            mm_k = None if mm is None else mm.shifted(1 + k)
            pos = draft_step_positions(rope_pos, k)
            normed, feature = self.drafter(tokens, feature, pos, attn.at(k), mm_k)
            out.append(normed)
        return out

    def unroll(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        rope_pos: torch.Tensor,
        steps: int,
        mm: TokenEmbeds | None = None,
    ) -> list[torch.Tensor]:
        """Draft-vocabulary logits `[B, T, Dd]` of each step (`unroll_normed`'s arguments)."""
        normed = self.unroll_normed(input_ids, features, rope_pos, steps, mm)
        return [self.drafter.logits(n) for n in normed]

    def anchor_logits(
        self,
        ids: torch.Tensor,
        features: torch.Tensor,
        rope_pos: torch.Tensor,
        anchor: int,
        k: int,
        mm: TokenEmbeds | None = None,
    ) -> torch.Tensor:
        """The logits training gives for the k drafts after committed row `anchor`
        `[k, Dd]` (S9: the runner's k chained draft steps must give the same)."""
        return self.anchors_logits(ids, features, rope_pos, [anchor], k, mm)[0]

    def anchors_logits(self, ids, features, rope_pos, anchors: list[int], k: int, mm=None):
        """`anchor_logits` of several anchors of one sequence in one unroll `[A, k, Dd]`."""
        return self.drafter.logits(self.anchors_hidden(ids, features, rope_pos, anchors, k, mm))

    def anchors_hidden(self, ids, features, rope_pos, anchors: list[int], k: int, mm=None):
        """The head's inputs of `anchors_logits` `[A, k, H]` (differentiable): what on-policy
        training (`drafttrain.objectives.opd`) scores through the fused head + loss."""
        idx = torch.as_tensor(anchors, device=ids.device)
        steps = self.unroll_normed(ids, features, rope_pos, k, mm)
        return torch.stack([h[0, idx] for h in steps], 1)

    def __call__(
        self, batch: dict[str, torch.Tensor], tgt: TargetOutput
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d = self.drafter
        # The target's distribution over the draft vocabulary (renormalized), its top-1 there
        # and whether its full-vocabulary top-1 is representable, per flat row `b * T + t`.
        dist = target_distribution(tgt, d.draft_vocab_ids())
        B, T = dist.shape
        in_draft = dist.in_vocab.view(B, T)
        loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        # RoPE positions: the ones the target used (for Qwen3-VL its own [3, B, T] table).
        normed_per_step = self.unroll_normed(
            batch["input_ids"], tgt.features, tgt.rope_pos, self.cfg.ttt_steps, TokenEmbeds.of(tgt)
        )
        flat = torch.arange(B * T, device=in_draft.device).view(B, T)
        parts = []
        for k, normed in enumerate(normed_per_step):
            # Row i scores the target's distribution at row i+1+k (read through an index, no
            # shifted copy); it counts when t_{i+2+k} is an assistant token and the target's
            # top-1 at i+1+k is representable. Rows i >= T-2-k have nothing to predict.
            n = max(T - 2 - k, 0)
            valid = torch.zeros_like(loss_mask)
            valid[:, :n] = loss_mask[:, 2 + k :] & in_draft[:, 1 + k : T - 1]
            rows = (flat + 1 + k).clamp(max=B * T - 1)
            # The anchor of row i's chain is row i itself (D-PACE's layout).
            position = torch.full_like(flat, k).flatten()
            parts.append(
                RowPart(
                    normed.flatten(0, 1), rows.flatten(), flat.flatten(), position, valid.flatten()
                )
            )
        out = DraftLoss(in_draft.device)
        decay = [self.cfg.ttt_decay**k for k in range(len(parts))]
        score_positions(
            out, parts, d.lm_head.weight, dist.probs, dist.top1, self.loss, decay, B * T
        )
        return out.result(loss_mask)

    def checkpoint_meta(self) -> dict:
        # serving_k: the draft length the export advertises (speculators' speculative_tokens).
        return {
            "ttt_steps": self.cfg.ttt_steps,
            "ttt_decay": self.cfg.ttt_decay,
            "serving_k": min(3, self.cfg.ttt_steps),
        }
