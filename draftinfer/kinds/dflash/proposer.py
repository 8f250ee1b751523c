"""Block drafting (`dflash`): ONE drafter forward per round drafts up to B - 1 tokens (B with
DSpark's `sample_from_anchor`).

State: the drafter's KV cache holds, per layer and cache row, the *context* keys/values of
committed tokens: cache index `i` = `k_norm(k_proj(ctx_i))` RoPE'd at `pos_i` and
`v_proj(ctx_i)`, `ctx_i = hidden_norm(fc(f_i))` from the target's features of token `i`
(`DFlashDrafter.context_kv`). They depend on target features only, so nothing is recomputed
after a rejection (convention 13): the entries a block left past the committed length are
stale, never visible (the mask of `attention.visible`), and the next round's context rows
overwrite them.

A round (`propose`), for a padded batch with no host sync:
1. the first pass (the rows the last commit made final: row `i` carries `f_i` at cache index
   and position `pos_i`) is written to the cache as context (convention 6);
2. the block `[anchor, MASK x k]`: the anchor is the last committed token (the last live row's
   id, `t_{L-1}`), at cache index `L - 1` and position `pos_{L-2} + 1`, slot `s` at `+ s` on
   every RoPE axis (`draftinfer.conventions.positions.block_positions`, training's function too); slots
   past a request's draft cap (`num_drafts`: `max_model_len`, `max_tokens`) are padding, so
   a block near `max_model_len` is capped, never wrapped;
3. one forward of the block over the cache (context strictly before the anchor, the block's
   own slots bidirectionally or causally); draft j comes from slot `j - 1 + first_draft_slot`
   (slot j; slot j - 1 with `sample_from_anchor`, the anchor slot drafting too);
4. drafts are chosen slot by slot (`choose_block`, `module.draft_logits`): from the head's
   logits, plus DSpark's Markov bias of the previous draft (the anchor for draft 1), or with
   DFlash2's selector from its scores over the top-k candidates given the previous draft, or
   LiLiCorr's lattice walk (transition scores from the previous draft over the top-k, with the
   correlator's slot contexts of the whole block; q over the candidates in both, so
   verification stays exact). DSpark's confidence head's accept probabilities of the k drafts
   are kept as `confidence` `[B, k]` (with `confidence_head_with_markov` each reads
   `markov_w1` of the draft's predecessor): the proposer's `confidences()` (what
   `SpecDecoder(verify_threshold=)` cuts the block by, in place of the derived confidence of
   `draftinfer.decoding.confidence`).

K = `k` drafts use a block of `config.block_slots(k)` slots (`k + 1`, vLLM's `1 +
num_speculative_tokens`; `k` with `sample_from_anchor`); the training block is `block_size`
slots, so K = `max_drafts` serves the trained block exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftinfer.conventions.positions import block_positions
from draftinfer.conventions.slots import Slots
from draftinfer.decoding.compiled import compiled
from draftinfer.decoding.proposer import (
    DraftChooser,
    FirstPass,
    Proposer,
    greedy_chooser,
    last_valid,
)
from draftinfer.kinds.dflash.attention import CONTEXT, STALE, nonempty, visible
from draftinfer.kinds.dflash.module import (
    confidence_logit,
    draft_logits,
    lattice_contexts,
    slot_lattice,
)
from draftinfer.models.kv_cache import (
    KVCache,
    default_attention,
    resolve_attn_len,
    write_cache,
    write_index,
)
from draftinfer.models.layers import causal_attention


def dflash_write_context(
    drafter,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    features: torch.Tensor,  # [B, T, F] raw target features
    rope_pos: torch.Tensor,  # [B, T] / [3, B, T]
    rows: torch.Tensor,  # [B]
    cache_pos: torch.Tensor,  # [B, T], -1 = padding (written to the scratch column)
) -> None:
    """Context K/V of first-pass rows into every layer's cache."""
    ctx = drafter.project_context(features)
    wpos = write_index(cache_pos, k_cache[0].shape[1] - 1)
    for i, (k, v) in enumerate(drafter.context_kv(ctx, rope_pos)):
        write_cache(k, v, k_cache[i], v_cache[i], rows, wpos)


def dflash_block_inputs(
    ids: torch.Tensor,  # [B, T] the first pass's ids
    cache_pos: torch.Tensor,  # [B, T], -1 = padding
    rope_pos: torch.Tensor,  # [B, T] / [3, B, T]
    num_drafts: torch.Tensor,  # [B] each request's draft cap
    k: int,
    mask_token_id: int,
    first: int = 1,
) -> tuple[torch.Tensor, ...]:
    """The block `[anchor, MASK x (n - 1)]`, `n = k + first` slots (`first` = the config's
    `first_draft_slot`), of every request from the round's first pass (step 2 of the module
    docstring): (anchor ids `[B]`, the anchor's cache index `[B]`, the slots' cache indices
    `[B, n]` (-1 = padding), their RoPE positions `[B, n]` / `[3, B, n]`, the block's ids
    `[B, n]`, the last live slot's cache index `[B]`, which of the k drafts are live `[B, k]`).
    A slot is live up to the one of the last allowed draft (the anchor always: its row is
    committed). One compiled piece (a dozen small kernels eagerly)."""
    B, dev = ids.shape[0], ids.device
    ar = torch.arange(B, device=dev)
    last = last_valid(cache_pos)  # [B] each request's last committed row
    live_row = (cache_pos >= 0).any(1)  # rows with no request draft nothing
    anchor_ids = ids[ar, last]  # [B] t_{L-1}
    anchor = cache_pos[ar, last] + 1  # [B] cache index L - 1
    s = torch.arange(k + first, device=dev)
    last_slot = (num_drafts - 1 + first).clamp(min=0)  # [B] the slot of the last draft
    live = live_row[:, None] & (s[None] <= last_slot[:, None])  # [B, n]
    cache = torch.where(live, anchor[:, None] + s[None], -1)
    rope = block_positions(rope_pos[..., ar, last], k + first)  # [B, n] / [3, B, n]
    block = torch.where(s[None] == 0, anchor_ids[:, None], mask_token_id)  # [B, n]
    block_end = anchor + torch.where(live_row, last_slot, -1)
    j = torch.arange(1, k + 1, device=dev)
    live_slots = j[None] <= num_drafts[:, None]  # [B, k]
    return anchor_ids, anchor, cache, rope, block, block_end, live_slots


def block_masks(drafter, cache_pos, anchor, block_end, attn_len: int, group: int):
    """Per layer, the bool `[B, 1, n * group, attn_len]` mask of block slots at `cache_pos`
    `[B, n]` (-1 = padding) over cache indices: context before `anchor [B]`, the block's own
    entries `anchor..block_end [B]`, nothing stale (`attention.visible`); the query axis is
    repeated per KV group as `kv_cache.cached_attention` folds it."""
    c = drafter.config
    B, n = cache_pos.shape
    keys = torch.arange(attn_len, device=cache_pos.device)[None, None]  # [1, 1, L]
    a = anchor[:, None, None]
    in_block = (keys >= a) & (keys <= block_end[:, None, None])
    k_anchor = torch.where(keys < a, CONTEXT, torch.where(in_block, a, STALE))  # [B, 1, L]
    masks, out = {}, []
    for i in range(c.num_hidden_layers):
        key = (c.layer_causal(i), c.layer_window(i))
        if key not in masks:
            m = nonempty(visible(cache_pos[..., None], a, keys, k_anchor, *key))  # [B, n, L]
            m = m[:, None, :, None, :].expand(B, 1, n, group, attn_len)
            masks[key] = m.reshape(B, 1, n * group, attn_len)
        out.append(masks[key])
    return out


def dflash_block_forward(
    drafter,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    ids: torch.Tensor,  # [B, n] anchor + mask tokens
    rope_pos: torch.Tensor,  # [B, n] / [3, B, n]
    rows: torch.Tensor,  # [B]
    cache_pos: torch.Tensor,  # [B, n], -1 = padding slot
    anchor: torch.Tensor,  # [B] cache index of the anchor
    block_end: torch.Tensor,  # [B] cache index of the last live slot
    attn_len: int,
) -> torch.Tensor:
    """One block forward through the cache (writes the block's K/V, reads context + block)
    -> normed hidden `[B, n, H]`."""
    c = drafter.config
    group = c.num_attention_heads // c.num_key_value_heads
    masks = block_masks(drafter, cache_pos, anchor, block_end, attn_len, group)
    wpos = write_index(cache_pos, k_cache[0].shape[1] - 1)

    def attn_fn(layer: int, q, k, v):
        return default_attention(
            q, k, v, k_cache[layer], v_cache[layer], rows, wpos, masks[layer], attn_len
        )

    return drafter(ids, rope_pos, attn_fn, ids.shape[1])


def choose_block(
    drafter,
    normed: torch.Tensor,  # [B, k, H] the drafting slots
    anchor_ids: torch.Tensor,  # [B]
    pick: Callable[[int, torch.Tensor], torch.Tensor],
    z: torch.Tensor | None = None,  # [B, k + 1, d] LiLiCorr's slot contexts (anchor slot first)
) -> None:
    """Draft the k slots in order: `pick(step, logits [B, V]) -> chosen ids [B]`, the logits
    of `module.draft_logits` given the token chosen for the previous draft (the anchor for the
    first): the head's alone for plain DFlash, plus DSpark's Markov bias, or DFlash2's
    selector scores or LiLiCorr's transition scores over the top-k (-inf elsewhere): at T = 0
    the greedy walk through the lattice from the anchor."""
    pred = anchor_ids
    for step in range(normed.shape[1]):
        pred = pick(step, draft_logits(drafter, normed[:, step], pred, slot_lattice(z, step)))


class DFlashProposer(Proposer):
    mode = "block drafting"

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
        self._write, self._block = dflash_write_context, dflash_block_forward
        self._inputs = dflash_block_inputs
        # DSpark: the confidence head's accept probability of each draft of the last round
        # `[B, k]` (None without the head): `Proposer.confidences()` returns it.
        self.confidence: torch.Tensor | None = None

    def compile(self, **kwargs) -> None:
        super().compile(**kwargs)
        self._write = compiled(dflash_write_context, **kwargs)
        self._block = compiled(dflash_block_forward, **kwargs)
        self._inputs = compiled(dflash_block_inputs, **kwargs)

    def has_own_confidence(self) -> bool:
        """DSpark's confidence head gives the per-draft confidences."""
        return self.drafter.confidence_head is not None

    def kv_snapshot(self, row: int, n: int) -> list[torch.Tensor]:
        """The context K/V at cache indices 0..n-1 (the committed prefix but its last token)."""
        return self.cache.snapshot(row, n)

    def _write_rows(self, fp: FirstPass) -> None:
        c = self.cache
        self._write(self.drafter, c.k, c.v, fp.features, fp.rope_pos, fp.rows, fp.cache_pos)

    @torch.no_grad()
    def admit(self, first_pass: FirstPass, attn_len: int | None = None) -> FirstPass:
        """Context for every prompt row but the last; the last row stays pending (its id is the
        first anchor, its feature the first round's last context row)."""
        if first_pass.width > 1:
            self._write_rows(first_pass.take(0, -1))
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
        B, dev = fp.ids.shape[0], fp.ids.device
        self._write_rows(fp)
        first = d.config.first_draft_slot
        anchor_ids, anchor, cache, rope, ids, block_end, live_slots = self._inputs(
            fp.ids, fp.cache_pos, fp.rope_pos, num_drafts, k, d.config.mask_token_id, first
        )
        if attn_len is None:  # tests: one host sync to size the read
            attn_len = resolve_attn_len(Slots(fp.rows, cache), self.max_seq_len)
        c = self.cache
        normed = self._block(d, c.k, c.v, ids, rope, fp.rows, cache, anchor, block_end, attn_len)
        z = lattice_contexts(d, normed)  # [B, k + 1, d] or None
        normed = normed[:, first:]  # [B, k, H] the drafting slots
        drafts = torch.zeros(B, k, dtype=torch.long, device=dev)
        if not d.chained:  # the slots' drafts are independent: all at once
            q = self._record_all(drafts, d.logits(normed), live_slots, choose)
        else:
            qs: list[torch.Tensor | None] = [None]

            def pick(step: int, logits: torch.Tensor) -> torch.Tensor:
                qs[0] = self._record(drafts, qs[0], step, logits, num_drafts > step, choose)
                return drafts[:, step]

            choose_block(d, normed, anchor_ids, pick, z)
            q = qs[0]
        if d.confidence_head is not None:
            # Draft j's predecessor: the anchor for draft 1, else draft j - 1.
            prev = torch.cat([anchor_ids[:, None], drafts[:, :-1]], 1)  # [B, k]
            self.confidence = torch.sigmoid(confidence_logit(d, normed, prev).float())
        return drafts, q

    @staticmethod
    @torch.no_grad()
    def reference_drafts(drafter, ids, features, rope_pos, n, choose, mm=None):
        """No-cache reference for one request: context = every row's feature (rows `[R]`),
        the block `[t_R, MASK x ...]` of `block_slots(n)` slots at `pos_{R-1} + 1 + s`, one forward over the context keys
        and the block with the dense mask of `attention.visible` in token indices. `mm` (the
        multimodal rows' input embeddings) is not read: the context is target features only,
        and the anchor, the last committed token, is text."""
        d = drafter
        if n == 0:
            return [], []
        R = ids.shape[0]
        dev = ids.device
        ctx_kv = d.context_kv(d.project_context(features)[None], rope_pos[..., None, :])
        c = d.config
        slots = c.block_slots(n)
        s = torch.arange(slots, device=dev)
        q_index = R + s  # the anchor t_R is token index R
        k_index = torch.cat([torch.arange(R, device=dev), q_index])
        k_anchor = torch.cat([torch.full((R,), CONTEXT, device=dev), torch.full_like(s, R)])
        masks = [
            visible(q_index[:, None], R, k_index[None], k_anchor[None], *key)[None, None]
            for key in ((c.layer_causal(i), c.layer_window(i)) for i in range(c.num_hidden_layers))
        ]

        def attn_fn(layer: int, q, k, v):
            kc, vc = ctx_kv[layer]
            return causal_attention(
                q, torch.cat([kc, k], 1), torch.cat([vc, v], 1), mask=masks[layer]
            )

        block = torch.full((1, slots), c.mask_token_id, dtype=torch.long, device=dev)
        block[0, 0] = ids[-1]
        pos = block_positions(rope_pos[..., -1], slots)[..., None, :]  # [1, n'] / [3, 1, n']
        normed = d(block, pos, attn_fn, slots)
        ids_t = d.draft_vocab_ids()
        drafts, qs = [], []

        def pick(step: int, logits: torch.Tensor) -> torch.Tensor:
            choice, q = choose(logits, step)
            drafts.append(int(ids_t[choice][0]))
            qs.append(q)
            return ids_t[choice]

        z = lattice_contexts(d, normed)
        choose_block(d, normed[:, c.first_draft_slot :], block[:, 0], pick, z)
        return drafts, qs
