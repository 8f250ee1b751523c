"""Block-drafter objective (DFlash, REFERENCES A2): every anchor's block in one forward.

Per sequence of tokens `x_0..x_{T-1}` with target features `f_j` and target positions `pos_j`:
- **anchors**: up to `num_anchors` token indices `a` drawn without replacement (host RNG,
  checkpointed) among the assistant tokens whose next token is an assistant token too
  (SpecForge's rule), `a >= 1`, sorted;
- **block** of anchor `a`: slots `s = 0..n-1` consume `[x_a, MASK x (n-1)]` at token indices
  `a + s` and RoPE positions `pos_{a-1} + 1 + s` on every axis (the runner's rule: the last
  committed row's position + 1; for the text anchors training draws it is `pos_a + s`);
- **context**: `hidden_norm(fc(f_j))` of every token, keys/values of every layer, visible to a
  slot of anchor `a` iff `j < a` (`draftinfer.kinds.dflash.attention.visible`: bidirectional
  in the block, or causal with `causal_block` / in sliding layers);
- **labels**: draft `j = 1..K` predicts `x_{a+j}` from slot `j - 1 + first_draft_slot` (slot
  `j`, K = n - 1; with DSpark's `sample_from_anchor` slot `j - 1`, K = n, the anchor slot
  drafting too: `DFlashConfig.first_draft_slot`, the runner's rule): it is scored against the
  target's distribution at row `a + j - 1` (the one that predicts `x_{a+j}`, soft labels as
  every kind here), counted when `x_{a+j}` is an assistant token inside the sequence;
- **loss** per row: soft cross-entropy (`loss: ce`) or forward KL at `kd_temperature`, T^2-
  scaled (`loss: kl`, JetSpec), or `trainer.loss` (`drafttrain.objectives.loss_fns`: kl, tv, lk at T=1;
  `dpace` is soft cross-entropy with D-PACE weights); per-slot weights `exp(-(k-1)/gamma)`, D-PACE from the draft's
  probability of the target's top-1 (`drafttrain.objectives.loss_weights`), or uniform. With DFlash2's
  selector, `selector_loss_weight x` its K-way cross-entropy over the draft's top-K candidates
  (the target's top-1 inserted when missing), scored with the ground-truth predecessor
  `x_{a+k-1}`, under the same weights. DSpark (`drafter.dspark`): the draft logits carry the
  Markov bias of the ground-truth predecessor `x_{a+j-1}` (`module.draft_logits`, the
  runner's function), and the row loss is `dspark_ce_weight * CE + dspark_tv_weight * TV +
  confidence_loss_weight * BCE(confidence logit, alpha)`, TV = `1/2 |q - p|_1`, `alpha = sum
  min(q, p)` (detached: the probability the draft is accepted), q the draft's distribution and
  p the target's at row `a + j - 1`; computed on full `[N, V]` logits (not the fused chunks).
  LiLiCorr (`drafter.lilicorr`): the backbone keeps its row loss, plus `lilicorr_loss_weight x`
  the lattice's K-way cross-entropy over the draft's top-K (the target's top-1 inserted in the
  last place when missing), each candidate scored by the correlator from the ground-truth
  predecessor `x_{a+k-1}` at slot k - 1 (`LatticeCorrelator.scores` with the block's slot
  contexts, the runner's function), under the same weights: the DFlash2 selector CE's
  contract (REFERENCES A2) applied to the lattice's transitions, as ModelOpt #2342 trains its
  node potentials with a cross-entropy against the ground truth's index (its hinge on the
  margin to the runner-up is not implemented here).

Metrics (`DraftLoss`): `loss_k` (plain CE / KL of slot k), `acc_k` (the draft, i.e. the head's
argmax or the selector's choice, equals the target's top-1), `sim_al`; plus `block_al` =
1 + the mean number of leading correct slots per block (what greedy verification of the block
would accept given a correct context, without `sim_al`'s independence assumption), `anchors`
(blocks per sequence) and `sel_loss`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from draftinfer.conventions.positions import block_positions
from draftinfer.conventions.window import TokenEmbeds, shift_left
from draftinfer.kinds.dflash import DFlashDrafter
from draftinfer.kinds.dflash.attention import CONTEXT, PAD
from draftinfer.kinds.dflash.module import confidence_logit, draft_logits, lattice_contexts
from draftinfer.models.target import TargetOutput
from drafttrain.frozen.head import target_distribution
from drafttrain.jobs.errors import ConfigError
from drafttrain.kinds.dflash.blocks import make_block_attention
from drafttrain.kinds.dflash.config import PAPER_GAMMA, DFlashTrainConfig
from drafttrain.objectives.fused_ce import RowCE, linear_soft_ce_rows
from drafttrain.objectives.loss_fns import SOFT_CE
from drafttrain.objectives.loss_weights import dpace_weights, exp_decay_weights
from drafttrain.objectives.losses import DraftLoss


def resolve_gamma(cfg: DFlashTrainConfig) -> float:
    """`cfg.gamma`, or the paper's for the block size; a one-line error otherwise."""
    from drafttrain.jobs.errors import ConfigError

    if cfg.gamma is not None:
        if not cfg.gamma > 0:
            raise ConfigError(f"drafter.gamma must be > 0, got {cfg.gamma}")
        return float(cfg.gamma)
    if cfg.block_size not in PAPER_GAMMA:
        raise ConfigError(
            f"drafter.gamma has no published value for block_size {cfg.block_size} "
            f"(7 for 16, 5 for 10, 4 for 8); set drafter.gamma"
        )
    return PAPER_GAMMA[cfg.block_size]


def sample_anchors(candidates: torch.Tensor, num_anchors: int) -> torch.Tensor:
    """candidates `[B, T]` bool -> anchors `[B, A]` int64 sorted, -1 padded (A >= 1): up to
    `num_anchors` per row, uniformly without replacement (the global CPU RNG)."""
    cand = candidates.cpu()
    picked = []
    for row in cand:
        idx = row.nonzero().flatten()
        if idx.numel() > num_anchors:
            idx = idx[torch.randperm(idx.numel())[:num_anchors]].sort().values
        picked.append(idx)
    A = max([p.numel() for p in picked] + [1])
    out = torch.full((len(picked), A), -1, dtype=torch.long)
    for b, p in enumerate(picked):
        out[b, : p.numel()] = p
    return out.to(candidates.device)


def gathered_logits(hidden: torch.Tensor, weight: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """`z[n, cand[n, i]] = hidden[n] . weight[cand[n, i]]` `[N, K]`, differentiable w.r.t.
    `hidden`, in row chunks whose `[c, K, H]` weight gather is recomputed in backward (never
    the `[N, V]` logits)."""

    def part(h, c):
        return torch.bmm(weight[c].to(h.dtype), h[..., None])[..., 0]

    N, K = cand.shape
    step = max(1, (1 << 24) // max(1, K * hidden.shape[-1]))
    if N <= step:
        return part(hidden, cand)
    chunks = []
    for lo in range(0, N, step):
        h, c = hidden[lo : lo + step], cand[lo : lo + step]
        chunks.append(
            checkpoint(part, h, c, use_reentrant=False) if h.requires_grad else part(h, c)
        )
    return torch.cat(chunks)


class DFlashObjective:
    """Every block of a batch in one forward; per-slot weighted loss (module docstring)."""

    def __init__(self, drafter: DFlashDrafter, cfg: DFlashTrainConfig, backend: str, loss=SOFT_CE):
        self.drafter, self.cfg, self.backend, self.loss = drafter, cfg, backend, loss
        if cfg.dspark and not loss.is_soft_ce:
            raise ConfigError(
                f"drafter.dspark has its own row loss (CE + TV + BCE); trainer.loss={loss.name} "
                "would replace it: use trainer.loss=soft_ce (exp-decay weights) or dpace"
            )
        if cfg.loss != "ce" and not loss.is_soft_ce:
            raise ConfigError(
                f"drafter.loss={cfg.loss} and trainer.loss={loss.name} both choose the row "
                "loss: keep drafter.loss=ce with a trainer.loss other than soft_ce/dpace"
            )
        # trainer.loss=dpace: D-PACE row weights, as drafter.loss_weights=dpace.
        self.dpace = cfg.loss_weights == "dpace" or loss.weights_dpace
        exp = cfg.loss_weights == "exp_decay" and not self.dpace
        self.gamma = resolve_gamma(cfg) if exp else None

    # -- the forward --------------------------------------------------------------------------
    def forward_blocks(
        self,
        input_ids: torch.Tensor,  # [B, T]
        features: torch.Tensor,  # [B, T, n_taps * H] the target's taps
        rope_pos: torch.Tensor,  # [B, T] / [3, B, T] the target's positions
        anchors: torch.Tensor,  # [B, A] token indices, -1 = none
        block: int,
    ) -> torch.Tensor:
        """Normed hidden states of every block slot `[B, A, block, H]`."""
        d = self.drafter
        B, T = input_ids.shape
        A, dev = anchors.shape[1], input_ids.device
        valid = anchors >= 0
        a = anchors.clamp(min=1)  # a padding block points at a real row; nobody sees it
        s = torch.arange(block, device=dev)
        ids = torch.full((B, A, block), d.config.mask_token_id, dtype=torch.long, device=dev)
        ids[..., 0] = input_ids.gather(1, a)
        lead = rope_pos.shape[:-2]
        prev = rope_pos.gather(-1, (a - 1).expand(*lead, B, A))  # [B, A] / [3, B, A]
        pos = block_positions(prev, block)  # slot s at pos_{a-1} + 1 + s, the runner's rule
        q_anchor = torch.where(valid, a, PAD)[..., None].expand(B, A, block).reshape(B, -1)
        q_index = torch.where(valid[..., None], a[..., None] + s, PAD + s).reshape(B, -1)
        k_index = torch.cat([torch.arange(T, device=dev).expand(B, T), q_index], 1)
        k_anchor = torch.cat([torch.full((B, T), CONTEXT, device=dev), q_anchor], 1)
        ctx_kv = d.context_kv(d.project_context(features), rope_pos)
        attn = make_block_attention(
            d.config, ctx_kv, q_index, q_anchor, k_index, k_anchor, self.backend
        )
        normed = d(ids.reshape(B, -1), pos.flatten(-2), attn, block)
        return normed.view(B, A, block, -1)

    def anchor_logits(
        self,
        ids: torch.Tensor,
        features: torch.Tensor,
        rope_pos: torch.Tensor,
        anchor: int,
        k: int,
        mm: TokenEmbeds | None = None,
    ) -> torch.Tensor:
        """The draft logits training gives for the k drafts after committed row `anchor`
        (row i consumes `ids[i + 1]`, so the anchor token is `ids[anchor + 1]`), with a block of
        k + 1 slots as the runner drafts K = k, and (selector) the ground-truth predecessors
        `[k, V]` (S9). `mm` (a multimodal target's window) is not read: context rows are
        target features only and the block embeds text tokens."""
        return self.anchors_logits(ids, features, rope_pos, [anchor], k, mm)[0]

    def anchors_logits(self, ids, features, rope_pos, anchors: list[int], k: int, mm=None):
        """`anchor_logits` of several distinct anchors of one sequence in one forward (one block of
        k + 1 slots per anchor, as training lays them out) `[A, k, V]`."""
        d = self.drafter
        blocks = self._anchors_blocks(ids, features, rope_pos, anchors, k)  # [A, n, H]
        h = blocks[:, d.config.first_draft_slot :]  # [A, k, H]
        if not d.chained:
            return d.logits(h)
        pred = torch.stack([ids[0, x + 1 : x + 1 + k] for x in anchors])  # x_{a+j-1}, draft j
        z = lattice_contexts(d, blocks)  # [A, k + 1, d] or None
        lattice = None if z is None else (z[:, :-1], z[:, 1:])
        return draft_logits(d, h, pred, lattice)

    def _anchors_blocks(self, ids, features, rope_pos, anchors: list[int], k: int):
        c = self.drafter.config
        a = torch.as_tensor(anchors, device=ids.device)[None] + 1
        return self.forward_blocks(ids, features, rope_pos, a, c.block_slots(k))[0]

    def _anchors_hidden(self, ids, features, rope_pos, anchors: list[int], k: int):
        blocks = self._anchors_blocks(ids, features, rope_pos, anchors, k)
        return blocks[:, self.drafter.config.first_draft_slot :]

    def anchors_hidden(self, ids, features, rope_pos, anchors: list[int], k: int, mm=None):
        """The head's inputs of `anchors_logits` `[A, k, H]` (differentiable; on-policy
        training, `drafttrain.objectives.opd`). DFlash2's selector re-ranks the head's top-K
        after the head, and DSpark's Markov head biases it by the previous draft, so their
        drafts are not the head's: a one-line error."""
        if self.drafter.candidate_selector is not None:
            raise ConfigError(
                "trainer.stage=opd does not train DFlash2's candidate selector yet: its drafts "
                "are the selector's choice, not the head's (drafter.dflash2=false)"
            )
        if self.drafter.lattice_correlator is not None:
            raise ConfigError(
                "trainer.stage=opd does not train LiLiCorr's lattice yet: its drafts are the "
                "lattice walk's, not the head's (drafter.lilicorr=false)"
            )
        if self.drafter.markov_head is not None:
            raise ConfigError(
                "trainer.stage=opd does not train DSpark's Markov head yet: its drafts carry "
                "the previous draft's bias, not the head's alone (drafter.dspark=false)"
            )
        return self._anchors_hidden(ids, features, rope_pos, anchors, k)

    # -- the loss -----------------------------------------------------------------------------
    def __call__(
        self, batch: dict[str, torch.Tensor], tgt: TargetOutput
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c, d = self.cfg, self.drafter
        n = d.config.block_size
        first = d.config.first_draft_slot
        K = n - first
        input_ids = batch["input_ids"]
        B, T = input_ids.shape
        temp = c.kd_temperature if c.loss == "kl" else 1.0
        dist = target_distribution(tgt, None, temp)  # full vocabulary, rows b * T + t
        loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        cand = loss_mask & shift_left(loss_mask, 1, False)
        cand[:, 0] = False
        anchors = sample_anchors(cand, c.num_anchors)  # [B, A]
        A = anchors.shape[1]
        normed = self.forward_blocks(input_ids, tgt.features, tgt.rope_pos, anchors, n)
        h = normed[:, :, first:]  # [B, A, K, H]: the drafting slots
        lab = anchors.clamp(min=1)[..., None] + torch.arange(1, K + 1, device=h.device)  # x_{a+j}
        labc = lab.clamp(max=T - 1)
        bidx = torch.arange(B, device=h.device)[:, None, None]
        valid = (anchors >= 0)[..., None] & (lab < T) & loss_mask[bidx, labc]  # [B, A, K]
        rows = (bidx * T + labc - 1).reshape(-1)  # the target row that predicts x_{a+k}
        hf = h.reshape(-1, h.shape[-1])
        sel = d.candidate_selector
        corr = d.lattice_correlator
        metrics: dict[str, torch.Tensor | float] = {}
        if c.dspark:
            pred = input_ids.gather(1, (labc - 1).reshape(B, -1)).reshape(-1)  # x_{a+j-1}
            r, parts = self._dspark_rows(hf, pred, rows, dist)
            for name, v in parts.items():
                metrics[name] = (v.view(B, A, K) * valid).sum() / valid.sum().clamp(min=1)
        else:
            top_k = sel.top_k if sel is not None else corr.top_k if corr is not None else 0
            r = self._soft_ce_rows(hf, rows, dist, temp, top_k)
        per_row = r.ce
        if c.loss == "kl":  # KL = CE - H(p), T^2-scaled (same gradient as CE, times T)
            p = dist.probs[rows].float()
            per_row = (r.ce - torch.special.entr(p).sum(-1)) * temp**2
        per_row = per_row.view(B, A, K)
        hit = r.hit.view(B, A, K)
        extra = torch.zeros_like(per_row)
        if sel is not None:
            sce, shit = self._selector_loss(hf, input_ids, labc, rows, dist.top1, r.cand)
            extra = c.selector_loss_weight * sce.view(B, A, K)
            hit = shit.view(B, A, K)
            metrics["sel_loss"] = (sce.view(B, A, K) * valid).sum() / valid.sum().clamp(min=1)
        if corr is not None:
            z = lattice_contexts(d, normed)  # [B, A, n, d]
            lattice = (z[:, :, :-1].reshape(-1, z.shape[-1]), z[:, :, 1:].reshape(-1, z.shape[-1]))
            lce, lhit = self._selector_loss(hf, input_ids, labc, rows, dist.top1, r.cand, lattice)
            extra = c.lilicorr_loss_weight * lce.view(B, A, K)
            hit = lhit.view(B, A, K)
            metrics["lattice_loss"] = (lce.view(B, A, K) * valid).sum() / valid.sum().clamp(min=1)
        return self._weighted(per_row, extra, hit, valid, anchors, r, metrics, loss_mask)

    def _soft_ce_rows(self, hf, rows, dist, temp, top_k: int):
        return linear_soft_ce_rows(
            hf / temp,
            self.drafter.lm_head.weight,
            dist.probs,
            rows,
            dist.top1,
            top_k,
            loss=self.loss,
        )

    def _dspark_rows(self, hf, pred, rows, dist):
        """DSpark's row loss (module docstring) on full logits -> (a `RowCE` whose `ce` is the
        weighted row loss, its parts `{dspark_ce, dspark_tv, conf_bce}` `[N]`)."""
        c, d = self.cfg, self.drafter
        logits = draft_logits(d, hf, pred).float()  # [N, V]
        logp = F.log_softmax(logits, -1)
        q, p = logp.exp(), dist.probs[rows].float()
        ce = -(p * logp).sum(-1)
        tv = 0.5 * (q - p).abs().sum(-1)
        alpha = torch.minimum(q, p).sum(-1).detach()  # P(the draft is accepted), sum min(p, q)
        row = c.dspark_ce_weight * ce + c.dspark_tv_weight * tv
        bce = torch.zeros_like(ce)
        if d.confidence_head is not None:
            conf = confidence_logit(d, hf, pred).float()
            bce = F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
            row = row + c.confidence_loss_weight * bce
        top1 = dist.top1[rows]
        r = RowCE(row, logits.argmax(-1) == top1, logp.gather(-1, top1[:, None])[:, 0], None)
        return r, {"dspark_ce": ce.detach(), "dspark_tv": tv.detach(), "conf_bce": bce.detach()}

    def _weighted(self, per_row, extra, hit, valid, anchors, r, metrics, loss_mask):
        c = self.cfg
        B, A, K = per_row.shape
        if self.dpace:
            row_w = dpace_weights(r.logp_top1.exp().view(B, A, K), valid, c.dpace_alpha)
            slot_w = [1.0] * K
        else:
            row_w = torch.ones_like(per_row)
            decay = exp_decay_weights(K, self.gamma).tolist() if self.gamma else [1.0] * K
            slot_w = decay
        total = (per_row + extra) * row_w
        out = DraftLoss(per_row.device)
        real = (anchors >= 0).sum(1).clamp(min=1).float()
        out.metrics["anchors"] = real.mean()
        lead = torch.cumprod((hit & valid).float(), -1).sum(-1)  # [B, A] leading correct slots
        out.metrics["block_al"] = 1.0 + (lead * (anchors >= 0)).sum() / (anchors >= 0).sum().clamp(
            min=1
        )
        out.metrics.update(metrics)
        for k in range(K):
            m = valid[:, :, k]
            out.add_sums(
                k + 1,
                (total[:, :, k] * m).sum(),
                (hit[:, :, k] & m).sum(),
                m.sum(),
                slot_w[k],
                reported=(per_row[:, :, k] * m).sum(),
            )
        return out.result(loss_mask)

    def _selector_loss(self, hf, input_ids, labc, rows, top1, cand, lattice=None):
        """DFlash2's selector (or, given `lattice` = the rows' `(z_prev, z_cur)` `[N, d]`
        each, LiLiCorr's lattice): K-way cross-entropy over the draft's top-K (the target's
        top-1 inserted in the last place when missing), ground-truth predecessor `x_{a+k-1}`.
        -> (per-row loss `[N]`, per-row hit `[N]`: the re-ranker picks the target's top-1)."""
        d = self.drafter
        sel = d.candidate_selector
        gold = top1[rows]  # [N] token ids (full vocabulary)
        present = (cand == gold[:, None]).any(-1)
        cand = cand.clone()
        cand[:, -1] = torch.where(present, cand[:, -1], gold)
        target = (cand == gold[:, None]).long().argmax(-1)
        unary = gathered_logits(hf, d.lm_head.weight, cand)  # [N, K]
        pred = input_ids.gather(1, (labc - 1).reshape(labc.shape[0], -1)).reshape(-1)
        if lattice is not None:
            corr = d.lattice_correlator
            scores = corr.scores(d.embed_tokens, *lattice, pred, unary, cand)
        else:
            scores = sel.scores(sel.hidden_projection(hf), pred, unary, cand)
        return F.cross_entropy(scores, target, reduction="none"), scores.argmax(-1) == target

    def checkpoint_meta(self) -> dict:
        c = self.cfg
        return {
            "serving_k": self.drafter.config.max_drafts,
            "num_anchors": c.num_anchors,
            "loss": c.loss,
            "loss_weights": "dpace" if self.dpace else c.loss_weights,
            "gamma": self.gamma,
            "dpace_alpha": c.dpace_alpha,
        }
