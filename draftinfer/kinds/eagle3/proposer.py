"""Chain drafting with an EAGLE-3 drafter: K drafter forwards per round.

Each round the first pass writes the rows the last commit made final with the *target's*
features (refreshing the drafter KV at committed positions, convention 6); the last live row
yields draft 1; the chain then feeds each draft back with the drafter's own pre-norm output
as the carried feature (convention 5) at `pos_last + step` on every RoPE axis and at cache
index `cache_last + step` (`draft_step_positions`, convention 4), with the slots and the
attention mask rebuilt for every step (convention 7).
"""

from __future__ import annotations

import torch

from draftinfer.conventions.positions import draft_step_positions
from draftinfer.conventions.window import TokenEmbeds
from draftinfer.decoding.compiled import cached_drafter_forward, compiled
from draftinfer.decoding.proposer import (
    DraftChooser,
    FirstPass,
    Proposer,
    causal_attn,
    greedy_chooser,
    last_valid,
)
from draftinfer.models.kv_cache import KVCache


class Eagle3ChainProposer(Proposer):
    mode = "chain drafting"

    def __init__(self, drafter, max_batch, max_seq_len, device, dtype):
        super().__init__(drafter, max_batch, max_seq_len, device, dtype)
        c = drafter.config
        self.cache = KVCache(
            c.num_hidden_layers,
            max_batch,
            max_seq_len,
            c.num_key_value_heads,
            c.head_dim,
            self.device,
            dtype,
        )
        self._fwd = cached_drafter_forward

    def _run(self, ids, feature, rope_pos, rows, cache_pos, attn_len, mm=None):
        """One cached drafter forward -> (normed, pre-norm), both `[B, T, H]`."""
        c = self.cache
        return self._fwd(
            self.drafter, c.k, c.v, ids, feature, rope_pos, rows, cache_pos, attn_len, mm
        )

    def compile(self, **kwargs) -> None:
        super().compile(**kwargs)
        self._fwd = compiled(cached_drafter_forward, **kwargs)

    def kv_snapshot(self, row: int, n: int) -> list[torch.Tensor]:
        return self.cache.snapshot(row, n)

    @torch.no_grad()
    def admit(self, first_pass: FirstPass, attn_len: int | None = None) -> FirstPass:
        """Write drafter KV for every prompt row but the last; the last row stays pending:
        its output yields the first round's draft 1. Prompt rows that consume an image
        placeholder get the target's vision embedding (`first_pass.mm`, convention 3)."""
        if first_pass.width > 1:
            fp = first_pass.take(0, -1)
            d = self.drafter
            self._run(
                fp.ids,
                d.project_features(fp.features),
                fp.rope_pos,
                fp.rows,
                fp.cache_pos,
                attn_len,
                fp.mm,
            )
        return first_pass.take(-1)

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
        B = fp.ids.shape[0]
        ar = torch.arange(B, device=fp.ids.device)
        feature = d.project_features(fp.features)
        normed, pre = self._run(fp.ids, feature, fp.rope_pos, fp.rows, fp.cache_pos, attn_len)
        last = last_valid(fp.cache_pos)  # [B] each request's last first-pass row
        base_cache = fp.cache_pos[ar, last]  # [B] its cache index
        base_rope = fp.rope_pos[..., ar, last]  # [B] / [3, B] its RoPE position (pos_i)
        logits = d.logits(normed[ar, last])  # [B, Dd]
        carried = pre[ar, last][:, None]  # [B, 1, H]
        drafts = torch.zeros(B, k, dtype=torch.long, device=fp.ids.device)
        qs = None
        for step in range(k):
            if step > 0:
                live = (num_drafts > step)[:, None]
                cache = torch.where(live, draft_step_positions(base_cache, step)[:, None], -1)
                rope = draft_step_positions(base_rope, step)[..., None]  # rebuilt every step
                tok = drafts[:, step - 1 : step]
                normed, carried = self._run(tok, carried, rope, fp.rows, cache, attn_len)
                logits = d.logits(normed[:, 0])
            qs = self._record(drafts, qs, step, logits, num_drafts > step, choose)
        return drafts, qs

    @staticmethod
    @torch.no_grad()
    def reference_drafts(drafter, ids, features, rope_pos, n, choose, mm=None):
        """`Proposer.reference_drafts`; `mm`: the target's input embeddings of the rows that
        consume a multimodal placeholder (`TokenEmbeds`, mask `[R]`, embeds `[R, H]`)."""
        d = drafter
        feats = d.project_features(features)  # [R, H]
        ids_t = d.draft_vocab_ids()
        drafts, qs = [], []
        base = rope_pos[..., -1:]
        for step in range(n):
            rows_mm = None if mm is None else pad_rows(mm, len(ids))
            normed, pre = d(ids[None], feats[None], rope_pos[..., None, :], causal_attn, rows_mm)
            choice, q = choose(d.logits(normed[:, -1]), step)
            tok = int(ids_t[choice][0])
            drafts.append(tok)
            qs.append(q)
            # The chained draft: its own pre-norm output, one position further.
            ids = torch.cat([ids, ids.new_tensor([tok])])
            feats = torch.cat([feats, pre[0, -1:]])
            rope_pos = torch.cat([rope_pos, draft_step_positions(base, step + 1)], dim=-1)
        return drafts, qs


def pad_rows(mm: TokenEmbeds, n: int) -> TokenEmbeds:
    """Unbatched rows `[R]` -> a batch of one `[1, n]`, rows past R text (drafts, mask slots)."""
    R = mm.mask.shape[0]
    mask = torch.cat([mm.mask, mm.mask.new_zeros(n - R)])
    embeds = torch.cat([mm.embeds, mm.embeds.new_zeros(n - R, mm.embeds.shape[-1])])
    return TokenEmbeds(mask[None], embeds[None])
