"""Multi-layer MTP drafting: module k drafts token k+1, each module with its own KV cache.

This is vLLM Model Runner V2's multi-module contract (REFERENCES C, points 1-5), row by row:

1. Window shift. Every round runs every module over the whole window. Module k at row i
   consumes `t_{i+k+1}` (the window ids shifted left by k+1 from the target's token i; past
   the window's last row: the bonus token's successors, i.e. known lookahead tokens, then the
   drafts of steps < k) at RoPE position `module_positions(pos_i, k)` (`mrv2`: `pos_i`;
   `deepseek`: `pos_i + k`), and writes its KV at cache index `i` of its own cache.
2. Hidden chaining. Module 0 consumes the target's feature `f_i`; module k >= 1 module k-1's
   output at the same row (`mtp_chain`; which output per `mtp_carry`), or `f_i` (no chain).
3. Sampling. Draft k comes from module k's last live row.
4. Prefill lookahead. `admit` writes the prompt rows but the last (it stays pending for the
   first round); the pending row's token, and any further known prompt tokens a chunked caller
   passes as `lookahead`, are consumed before drafts, so every module's KV at those rows is
   exact at once.
5. Re-prefill of stale rows. The per-request cache `hist` keeps the last N-1 rows of the
   previous window (token ids, target features, cache index, RoPE position, multimodal rows)
   and `hist_ext`, the N-1 tokens its modules consumed past its last row. A row is stale when
   a module consumed one of those that is not the committed token; the stale rows are the
   last `N-1-g` of `hist`, g = the leading `hist_ext` tokens equal to the committed ones
   (= `max(0, r-1)` after r rejected drafts of K = N). Only those re-run, from the cached ids
   and features, inside the window (the others are padding: cache index -1 writes nothing).

Shapes are static: the window is `[B, N - 1 + K + 1]`, rows padded with cache index -1.

K > N reuses modules (`step % N`, as engines' DeepSeek-style MTP does, with a warning; the
`mrv2` layout refuses it): step s >= N runs module `s % N` on one extra row (the draft `d_s`
with the carried output of step s-1, RoPE position `p_last + s`) appended after its window rows
in its cache; the next windows overwrite those entries before any query reads them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from draftinfer.conventions.slots import Slots
from draftinfer.conventions.window import TokenEmbeds
from draftinfer.decoding.compiled import compiled
from draftinfer.decoding.proposer import (
    DraftChooser,
    FirstPass,
    Proposer,
    causal_attn,
    greedy_chooser,
)
from draftinfer.files.errors import CheckpointError
from draftinfer.models.kv_cache import KVCache


def cached_mtp_forward(
    drafter, k_cache, v_cache, j, ids, h_in, rope_pos, rows, cache_pos, attn_len, mm=None
):
    """Module j over rows through its KV cache -> (normed, pre-norm) `[B, T, H]`; `mm`: the
    target's input embeddings of rows consuming a multimodal placeholder (or None)."""
    slots = Slots(rows, cache_pos, rope_pos, attn_len)
    return drafter(j, ids, h_in, rope_pos, drafter.bind(k_cache, v_cache, slots), mm)


def mtp_window_module(
    drafter,
    k_cache,
    v_cache,
    j,
    win_ids,
    ext,
    last,
    h_in,
    rope_pos,
    rows,
    cache_pos,
    attn_len,
    mm=None,
    logits=True,
    forward=cached_mtp_forward,
):
    """Module j over the window rows (point 1): row r consumes the token of window row r + j,
    past the request's last live row `last [B]` the known tokens or drafts `ext [B, >= N]`
    (columns past N are never read, so the round's draft buffer itself serves); RoPE at
    `module_positions(pos, j)`. `mm`: the window's multimodal rows, unshifted (only window rows
    can consume a placeholder). -> (the carry of every row `[B, Tw, H]`, the head's logits at
    each request's last live row `[B, V]` or None). One compiled piece: the token shift, the
    module (`forward`) and the head (eager, a dozen small kernels per module)."""
    N = drafter.config.n_predict
    B, Tw = win_ids.shape
    src = (torch.arange(Tw, device=win_ids.device)[None] + j).expand(B, Tw)
    in_win = src <= last[:, None]
    tok = torch.where(
        in_win,
        win_ids.gather(1, src.clamp(max=Tw - 1)),
        ext.gather(1, (src - last[:, None] - 1).clamp(0, N - 1)),
    )
    if mm is not None:
        mm = mm.shifted(j)
        mm = TokenEmbeds(mm.mask & in_win, mm.embeds)
    rope = drafter.config.module_positions(rope_pos, j)
    normed, pre = forward(
        drafter, k_cache, v_cache, j, tok, h_in, rope, rows, cache_pos, attn_len, mm
    )
    if not logits:
        return drafter.carry(normed, pre), None
    ar = torch.arange(B, device=win_ids.device)
    return drafter.carry(normed, pre), drafter.logits(normed[ar, last])


def last_live(cache_pos: torch.Tensor) -> torch.Tensor:
    """Index of each request's last live row `[B]` (0 when none); live rows are contiguous
    but may start after padding."""
    idx = torch.arange(cache_pos.shape[1], device=cache_pos.device)
    return torch.where(cache_pos >= 0, idx, 0).max(1).values


def stale_rows(
    hist_ext: torch.Tensor,  # [R, N-1] the tokens the last windows consumed past their last row
    rows: torch.Tensor,  # [B]
    ids: torch.Tensor,  # [B, T] the first pass's committed tokens
    cache_pos: torch.Tensor,  # [B, T]
) -> torch.Tensor:
    """Per request, how many of the `hist` rows are stale `[B]` (point 5): N-1 minus the
    leading tokens the last window consumed past its last row that the new first pass
    commits (a match means the KV built from it stands)."""
    n = hist_ext.shape[1]  # N - 1
    m = min(n, ids.shape[1])
    if m == 0:  # N = 1: no history
        return torch.zeros_like(rows)
    ok = (hist_ext[rows, :m] == ids[:, :m]) & (cache_pos[:, :m] >= 0)  # [B, m]
    # The leading matches: the first column that fails (m when none does). One reduction,
    # where a cumprod would be a scan kernel and a sum.
    good = torch.where(ok, m, torch.arange(m, device=ids.device)).amin(1)
    return n - good


def mtp_window_inputs(
    h_ids: torch.Tensor,  # [R, N-1] the per-request cache (convention 10)
    h_features: torch.Tensor,  # [R, N-1, F]
    h_cache_pos: torch.Tensor,  # [R, N-1]
    h_rope_pos: torch.Tensor,  # [R, N-1] / [3, R, N-1]
    h_ext: torch.Tensor,  # [R, N-1]
    h_mm: TokenEmbeds | None,  # [R, N-1] / [R, N-1, H]
    rows: torch.Tensor,  # [B] the first pass
    ids: torch.Tensor,  # [B, T]
    features: torch.Tensor,  # [B, T, F]
    cache_pos: torch.Tensor,  # [B, T]
    rope_pos: torch.Tensor,  # [B, T] / [3, B, T]
    num_drafts: torch.Tensor,  # [B]
    width: int,  # max(K, N)
):
    """A round's window (point 5): the request's `hist` rows, then the first pass; W = N-1+T.
    -> (ids `[B, W]`, features `[B, W, F]`, cache_pos `[B, W]` (every hist row: what
    `hist` keeps next), run cache_pos `[B, W]` (only the stale hist rows; the others are
    padding and write nothing), rope_pos `[B, W]` / `[3, B, W]`, multimodal mask `[B, W]`
    and embeds `[B, W, H]` (None without `h_mm`), each request's last live row `[B]`, the
    draft buffer (zeros `[B, width]`), live `[B, width]`: step s drafts (`num_drafts > s`)).
    One compiled piece (the glue between the round's first pass and its modules)."""
    B, T = ids.shape
    dev = ids.device
    n = h_ids.shape[1]  # N - 1
    alive = (cache_pos >= 0).any(1, keepdim=True)  # rows with no request stay idle
    mm_mask = mm_embeds = None
    if h_mm is not None:  # the committed rows of a round are text
        hm = h_mm.batch(rows)
        mm_mask = torch.cat([hm.mask, hm.mask.new_zeros(B, T)], 1)
        mm_embeds = torch.cat([hm.embeds, hm.embeds.new_zeros(B, T, hm.embeds.shape[-1])], 1)
    hist_pos = torch.where(alive, h_cache_pos[rows], -1)  # [B, N-1]
    win_ids = torch.cat([h_ids[rows], ids], 1)
    win_features = torch.cat([h_features[rows].to(features.dtype), features], 1)
    win_pos = torch.cat([hist_pos, cache_pos], 1)
    win_rope = torch.cat([h_rope_pos[..., rows, :], rope_pos], -1)
    # Re-prefill only the stale hist rows; the others are padding and write nothing.
    t = torch.arange(n, device=dev)[None]
    rerun = t >= (n - stale_rows(h_ext, rows, ids, cache_pos))[:, None]
    run_pos = torch.cat([torch.where(rerun, hist_pos, -1), cache_pos], 1)
    drafts = torch.zeros(B, width, dtype=torch.long, device=dev)
    live = num_drafts[:, None] > torch.arange(width, device=dev)[None]
    return (
        win_ids,
        win_features,
        win_pos,
        run_pos,
        win_rope,
        mm_mask,
        mm_embeds,
        last_live(run_pos),
        drafts,
        live,
    )


def mtp_keep_history(
    h_ids: torch.Tensor,  # [R, N-1] written in place
    h_features: torch.Tensor,  # [R, N-1, F]
    h_cache_pos: torch.Tensor,  # [R, N-1]
    h_rope_pos: torch.Tensor,  # [R, N-1] / [3, R, N-1]
    h_ext: torch.Tensor,  # [R, N-1]
    h_mm: TokenEmbeds | None,  # [R, N-1] / [R, N-1, H]
    rows: torch.Tensor,  # [B] the window
    ids: torch.Tensor,  # [B, W]
    features: torch.Tensor,  # [B, W, F]
    cache_pos: torch.Tensor,  # [B, W]
    rope_pos: torch.Tensor,  # [B, W] / [3, B, W]
    mm: TokenEmbeds | None,  # [B, W] / [B, W, H]
    last: torch.Tensor,  # [B]
    ext: torch.Tensor,  # [B, >= N-1] the tokens consumed past the last row
) -> None:
    """hist <- the window's last N-1 live rows (padding where the sequence is shorter),
    hist_ext <- the tokens its modules consumed past its last row; in place, for N >= 2. One
    compiled piece (the gathers and index_puts into the per-request cache)."""
    n = h_ids.shape[1]  # N - 1
    h_ext[rows] = ext[:, :n]
    t = torch.arange(n, device=last.device)
    idx = last[:, None] - (n - 1) + t[None]  # [B, N-1]
    ok = idx >= 0
    i = idx.clamp(min=0)
    live = ok & (cache_pos.gather(1, i) >= 0)
    h_ids[rows] = ids.gather(1, i)
    F = features.shape[-1]
    h_features[rows] = features.gather(1, i[..., None].expand(-1, -1, F)).to(h_features.dtype)
    h_cache_pos[rows] = torch.where(live, cache_pos.gather(1, i), -1)
    index = i.expand(*rope_pos.shape[:-2], *i.shape)
    h_rope_pos[..., rows, :] = rope_pos.gather(-1, index)
    if h_mm is not None:
        if mm is None:
            h_mm.mask[rows] = False
        else:
            H = mm.embeds.shape[-1]
            h_mm.mask[rows] = mm.mask.gather(1, i) & live
            h_mm.embeds[rows] = mm.embeds.gather(1, i[..., None].expand(-1, -1, H)).to(
                h_mm.embeds.dtype
            )


class MTPProposer(Proposer):
    mode = "multi-token prediction"

    def __init__(self, drafter, max_batch, max_seq_len, device, dtype):
        super().__init__(drafter, max_batch, max_seq_len, device, dtype)
        c = drafter.config
        if c.block != "native":
            raise CheckpointError(
                f"this MTP drafter's blocks are {c.architecture}'s own transformers layers "
                "(block: hf); draftinfer runs MTP modules of block native (Llama, Qwen2, "
                "Qwen3 targets, and the target family's own native layer where it has one)"
            )
        N, dev = c.n_predict, self.device
        self.N = N
        self.own_caches = None
        if c.own_layer:  # each block is the family's own layer: its attention reads its cache
            self.own_caches = drafter.new_caches(max_batch, max_seq_len, dtype, dev)
            self.cache = KVCache(0, max_batch, max_seq_len, 1, 1, dev, dtype)
        else:
            self.cache = KVCache(
                N, max_batch, max_seq_len, c.num_key_value_heads, c.head_dim, dev, dtype
            )
        axes = () if c.rope_axes == 1 else (3,)
        # The per-request cache (convention 10): the last N-1 rows of the previous window.
        self.hist = FirstPass(
            torch.arange(max_batch, device=dev),
            torch.zeros(max_batch, N - 1, dtype=torch.long, device=dev),
            torch.zeros(max_batch, N - 1, c.hidden_size, dtype=dtype, device=dev),
            torch.full((max_batch, N - 1), -1, dtype=torch.long, device=dev),
            torch.zeros(*axes, max_batch, N - 1, dtype=torch.long, device=dev),
        )
        # The N-1 tokens the last window's modules consumed past its last row (point 5).
        self.hist_ext = torch.zeros(max_batch, max(N - 1, 0), dtype=torch.long, device=dev)
        self._fwd, self._module = cached_mtp_forward, mtp_window_module
        self._inputs, self._keep = mtp_window_inputs, mtp_keep_history

    def compile(self, **kwargs) -> None:
        """The round in compiled pieces: the window's inputs, each module's window step, the
        per-request cache update (and the K > N reuse steps' module forward), and the greedy
        choice (`Proposer.compile`). Between them only another chooser runs eagerly."""
        super().compile(**kwargs)
        self._fwd = compiled(cached_mtp_forward, **kwargs)
        self._module = compiled(mtp_window_module, **kwargs)
        self._inputs = compiled(mtp_window_inputs, **kwargs)
        self._keep = compiled(mtp_keep_history, **kwargs)

    def _install(self) -> None:
        """Own-layer blocks read this proposer's caches (`MTPDrafter.use_caches`)."""
        if self.own_caches is not None:
            self.drafter.use_caches(self.own_caches)

    def _run(self, j, ids, h_in, rope, rows, cache_pos, attn_len, mm=None):
        c = self.cache
        return self._fwd(self.drafter, c.k, c.v, j, ids, h_in, rope, rows, cache_pos, attn_len, mm)

    def kv_snapshot(self, row: int, n: int) -> list[torch.Tensor]:
        """Module j's KV at rows 0..n-1-j: the rows whose consumed token t_{i+j+1} lies in a
        committed prefix of n + 1 tokens."""
        if self.own_caches is not None:
            return [
                t[row, : max(n - j, 0)].clone()
                for j, cache in enumerate(self.own_caches)
                for t in cache.values()
            ]
        out = []
        for j, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
            m = max(n - j, 0)
            out += [k[row, :m].clone(), v[row, :m].clone()]
        return out

    def release(self, row: int) -> None:
        self.hist.cache_pos[row] = -1
        if self.hist.mm is not None:
            self.hist.mm.mask[row] = False

    def _keep_mm(self, first_pass: FirstPass) -> None:
        """Give the per-request cache multimodal rows (the target's input embeddings of the
        tokens its rows consume) once a request arrives with some: a later window re-runs
        rows whose consumed token may be an image placeholder."""
        if first_pass.mm is None or self.hist.mm is not None:
            return
        h = self.hist
        h.mm = TokenEmbeds(
            torch.zeros_like(h.cache_pos, dtype=torch.bool),
            torch.zeros(
                *h.ids.shape, first_pass.mm.embeds.shape[-1], dtype=self.dtype, device=self.device
            ),
        )

    # -- the window --------------------------------------------------------------------------
    def _window(
        self, win: FirstPass, last, attn_len, steps: int, live, choose, drafts, qs, known=None
    ):
        """Every module over the window rows (`last [B]`: each request's last live row);
        module j < steps records draft j+1 from its last live row into `drafts` (zeros
        `[B, >= N]` on entry) where `live [B, >= steps]`. Past the last row, module j consumes
        the drafts of steps < j (`drafts` itself: its columns >= j are still 0), or where
        `known`: (tokens, mask) `[B, N]` says so, tokens already known (lookahead, point 4).
        Returns (qs, the carry of the last module `[B, W, H]`, the tokens consumed past the
        last row `[B, >= N]`)."""
        d, N, c = self.drafter, self.N, self.cache
        feat = win.features.to(self.dtype)
        carry = feat
        ext = drafts
        # Eager, each module goes through `_fwd` (what tests wrap); compiled, the window piece
        # traces `cached_mtp_forward` itself.
        fwd = self._fwd if self._module is mtp_window_module else cached_mtp_forward
        for j in range(N):
            if known is not None:
                ext = torch.where(known[1], known[0], drafts[:, :N])
            h_in = carry if (j > 0 and d.config.mtp_chain) else feat
            carry, logits = self._module(
                d,
                c.k,
                c.v,
                j,
                win.ids,
                ext,
                last,
                h_in,
                win.rope_pos,
                win.rows,
                win.cache_pos,
                attn_len,
                win.mm,
                j < steps,
                fwd,
            )
            if j < steps:
                qs = self._record(drafts, qs, j, logits, live[:, j], choose)
        if known is not None:
            ext = torch.where(known[1], known[0], drafts[:, :N])
        return qs, carry, ext

    def _hist_args(self) -> tuple:
        """The per-request cache as the compiled pieces take it: ids, features, cache index,
        RoPE position, the tokens consumed past the last row, multimodal rows (or None)."""
        h = self.hist
        return h.ids, h.features, h.cache_pos, h.rope_pos, self.hist_ext, h.mm

    def _keep_history(self, win: FirstPass, last: torch.Tensor, ext: torch.Tensor) -> None:
        """hist <- the window's last N-1 live rows, hist_ext <- `ext[:, :N-1]`
        (`mtp_keep_history`)."""
        if self.N == 1:
            return
        self._keep(
            *self._hist_args(),
            win.rows,
            win.ids,
            win.features,
            win.cache_pos,
            win.rope_pos,
            win.mm,
            last,
            ext,
        )

    @torch.no_grad()
    def admit(
        self,
        first_pass: FirstPass,
        attn_len: int | None = None,
        lookahead: torch.Tensor | None = None,
    ) -> FirstPass:
        """Prefill every module over the prompt rows but the last, which stays pending. Prefill
        lookahead (point 4): the pending row's token and `lookahead` `[B, n]` (the next prompt
        tokens, for a caller that feeds the drafter a prompt in chunks; the engine admits a
        whole prompt at once) are consumed in place of drafts; rows that would need a token
        beyond them are re-prefilled by the next window (point 5)."""
        self._install()
        self._keep_mm(first_pass)
        self.hist.cache_pos[first_pass.rows] = -1
        if self.hist.mm is not None:
            self.hist.mm.mask[first_pass.rows] = False
        if first_pass.width > 1:
            win = first_pass.take(0, -1)
            B, N = win.ids.shape[0], self.N
            dev = win.ids.device
            tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
            mask = torch.zeros(B, N, dtype=torch.bool, device=dev)
            more = [first_pass.ids[:, -1:]] + ([] if lookahead is None else [lookahead])
            more = torch.cat(more, 1)[:, :N]
            tokens[:, : more.shape[1]] = more
            mask[:, : more.shape[1]] = (first_pass.cache_pos[:, -1:] >= 0).expand_as(more)
            drafts = torch.zeros(B, N, dtype=torch.long, device=dev)
            last = last_live(win.cache_pos)
            *_, ext = self._window(
                win, last, attn_len, 0, None, greedy_chooser, drafts, None, (tokens, mask)
            )
            self._keep_history(win, last, ext)
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
        self._install()
        d, N, fp = self.drafter, self.N, first_pass
        ids, feats, win_pos, run_pos, rope, mm_mask, mm_embeds, last, drafts, live = self._inputs(
            *self._hist_args(),
            fp.rows,
            fp.ids,
            fp.features,
            fp.cache_pos,
            fp.rope_pos,
            num_drafts,
            max(k, N),
        )
        mm = None if mm_mask is None else TokenEmbeds(mm_mask, mm_embeds)
        win = FirstPass(fp.rows, ids, feats, win_pos, rope, mm)
        run = replace(win, cache_pos=run_pos)
        qs, carry, ext = self._window(run, last, attn_len, min(k, N), live, choose, drafts, None)
        self._keep_history(win, last, ext)
        if k > N:  # module reuse (engines' step % N)
            ar = torch.arange(fp.ids.shape[0], device=fp.ids.device)
            carry = carry[ar, last]
            base_cache, base_rope = win.cache_pos[ar, last], win.rope_pos[..., ar, last]
            f_last = win.features[ar, last].to(self.dtype)
        for s in range(N, k):
            j = s % N
            cache = torch.where(live[:, s, None], (base_cache + s // N)[:, None], -1)
            h_in = carry if d.config.mtp_chain else f_last
            normed, pre = self._run(
                j,
                drafts[:, s - 1 : s],
                h_in[:, None],
                d.config.module_positions(base_rope, s)[..., None],
                fp.rows,
                cache,
                attn_len,
            )
            carry = d.carry(normed, pre)[:, 0]
            qs = self._record(drafts, qs, s, d.logits(normed[:, 0]), live[:, s], choose)
        if qs is not None:
            qs = qs[:, :k]
        return drafts[:, :k], qs

    @staticmethod
    @torch.no_grad()
    def reference_drafts(drafter, ids, features, rope_pos, n, choose, mm=None):
        """No cache: each module recomputed over all rows (+ its reuse rows) every step.
        `mm`: the target's input embeddings of the rows whose consumed token (row i: t_{i+1})
        is a multimodal placeholder, `[R]` / `[R, H]`; module j's row i consumes t_{i+j+1}."""
        d, N = drafter, drafter.config.n_predict
        R = ids.shape[0]

        def rows_mm(j: int, extra: int) -> TokenEmbeds | None:
            """Module j's multimodal rows: the window's shifted by j, then `extra` text rows."""
            if mm is None:
                return None
            m = TokenEmbeds(mm.mask[None], mm.embeds[None]).shifted(j)
            pad_mask = m.mask.new_zeros(1, extra)
            pad = m.embeds.new_zeros(1, extra, m.embeds.shape[-1])
            return TokenEmbeds(torch.cat([m.mask, pad_mask], 1), torch.cat([m.embeds, pad], 1))

        feat = features.to(d.lm_head.weight.dtype)
        rows_in: list[tuple] = []  # per module: (tokens [R], h_in [R, H]) of its window rows
        extra: list[list] = [[] for _ in range(N)]  # per module: reuse rows (tok, h, rope)
        drafts, qs = [], []
        carry_rows = feat
        carry_last = None
        for s in range(n):
            j = s % N
            if s < N:
                i = torch.arange(R, device=ids.device)
                src = i + j
                known = torch.cat([ids, ids.new_tensor(drafts)]) if drafts else ids
                tok = known[src.clamp(max=known.shape[0] - 1)]
                h_in = carry_rows if (j > 0 and d.config.mtp_chain) else feat
                rows_in.append((tok, h_in))
                normed, pre = d(
                    j,
                    tok[None],
                    h_in[None],
                    d.config.module_positions(rope_pos, j)[..., None, :],
                    causal_attn,
                    rows_mm(j, 0),
                )
                carry_rows = d.carry(normed, pre)[0]
                carry_last = carry_rows[-1]
                out = normed[0, -1:]
            else:
                h = carry_last if d.config.mtp_chain else feat[-1]
                extra[j].append((drafts[-1], h, d.config.module_positions(rope_pos[..., -1:], s)))
                tok0, h0 = rows_in[j]
                tok = torch.cat([tok0, ids.new_tensor([t for t, _, _ in extra[j]])])
                h_in = torch.cat([h0, torch.stack([x for _, x, _ in extra[j]])])
                own = d.config.module_positions(rope_pos, j)
                rope = torch.cat([own] + [r for _, _, r in extra[j]], dim=-1)
                mm_j = rows_mm(j, len(extra[j]))
                normed, pre = d(j, tok[None], h_in[None], rope[..., None, :], causal_attn, mm_j)
                carry_last = d.carry(normed, pre)[0, -1]
                out = normed[0, -1:]
            choice, q = choose(d.logits(out), s)
            drafts.append(int(d.draft_vocab_ids()[choice][0]))
            qs.append(q)
        return drafts, qs
