"""EAGLE-3 training objective: training-time test (TTT) unrolling with soft cross-entropy.

Batch preparation (conventions 1, 4, 5): with target tokens `t_0..t_{T-1}`, target features
`f_i` (the concatenated aux taps at token `i`) and target positions `pos_i`, drafter row `i`
at TTT step `k` (0-based)

- consumes token `t_{i+1+k}` (teacher-forced) at position `pos_i + k`
  (`draftinfer.positions.draft_step_positions`, the function the runner uses),
- consumes the carried feature `fc(f_i)` at step 0, its own step-(k-1) pre-norm output after,
- predicts `t_{i+2+k}`: the target's distribution at row `i+1+k`, restricted to the draft
  vocabulary and renormalized (soft labels).

A row counts in step k's loss when the predicted token `t_{i+2+k}` is an assistant token
(loss mask) and the target's own top-1 at row `i+1+k` lies in the draft vocabulary (a draft
model cannot be right where the target's choice is unrepresentable). Step losses are
weighted by `decay^k`.

Metrics: per-step accuracy (draft argmax == target argmax over counted rows) and the
*simulated* acceptance length `1 + sum_k prod_{s<=k} acc_s`, which is what chained greedy
drafting would accept if step errors were independent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftinfer.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftinfer.positions import draft_step_positions
from drafttrain.config import Eagle3TrainConfig
from drafttrain.errors import ConfigError
from drafttrain.target import FrozenTarget, TargetBatchOutput
from drafttrain.ttt import TTTAttention


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """Row i of the result is row i+n of x (dim 1); the last n rows are `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1) if n < x.shape[1] else torch.full_like(x, fill)


def drafter_config_from_target(
    cfg: Eagle3TrainConfig, target: FrozenTarget, config_cls=Eagle3Config, **extra
) -> Eagle3Config:
    """Architecture from the target's sizes plus the drafter config's overrides; a one-line
    `ConfigError` when they cannot fit."""
    from draftinfer.drafters.layers import rope_params_from_hf

    tc = target.config
    H = target.hidden_size
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
    if cfg.draft_vocab_size > target.vocab_size or cfg.draft_vocab_size < 1:
        raise ConfigError(
            f"draft_vocab_size {cfg.draft_vocab_size} does not fit the target "
            f"vocabulary of {target.vocab_size}"
        )
    if len(target.aux_layer_ids) != 3:
        raise ConfigError(
            f"EAGLE-3 uses exactly 3 aux taps, got aux_layer_ids {target.aux_layer_ids}"
        )
    if cfg.num_layers < 1:
        raise ConfigError(f"drafter num_layers must be >= 1, got {cfg.num_layers}")
    theta, scaling = rope_params_from_hf(tc)
    return config_cls(
        hidden_size=hidden,
        intermediate_size=cfg.intermediate_size or tc.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=target.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=H,
        aux_layer_ids=list(target.aux_layer_ids),
        num_hidden_layers=cfg.num_layers,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        # Never shorter than the target's: a short value corrupts RoPE in engines (DESIGN 4).
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048)),
        norm_before_residual=cfg.norm_before_residual,
        **extra,
    )


@torch.no_grad()
def init_from_target(
    drafter: Eagle3Drafter, target: FrozenTarget, d2t: torch.Tensor, t2d: torch.Tensor
) -> None:
    """Frozen shared embeddings; lm_head rows and final norm start from the target's."""
    drafter.embed_tokens.weight.copy_(target.input_embeddings().float())
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    ids = torch.arange(d2t.numel()) + d2t
    drafter.lm_head.weight.copy_(target.output_embeddings().float()[ids.to(target.device)])
    norm = target.final_norm_weight()
    if norm is not None and norm.numel() == drafter.norm.weight.numel():
        drafter.norm.weight.copy_(norm.float())


class Eagle3Objective:
    """Unrolled TTT forward + loss for one batch."""

    def __init__(self, drafter: Eagle3Drafter, cfg: Eagle3TrainConfig, backend: str):
        self.drafter, self.cfg, self.backend = drafter, cfg, backend

    @staticmethod
    def arch_from_target(cfg: Eagle3TrainConfig, target: FrozenTarget, tokenizer) -> Eagle3Config:
        return drafter_config_from_target(cfg, target)

    def unroll(
        self, input_ids: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """TTT forward: draft-vocabulary logits `[B, T, Dd]` for each step 0..steps-1."""
        attn = TTTAttention(self.backend)
        feature = self.drafter.project_aux(aux)  # [B, T, H]
        out = []
        for k in range(steps):
            tokens = shift_left(input_ids, 1 + k)
            normed, feature = self.drafter(
                tokens, feature, draft_step_positions(positions, k), attn
            )
            out.append(self.drafter.logits(normed))
        return out

    def __call__(
        self, batch: dict[str, torch.Tensor], tgt: TargetBatchOutput
    ) -> tuple[torch.Tensor, dict[str, float]]:
        d = self.drafter
        t2d = d.t2d
        # Target distribution over the draft vocabulary, renormalized, per row `[B, T, Dd]`.
        tlog = tgt.logits
        in_draft = t2d[tlog.argmax(-1)]  # [B, T] target top-1 representable
        target_p = torch.softmax(tlog[..., t2d], dim=-1)
        loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        logits_per_step = self.unroll(
            batch["input_ids"],
            tgt.aux.to(d.fc.weight.dtype),
            batch["position_ids"],
            self.cfg.ttt_steps,
        )
        total = torch.zeros((), device=tlog.device)
        metrics: dict[str, float] = {}
        surv, sim_al = 1.0, 1.0
        for k, logits in enumerate(logits_per_step):
            p_k = shift_left(target_p, 1 + k)
            valid = shift_left(loss_mask, 2 + k, False) & shift_left(in_draft, 1 + k, False)
            n = valid.sum()
            ce = -(p_k * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B, T]
            loss_k = (ce * valid).sum() / n.clamp(min=1)
            total = total + (self.cfg.ttt_decay**k) * loss_k
            hit = (logits.argmax(-1) == p_k.argmax(-1)) & valid
            acc = (hit.sum() / n.clamp(min=1)).item()
            surv *= acc
            sim_al += surv
            metrics[f"loss_{k}"] = loss_k.item()
            metrics[f"acc_{k}"] = acc
        metrics["sim_al"] = sim_al
        metrics["tokens"] = float(loss_mask.sum().item())
        return total, metrics

    def checkpoint_meta(self) -> dict:
        # serving_k: the draft length the export advertises (speculators' speculative_tokens).
        return {
            "ttt_steps": self.cfg.ttt_steps,
            "ttt_decay": self.cfg.ttt_decay,
            "serving_k": min(3, self.cfg.ttt_steps),
        }
