"""Attention sinks and sliding windows in the KV-cache attention backends (`kv_cache.ATTENTION`).

Oracle: transformers' own gpt-oss `eager_attention_forward` (the sink as a softmax column with
no value, the window as HF's `kv_idx > q_idx - sliding_window`), run per row over the keys the
row wrote, against every backend over the static cache: `sdpa` (the sink as an extra zero
key/value column), `maths_decode`'s one-token maths (`decode_attention`, what a compiled step
runs) and `split_kv` (falls back to `sdpa` when sinks are given). A prefill of a padded batch,
then decode and verify slots past the window, fp32 on the CPU.
"""

from __future__ import annotations

import types

import pytest
import torch

from draftinfer.models.kv_cache import (
    ATTENTION,
    decode_attention,
    read_rows,
    visibility_mask,
    write_cache,
    write_index,
)

NH, NKV, D, MAX_LEN = 8, 2, 16, 40
ATOL = 1e-5


def hf_reference(q, keys, values, sinks, window, qpos):
    """One row through transformers' gpt-oss eager attention: q `[T, nh, D]` at cache indices
    `qpos [T]`, keys/values `[L, nkv, D]` -> `[T, nh, D]`."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    L = keys.shape[0]
    j = torch.arange(L)
    allowed = j[None] <= qpos[:, None]
    if window is not None:
        allowed &= j[None] > qpos[:, None] - window
    mask = torch.zeros(1, 1, len(qpos), L).masked_fill(~allowed, float("-inf"))
    if sinks is None:  # no sinks: a sink of -inf carries no probability
        sinks = torch.full((NH,), float("-inf"))
    module = types.SimpleNamespace(num_key_value_groups=NH // NKV, training=False, sinks=sinks)
    out, _ = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        mask,
        scaling=D**-0.5,
    )
    return out[0]  # [T, nh, D]


def forward_steps(backend, sinks, window, steps, seed=0):
    """Run `steps` (a list of `cache_pos [B, T]`) through `backend` over one cache; returns
    per step (out, q, cache_pos) and the final caches."""
    g = torch.Generator().manual_seed(seed)
    B = steps[0].shape[0]
    kc = torch.zeros(B + 1, MAX_LEN + 1, NKV, D)
    vc = torch.zeros_like(kc)
    rows = torch.arange(B) + 1  # rows 1..B of a cache with one more
    outs = []
    for cache_pos in steps:
        T = cache_pos.shape[1]
        q = torch.randn(B, T, NH, D, generator=g)
        k, v = torch.randn(2, B, T, NKV, D, generator=g)
        attn_len = int(cache_pos.max()) + 1
        mask = visibility_mask(cache_pos, attn_len, NH // NKV, window)
        wpos = write_index(cache_pos, MAX_LEN)
        extra = () if sinks is None else (sinks,)
        o = ATTENTION[backend](q, k, v, kc, vc, rows, wpos, mask, attn_len, *extra)
        outs.append((o, q, cache_pos))
    return outs, kc, vc, rows


STEPS = [
    # prefill of 3 rows: lengths 11, 6 (right padding), 9 (left padding)
    torch.tensor([list(range(11)), [*range(6)] + [-1] * 5, [-1, -1, *range(9)]]),
    torch.tensor([[11], [6], [-1]]),  # a decode step, row 2 a padding slot
    torch.tensor([[12, 13, 14, 15], [7, 8, 9, 10], [9, 10, 11, 12]]),  # a verify of 4 slots
]


@pytest.mark.parametrize("backend", list(ATTENTION))
@pytest.mark.parametrize("window", [None, 1, 4])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_backends_equal_transformers_eager(backend, window, with_sinks):
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0, -2.0, 1.0, 4.0]) if with_sinks else None
    outs, kc, vc, rows = forward_steps(backend, sinks, window, STEPS)
    for o, q, cache_pos in outs:
        assert o.shape == q.shape and torch.isfinite(o).all()
        for b in range(q.shape[0]):
            live = cache_pos[b] >= 0
            keys = kc[rows[b], : int(cache_pos[b].max()) + 1]
            values = vc[rows[b], : int(cache_pos[b].max()) + 1]
            want = hf_reference(q[b, live], keys, values, sinks, window, cache_pos[b, live])
            torch.testing.assert_close(o[b, live], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_one_token_maths_with_sinks(window):
    """`decode_attention` (the one-token step a compiled `maths_decode` runs) with sinks."""
    sinks = torch.linspace(-2, 3, NH)
    outs, kc, vc, rows = forward_steps("sdpa", sinks, window, STEPS[:2])
    o, q, cache_pos = outs[1]
    attn_len = int(cache_pos.max()) + 1
    mask = visibility_mask(cache_pos, attn_len, NH // NKV, window)
    got = decode_attention(
        q, read_rows(kc, rows, attn_len), read_rows(vc, rows, attn_len), mask, sinks
    )
    torch.testing.assert_close(got[:2], o[:2], atol=ATOL, rtol=0)  # row 2 is padding


def test_sink_takes_probability_and_no_value():
    """A huge sink takes all the probability: the output goes to zero (it carries no value);
    a sink of -inf is no sink at all."""
    cache_pos = torch.tensor([[0, 1, 2, 3]])
    q = torch.randn(1, 4, NH, D)
    k, v = torch.randn(2, 1, 4, NKV, D)
    kc = torch.zeros(1, MAX_LEN + 1, NKV, D)
    vc = torch.zeros_like(kc)
    mask = visibility_mask(cache_pos, 4, NH // NKV)
    wpos = write_index(cache_pos, MAX_LEN)
    rows = torch.tensor([0])
    write_cache(k, v, kc, vc, rows, wpos)
    plain = ATTENTION["sdpa"](q, k, v, kc, vc, rows, wpos, mask, 4)
    none = ATTENTION["sdpa"](q, k, v, kc, vc, rows, wpos, mask, 4, torch.full((NH,), -torch.inf))
    huge = ATTENTION["sdpa"](q, k, v, kc, vc, rows, wpos, mask, 4, torch.full((NH,), 1e4))
    torch.testing.assert_close(none, plain, atol=1e-6, rtol=0)
    assert huge.abs().max() < 1e-6


def test_window_mask_is_hf_sliding_window():
    """`visibility_mask(..., window)` is HF's `kv_idx > q_idx - sliding_window` and causal, in
    the folded `[B, 1, T * g, L]` layout; padding slots read index 0 only."""
    cache_pos = torch.tensor([[0, 3, 7, -1]])
    got = visibility_mask(cache_pos, 9, 2, window=3)
    for t, p in enumerate([0, 3, 7, 0]):
        want = [p - 3 < j <= p for j in range(9)]
        for i in range(2):
            assert got[0, 0, t * 2 + i].tolist() == want
