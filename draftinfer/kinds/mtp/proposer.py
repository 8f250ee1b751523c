"""Multi-layer MTP drafting: module k drafts token k+1, each module with its own KV cache.

Rows and the window (conventions 1, 5, 10). Module k at row i consumes `t_{i+k+1}` and `h_in`
at RoPE position `pos_i + k`, and writes its KV at cache index `i` (the row) of its own cache.
In a round with committed length L, module k's last row `L-2` consumes the draft `d_k` (module
0 consumes the committed `t_{L-1}`), so its output yields draft `d_{k+1}`. Rows that consumed
drafts are stale once the round commits: module k's rows `L-1-k .. L-2`.

Each round therefore runs every module over one *window* of rows: the `N-1` rows before the
first pass (the per-request cache `hist`: token ids, target features, cache index and RoPE
position of the last `N-1` rows of the previous window) followed by the first pass (the rows
the last commit made final). Re-running the window re-prefills exactly the stale rows, with
correctly chained inputs: module k's row i consumes the committed token when `t_{i+k+1}` is
committed, else the draft of this round, and (chained) module k-1's output at row i from this
same window. After the round, `hist` keeps the window's last `N-1` rows. Shapes are static:
the window is `[B, N - 1 + K + 1]`, rows padded with cache index -1.

K > N reuses modules (`step % N`, as engines do, with a warning): step s >= N runs module
`s % N` on one extra row (the draft `d_s` with the carried output of step s-1, RoPE position
`p_last + s`) appended after its window rows in its cache; the next windows overwrite those
entries before any query reads them.
"""

from __future__ import annotations

import torch

from draftinfer.compiled import compiled
from draftinfer.errors import CheckpointError
from draftinfer.kv_cache import KVCache, bind_cache
from draftinfer.proposer import DraftChooser, FirstPass, Proposer, causal_attn, greedy_chooser
from draftinfer.slots import Slots
from draftinfer.window import TokenEmbeds


def cached_mtp_forward(
    drafter, k_cache, v_cache, j, ids, h_in, rope_pos, rows, cache_pos, attn_len, mm=None
):
    """Module j over rows through its KV cache -> (normed, pre-norm) `[B, T, H]`; `mm`: the
    target's input embeddings of rows consuming a multimodal placeholder (or None)."""
    slots = Slots(rows, cache_pos, rope_pos, attn_len)
    return drafter(j, ids, h_in, rope_pos, bind_cache(k_cache, v_cache, slots), mm)


def last_live(cache_pos: torch.Tensor) -> torch.Tensor:
    """Index of each request's last live row `[B]` (0 when none); live rows are contiguous
    but may start after padding."""
    idx = torch.arange(cache_pos.shape[1], device=cache_pos.device)
    return torch.where(cache_pos >= 0, idx, 0).max(1).values


class MTPProposer(Proposer):
    mode = "multi-token prediction"

    def __init__(self, drafter, max_batch, max_seq_len, device, dtype):
        super().__init__(drafter, max_batch, max_seq_len, device, dtype)
        c = drafter.config
        if c.block != "native":
            raise CheckpointError(
                f"this MTP drafter's blocks are {c.architecture}'s own layers (block: hf); "
                "draftinfer runs MTP modules for Llama, Qwen2 and Qwen3 targets"
            )
        N, dev = c.n_predict, self.device
        self.N = N
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
        self._fwd = cached_mtp_forward

    def compile(self, **kwargs) -> None:
        self._fwd = compiled(cached_mtp_forward, **kwargs)

    def _run(self, j, ids, h_in, rope, rows, cache_pos, attn_len, mm=None):
        c = self.cache
        return self._fwd(self.drafter, c.k, c.v, j, ids, h_in, rope, rows, cache_pos, attn_len, mm)

    def kv_snapshot(self, row: int, n: int) -> list[torch.Tensor]:
        """Module j's KV at rows 0..n-1-j: the rows whose consumed token t_{i+j+1} lies in a
        committed prefix of n + 1 tokens."""
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
    def _window(self, win: FirstPass, attn_len, steps: int, num_drafts, choose, drafts, qs):
        """Every module over the window rows; module j < steps records draft j+1 from its
        last live row. Returns (qs, per-request last-row carry of the last module, last)."""
        d, N = self.drafter, self.N
        B, Tw = win.ids.shape
        dev = win.ids.device
        last = last_live(win.cache_pos)  # [B]
        ar = torch.arange(B, device=dev)
        src0 = torch.arange(Tw, device=dev)[None]  # [1, Tw]
        ext = torch.zeros(B, N, dtype=torch.long, device=dev)  # d_1..d_N for the window
        feat = win.features.to(self.dtype)
        carry = feat
        for j in range(N):
            src = (src0 + j).expand(B, Tw)  # row r consumes the token of window row r + j
            in_win = src <= last[:, None]
            tok = torch.where(
                in_win,
                win.ids.gather(1, src.clamp(max=Tw - 1)),
                ext.gather(1, (src - last[:, None] - 1).clamp(0, N - 1)),
            )
            mm = None  # drafts are text: only window rows can consume an image placeholder
            if win.mm is not None:
                shifted = win.mm.shifted(j)
                mm = TokenEmbeds(shifted.mask & in_win, shifted.embeds)
            h_in = carry if (j > 0 and d.config.mtp_chain) else feat
            normed, pre = self._run(
                j, tok, h_in, win.rope_pos + j, win.rows, win.cache_pos, attn_len, mm
            )
            carry = d.carry(normed, pre)
            if j < steps:
                logits = d.logits(normed[ar, last])  # [B, V]
                qs = self._record(drafts, qs, j, logits, num_drafts > j, choose)
                ext[:, j] = drafts[:, j]
        return qs, carry[ar, last], last

    def _keep_history(self, win: FirstPass, last: torch.Tensor) -> None:
        """hist <- the window's last N-1 live rows (padding where the sequence is shorter)."""
        if self.N == 1:
            return
        t = torch.arange(self.N - 1, device=last.device)
        idx = last[:, None] - (self.N - 2) + t[None]  # [B, N-1]
        ok = idx >= 0
        i = idx.clamp(min=0)
        live = ok & (win.cache_pos.gather(1, i) >= 0)
        rows, h = win.rows, self.hist
        h.ids[rows] = win.ids.gather(1, i)
        F = win.features.shape[-1]
        h.features[rows] = win.features.gather(1, i[..., None].expand(-1, -1, F)).to(
            h.features.dtype
        )
        h.cache_pos[rows] = torch.where(live, win.cache_pos.gather(1, i), -1)
        index = i.expand(*win.rope_pos.shape[:-2], *i.shape)
        h.rope_pos[..., rows, :] = win.rope_pos.gather(-1, index)
        if h.mm is not None:
            if win.mm is None:
                h.mm.mask[rows] = False
            else:
                H = win.mm.embeds.shape[-1]
                h.mm.mask[rows] = win.mm.mask.gather(1, i) & live
                h.mm.embeds[rows] = win.mm.embeds.gather(1, i[..., None].expand(-1, -1, H)).to(
                    h.mm.embeds.dtype
                )

    @torch.no_grad()
    def admit(self, first_pass: FirstPass, attn_len: int | None = None) -> FirstPass:
        """Prefill every module over the prompt rows but the last (rows whose tokens are not
        known yet are recomputed by the first round's window); the last row stays pending."""
        self._keep_mm(first_pass)
        self.hist.cache_pos[first_pass.rows] = -1
        if self.hist.mm is not None:
            self.hist.mm.mask[first_pass.rows] = False
        if first_pass.width > 1:
            win = first_pass.take(0, -1)
            B = win.ids.shape[0]
            drafts = torch.zeros(B, self.N, dtype=torch.long, device=win.ids.device)
            zero = torch.zeros(B, dtype=torch.long, device=win.ids.device)
            _, _, last = self._window(win, attn_len, 0, zero, greedy_chooser, drafts, None)
            self._keep_history(win, last)
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
        d, N, fp = self.drafter, self.N, first_pass
        B = fp.ids.shape[0]
        dev = fp.ids.device
        h = self.hist
        alive = (fp.cache_pos >= 0).any(1, keepdim=True)  # rows with no request stay idle
        mm = None
        if h.mm is not None:  # the committed rows of a round are text
            T = fp.ids.shape[1]
            hm = h.mm.batch(fp.rows)
            mm = TokenEmbeds(
                torch.cat([hm.mask, hm.mask.new_zeros(B, T)], 1),
                torch.cat([hm.embeds, hm.embeds.new_zeros(B, T, hm.embeds.shape[-1])], 1),
            )
        win = FirstPass(
            fp.rows,
            torch.cat([h.ids[fp.rows], fp.ids], 1),
            torch.cat([h.features[fp.rows].to(fp.features.dtype), fp.features], 1),
            torch.cat([torch.where(alive, h.cache_pos[fp.rows], -1), fp.cache_pos], 1),
            torch.cat([h.rope_pos[..., fp.rows, :], fp.rope_pos], -1),
            mm,
        )
        drafts = torch.zeros(B, max(k, N), dtype=torch.long, device=dev)
        qs, carry, last = self._window(win, attn_len, min(k, N), num_drafts, choose, drafts, None)
        self._keep_history(win, last)
        ar = torch.arange(B, device=dev)
        base_cache, base_rope = win.cache_pos[ar, last], win.rope_pos[..., ar, last]
        f_last = win.features[ar, last].to(self.dtype)
        for s in range(N, k):  # module reuse, K > N (engines' step % N)
            j = s % N
            live = (num_drafts > s)[:, None]
            cache = torch.where(live, (base_cache + s // N)[:, None], -1)
            h_in = carry if d.config.mtp_chain else f_last
            normed, pre = self._run(
                j,
                drafts[:, s - 1 : s],
                h_in[:, None],
                (base_rope + s)[..., None],
                fp.rows,
                cache,
                attn_len,
            )
            carry = d.carry(normed, pre)[:, 0]
            qs = self._record(drafts, qs, s, d.logits(normed[:, 0]), num_drafts > s, choose)
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
                    (rope_pos + j)[..., None, :],
                    causal_attn,
                    rows_mm(j, 0),
                )
                carry_rows = d.carry(normed, pre)[0]
                carry_last = carry_rows[-1]
                out = normed[0, -1:]
            else:
                h = carry_last if d.config.mtp_chain else feat[-1]
                extra[j].append((drafts[-1], h, rope_pos[..., -1:] + s))
                tok0, h0 = rows_in[j]
                tok = torch.cat([tok0, ids.new_tensor([t for t, _, _ in extra[j]])])
                h_in = torch.cat([h0, torch.stack([x for _, x, _ in extra[j]])])
                rope = torch.cat([rope_pos + j] + [r for _, _, r in extra[j]], dim=-1)
                mm_j = rows_mm(j, len(extra[j]))
                normed, pre = d(j, tok[None], h_in[None], rope[..., None, :], causal_attn, mm_j)
                carry_last = d.carry(normed, pre)[0, -1]
                out = normed[0, -1:]
            choice, q = choose(d.logits(out), s)
            drafts.append(int(d.draft_vocab_ids()[choice][0]))
            qs.append(q)
        return drafts, qs
