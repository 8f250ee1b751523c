"""Draft-OPD: the on-policy loss over the runner's own rounds (`trainer.stage=opd`).

Draft-OPD (arXiv 2605.29343; speculators' `training_stage="opd"`, SpecForge's
`dflash_opd.py`, REFERENCES E5.2): SFT trains a drafter on the data's responses, but the
runner asks it to draft from where its own previous round ended. OPD post-trains it on
rollouts of the runner itself (target + the current drafter, `drafttrain.jobs.rollouts`): each
round of a rollout is a training row.

A round after committed row `r` (row i consumes token i + 1, as `anchors_logits` and the
training-time walk count, `drafttrain.jobs.walk_al`) proposed `n` drafts and the target
accepted `a` of them. Its drafts j = 1..n are the drafter's logits at the round's anchor
(`anchors_hidden`, each kind's own forward: the S9 contract), and the target's distribution
for draft j is its row `r + j` of the committed sequence:

- j <= a (accepted): **forward KL(p || q)**, the draft's token was the target's, keep its mass
  there and spread the rest like the target (mode covering);
- j = a + 1 < n + 1 (the first rejected draft): **reverse KL(q || p)** weighted `gamma^(j-1)`
  (`opd.gamma`): mode seeking, push the draft's mass off what the target rejected; the decay
  leaves late positions (whose context was a long accepted run) less weight;
- j > a + 1: not scored. The runner drafted them after a rejected token (eagle3's chain
  consumed it; the target's row there conditioned on it), so neither the drafter's state
  nor the target's distribution at those positions lies on the committed sequence.

Every scored row's drafter input is exactly what the rollout's round fed it (the accepted
prefix equals the committed tokens), so the rows are on-policy and the target's
distributions come from one frozen-target forward over the committed sequence, cached per
rollout (`drafttrain.jobs.rollouts.RolloutStore`). Both losses go through the fused chunked
head + loss (`drafttrain.objectives.fused_ce.linear_soft_ce`, `loss=kl` and `REVERSE_KL`),
grouped by draft position; `DraftLoss` reports `loss_j`, `acc_j`, `sim_al` as SFT does, plus
`opd_accepted` (the rollouts' accepted drafts per round) and `opd_rev_rows` (reverse-KL rows
per round).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftinfer.conventions.window import TokenEmbeds
from drafttrain.frozen.head import logit_source, target_distribution
from drafttrain.jobs.errors import ConfigError
from drafttrain.objectives.fused_ce import linear_soft_ce
from drafttrain.objectives.loss_fns import LOSSES, REVERSE_KL
from drafttrain.objectives.losses import DraftLoss


@dataclass
class RoundRows:
    """The scored rounds of one rollout sequence (`round_rows`)."""

    anchors: list[int]  # committed row of each round (row i consumes token i + 1)
    accepted: list[int]  # accepted drafts of each round
    scored: list[int]  # draft positions scored in each round (<= k)


def round_rows(
    prompt_len: int, n: int, accepted: list[int], proposed: list[int], k: int
) -> RoundRows:
    """The runner's rounds of one request (`RequestOutput.accepted` / `.proposed`, its
    continuation of `n` tokens after a prompt of `prompt_len`) as training rows: round 1
    starts after continuation token 0 (the prefill's), each round then commits its accepted
    drafts and one token of the target's (`draftinfer.conventions.metrics.walk_rounds`). A
    round scores its accepted drafts and its first rejected one (module docstring), up to
    the sequence's last token (a round that met end-of-sequence counts drafts past it)."""
    anchors, acc, scored = [], [], []
    s = 0
    for a, p in zip(accepted, proposed):
        if s >= n - 1:
            break
        want = min(p, a + 1, k)  # the accepted ones and the first rejected one, if any
        m = min(want, n - 1 - s)  # label rows inside the sequence: token s + j exists
        if m > 0:
            anchors.append(prompt_len + s - 1)
            acc.append(min(a, m))
            scored.append(m)
        s += a + 1
    return RoundRows(anchors, acc, scored)


def check_opd_kind(objective) -> None:
    """One-line `ConfigError` for a kind whose objective has no `anchors_hidden` seam."""
    if not hasattr(objective, "anchors_hidden"):
        raise ConfigError(
            f"trainer.stage=opd: the {objective.__class__.__name__} has no anchors_hidden "
            "(the head's inputs of its drafts after a committed row)"
        )


@dataclass
class OPDSequence:
    """One rollout sequence as the loss reads it: the committed ids `[1, T]`, the frozen
    target's output over them (cached per rollout) and its rounds."""

    ids: torch.Tensor  # [1, T]
    tgt: object  # TargetOutput of the frozen target over `ids`
    rows: RoundRows


class OPDLoss:
    """`(sequences) -> (loss, metrics)`: the Draft-OPD loss of a batch of rollout sequences
    through a kind's objective (`anchors_hidden`) and the fused chunked head + loss."""

    def __init__(
        self, objective, k: int, gamma: float, normalize: str = "position", rejected: str = "rkl"
    ):
        check_opd_kind(objective)
        self.objective, self.k, self.gamma = objective, k, gamma
        self.normalize = normalize  # "position": a mean per draft position; "token": one mean
        self.rejected = REVERSE_KL if rejected == "rkl" else LOSSES["kl"]
        self.drafter = objective.drafter

    def __call__(self, seqs: list[OPDSequence]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d, k = self.drafter, self.k
        weight = d.lm_head.weight  # [Dv, H]
        vocab = d.draft_vocab_ids()
        hidden, label_rows, pos, acc_of, probs, top1 = [], [], [], [], [], []
        offset, rounds, accepted = 0, 0, 0
        dev = weight.device
        for seq in seqs:
            r = seq.rows
            T = seq.ids.shape[1]
            full = vocab.numel() == logit_source(seq.tgt).vocab_size  # dflash, mtp: no subset
            dist = target_distribution(seq.tgt, None if full else vocab)  # rows t of this sequence
            probs.append(dist.probs)
            top1.append(dist.top1)
            if r.anchors:
                mm = TokenEmbeds.of(seq.tgt)
                h = self.objective.anchors_hidden(
                    seq.ids, seq.tgt.features, seq.tgt.rope_pos, r.anchors, k, mm
                )  # [A, k, H]
                A = len(r.anchors)
                j = torch.arange(k, device=dev).expand(A, k)  # 0-based draft position
                anchor = torch.tensor(r.anchors, device=dev)[:, None]
                scored = torch.tensor(r.scored, device=dev)[:, None]
                acc = torch.tensor(r.accepted, device=dev)[:, None]
                keep = j < scored  # [A, k]
                hidden.append(h[keep])
                label_rows.append((anchor + 1 + j)[keep].clamp(max=T - 1) + offset)
                pos.append(j[keep])
                acc_of.append(acc.expand(A, k)[keep])
                rounds += A
                accepted += sum(r.accepted)
            offset += T
        out = DraftLoss(dev)
        probs_all, top1_all = torch.cat(probs), torch.cat(top1)
        if not hidden:  # no round scored (every rollout ended at its first token)
            zero = weight.sum() * 0.0
            out.add_sums(1, zero, zero.detach(), zero.detach(), 1.0)
            return out.result(torch.zeros(1, device=dev))
        hf, rows, j, acc = (
            torch.cat(hidden),
            torch.cat(label_rows),
            torch.cat(pos),
            torch.cat(acc_of),
        )
        fwd = j < acc  # accepted drafts
        rev = j == acc  # the first rejected draft (scored only when it exists)
        f_sum, f_hit, f_cnt = linear_soft_ce(
            hf, weight, probs_all, rows, top1_all, torch.where(fwd, j, -1), k, loss=LOSSES["kl"]
        )
        decay = self.gamma ** j.float()
        r_sum, r_hit, r_cnt = linear_soft_ce(
            hf, weight, probs_all, rows, top1_all, torch.where(rev, j, -1), k,
            loss=self.rejected, row_weight=decay,
        )  # fmt: skip
        count = (f_cnt + r_cnt).tolist()
        for p in range(k):
            # "token": position p weighs its share of the rows, so the loss is one mean over rows.
            w = 1.0 if self.normalize == "position" else count[p] / max(sum(count), 1.0)
            out.add_sums(p + 1, f_sum[p] + r_sum[p], f_hit[p] + r_hit[p], f_cnt[p] + r_cnt[p], w)
        out.metrics["opd_accepted"] = accepted / max(rounds, 1)
        out.metrics["opd_rev_rows"] = float(rev.sum()) / max(rounds, 1)
        return out.result(torch.ones(hf.shape[0], device=dev))
