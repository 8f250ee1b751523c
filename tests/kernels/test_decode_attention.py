"""Split-KV attention over the static cache (`draftkernels.decode_attention`): kernel ==
reference == SDPA over the written cache (`kv_cache.cached_attention`, the oracle that is not
this module), on GQA groups 1/2/4, one to 16 query slots, several rows in a permuted cache,
padding slots, a key range spread over several splits and one (CPU: Triton interpreter;
CUDA: compiled, and inside `torch.compile` + a CUDA graph)."""

from __future__ import annotations

import pytest
import torch
from draftkernels.runtime import use_triton

from draftinfer.models.kv_cache import cached_attention, visibility_mask, write_cache, write_index
from tests.support.utils import import_kernel_module, kernel_test_device, poison_empty  # noqa: F401

da = import_kernel_module("draftkernels.decode_attention")
DEVICE = kernel_test_device()
DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
TOL = 1e-5 if DTYPE == torch.float32 else 2e-2


def case(B, T, nh, nkv, d, max_len, attn_len, seed=0, pad=True, window=None):
    """Random q/k/v for `B` rows at random cache rows of a larger cache; slot positions
    `< attn_len`, one padding slot (-1) when `pad`; the new K/V already written; the mask of a
    sliding `window` of keys when given."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, nh, d, generator=g)
    k, v = torch.randn(2, B, T, nkv, d, generator=g)
    kc, vc = torch.randn(2, B + 2, max_len + 1, nkv, d, generator=g)
    rows = torch.randperm(B + 2, generator=g)[:B]
    start = torch.randint(0, attn_len - T + 1, (B,), generator=g)
    cache_pos = start[:, None] + torch.arange(T)  # consecutive slots, as a round writes
    cache_pos[:, -1] = attn_len - 1  # some slot reads the whole range
    if pad and B * T > 1:
        cache_pos[-1, 0] = -1
    wpos = write_index(cache_pos, max_len)
    mask = visibility_mask(cache_pos, attn_len, nh // nkv, window)
    to = dict(device=DEVICE)
    t = [x.to(**to, dtype=DTYPE) for x in (q, k, v, kc, vc)]
    return (*t, rows.to(**to), wpos.to(**to), mask.to(**to), attn_len)


def run_all(q, k, v, kc, vc, rows, wpos, mask, L):
    """(oracle, reference, kernel) outputs: the oracle through `cached_attention` (which
    writes the cache itself), the other two over a cache written by `write_cache`."""
    want = cached_attention(q, k, v, kc.clone(), vc.clone(), rows, wpos, mask, L)
    kc2, vc2 = kc.clone(), vc.clone()
    write_cache(k, v, kc2, vc2, rows, wpos)
    ref = da.decode_attention_ref(q, kc2, vc2, rows, mask, L)
    got = da.decode_attention(q, kc2, vc2, rows, mask, L)
    return want, ref, got


SHAPES = [
    # B, T, nh, nkv, d, max_len, attn_len
    (1, 1, 8, 2, 64, 200, 37),  # one-token step, one split
    (1, 1, 4, 1, 32, 300, 300),  # MQA, the whole cache
    (3, 5, 8, 2, 64, 400, 333),  # verify of 5 slots, several rows and splits
    (2, 4, 4, 4, 32, 100, 70),  # no GQA
    (1, 16, 8, 2, 16, 80, 65),  # 64 rows: the largest tile, a key range past one tile
    (1, 9, 16, 2, 32, 200, 150),  # g = 8, 9 slots (gpt-oss at K = 8): 72 rows, two launches
    (2, 16, 8, 1, 16, 100, 70),  # g = 8, 16 slots: 128 rows, two full launches
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_and_reference_match_sdpa(shape, poison_empty):  # noqa: F811
    want, ref, got = run_all(*case(*shape))
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(ref.float(), want.float(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("window", [1, 7, 100])
def test_sliding_window_is_a_mask_the_kernel_reads(window, poison_empty):  # noqa: F811
    """A sliding window (gpt-oss) is only the mask `p - w < j <= p`: splits whose keys are all
    outside it merge with weight 0, a window of one key reads the slot's own key only."""
    want, ref, got = run_all(*case(3, 5, 8, 2, 32, 400, 333, seed=4, window=window))
    torch.testing.assert_close(ref.float(), want.float(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("splits", ["one", "many"])
@pytest.mark.parametrize("window", [None, 7])
def test_sinks_join_the_merge_as_sdpa_takes_them(splits, window, monkeypatch, poison_empty):  # noqa: F811
    """gpt-oss's attention sinks (a logit per query head in the softmax, no value): kernel ==
    reference == SDPA with the exact extra zero key/value column (`cached_attention` with
    `sinks`, the path pinned against transformers' gpt-oss), with one split (pass 1
    normalises) and several (pass 2 merges), with and without a window; large sinks too, so
    the sink dominates some rows."""
    if splits == "one":
        monkeypatch.setattr(da, "TARGET_PROGRAMS", 1)
    q, k, v, kc, vc, rows, wpos, mask, L = case(3, 5, 8, 2, 32, 400, 333, seed=6, window=window)
    g = torch.Generator().manual_seed(7)
    sinks = (torch.randn(8, generator=g) * 3).to(DEVICE)  # fp32, some heads far above scores
    assert (da.split_plan(3 * 2, L)[1] == 1) == (splits == "one")
    want = cached_attention(q, k, v, kc.clone(), vc.clone(), rows, wpos, mask, L, sinks)
    kc2, vc2 = kc.clone(), vc.clone()
    write_cache(k, v, kc2, vc2, rows, wpos)
    ref = da.decode_attention_ref(q, kc2, vc2, rows, mask, L, sinks)
    got = da.decode_attention(q, kc2, vc2, rows, mask, L, sinks)
    torch.testing.assert_close(ref.float(), want.float(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL, rtol=TOL)
    plain = da.decode_attention(q, kc2, vc2, rows, mask, L)
    assert (plain.float() - got.float()).abs().max() > 10 * TOL  # the sinks changed the output
    with pytest.raises(ValueError, match="sinks"):
        da.decode_attention(q, kc2, vc2, rows, mask, L, sinks.half())


def test_one_split_equals_many(monkeypatch):
    """The split merge is exact up to rounding: one program per KV head gives the same."""
    args = case(2, 3, 8, 2, 64, 400, 390, seed=3)
    many = run_all(*args)[2]
    monkeypatch.setattr(da, "TARGET_PROGRAMS", 1)
    assert da.split_plan(4, 390)[1] == 1
    one = run_all(*args)[2]
    torch.testing.assert_close(one.float(), many.float(), atol=TOL, rtol=TOL)


def test_min_chunk_takes_fewer_splits_with_the_same_result(monkeypatch, poison_empty):  # noqa: F811
    """At least `MIN_CHUNK` keys a split: 390 keys in 3 splits of 128 (from 7), then one
    split writing the output itself (no pass 2), every output element written."""
    args = case(2, 3, 8, 2, 64, 400, 390, seed=4)
    many = run_all(*args)[2]
    for min_chunk, splits in ((128, 3), (512, 1)):
        monkeypatch.setattr(da, "MIN_CHUNK", min_chunk)
        assert da.split_plan(4, 390)[1] == splits
        torch.testing.assert_close(run_all(*args)[2].float(), many.float(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("min_chunk", [0, 256, 1024])
@pytest.mark.parametrize("programs", [1, 2, 8, 64, 128, 1000])
@pytest.mark.parametrize("attn_len", [1, 63, 64, 65, 600, 8192])
def test_split_plan_covers_the_keys_once(programs, attn_len, min_chunk, monkeypatch):
    monkeypatch.setattr(da, "MIN_CHUNK", min_chunk)
    chunk, ns = da.split_plan(programs, attn_len)
    assert chunk % da.BLOCK_N == 0 and ns >= 1
    assert (ns - 1) * chunk < attn_len <= ns * chunk  # no empty split, every key in one
    assert programs * ns <= max(programs, da.TARGET_PROGRAMS) and ns <= da.MAX_SPLITS
    assert ns == 1 or chunk >= min_chunk


def test_more_rows_than_one_launch_take_slot_ranges_each_as_its_own_call():
    """72 rows at g = 8 (9 slots): slots 0-7 and slot 8 launched apart, each range's output
    bit for bit what a call with those slots alone returns."""
    q, _, _, kc, vc, rows, _, mask, L = case(1, 9, 16, 2, 32, 200, 150)
    assert da.supports(q, kc) and 9 * 8 > da.MAX_ROWS
    got = da.decode_attention(q, kc, vc, rows, mask, L)
    head = da.decode_attention(q[:, :8].contiguous(), kc, vc, rows, mask[:, :, :64].contiguous(), L)
    tail = da.decode_attention(q[:, 8:].contiguous(), kc, vc, rows, mask[:, :, 64:].contiguous(), L)
    assert torch.equal(got, torch.cat([head, tail], dim=1))


def test_too_many_rows_fall_back_to_the_reference():
    q, _, _, kc, vc, rows, _, mask, L = case(1, 33, 8, 2, 16, 80, 65)
    assert not da.supports(q, kc)  # 33 * 4 > MAX_LAUNCHES * MAX_ROWS
    torch.testing.assert_close(
        da.decode_attention(q, kc, vc, rows, mask, L),
        da.decode_attention_ref(q, kc, vc, rows, mask, L),
    )


def test_the_kernel_runs_here():
    q, _, _, kc, *_ = case(1, 1, 8, 2, 64, 200, 37)
    assert use_triton(torch.device(DEVICE)) and da.supports(q, kc)


def test_rejects_bad_inputs():
    q, _, _, kc, vc, rows, _, mask, L = case(1, 2, 8, 2, 16, 40, 30)
    with pytest.raises(ValueError, match="mask must be bool"):
        da.decode_attention(q, kc, vc, rows, mask[..., :-1], L)
    with pytest.raises(ValueError, match="rows must be int64"):
        da.decode_attention(q, kc, vc, rows.int(), mask, L)
    with pytest.raises(ValueError, match="do not fit"):
        da.decode_attention(q[:, :, :7], kc, vc, rows, mask, L)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_and_graph_captured_backend_equals_eager():
    """The runner's default backend under `torch.compile` and replayed from a CUDA graph:
    the custom op stays one call and reads the cache its own forward just wrote."""
    from draftinfer.models.kv_cache import cached_attention_split_kv

    q, k, v, kc, vc, rows, wpos, mask, L = case(2, 4, 32, 8, 128, 1024, 700, seed=5)
    want = cached_attention(q, k, v, kc.clone(), vc.clone(), rows, wpos, mask, L)
    fn = torch.compile(cached_attention_split_kv, fullgraph=True)
    kc2, vc2 = kc.clone(), vc.clone()
    fn(q, k, v, kc2, vc2, rows, wpos, mask, L)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, k, v, kc2, vc2, rows, wpos, mask, L)
    kc2.copy_(kc)
    vc2.copy_(vc)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), want.float(), atol=TOL, rtol=TOL)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
    reason="needs a Hopper (or later) GPU",
)
@pytest.mark.parametrize("shape", [(1, 8, 32, 8, 128, 1024, 600), (1, 1, 32, 8, 128, 1024, 40)])
def test_pdl_launch_gives_the_same_bits(shape, monkeypatch):
    """Launched with programmatic dependent launch (`runtime.PDL`) both passes (and the one
    split that writes the output itself) return the bits they return without; replayed from
    a CUDA graph right after the cache write, they read the written cache."""
    from draftkernels.runtime import PDL

    q, k, v, kc, vc, rows, wpos, mask, L = case(*shape, seed=3)
    kc2, vc2 = kc.clone(), vc.clone()
    write_cache(k, v, kc2, vc2, rows, wpos)
    monkeypatch.setitem(PDL, "on", False)
    want = da.decode_attention(q, kc2, vc2, rows, mask, L)
    monkeypatch.setitem(PDL, "on", True)
    assert torch.equal(da.decode_attention(q, kc2, vc2, rows, mask, L), want)
    kc3, vc3 = kc.clone(), vc.clone()
    da.decode_attention(q, kc3, vc3, rows, mask, L)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_cache(k, v, kc3, vc3, rows, wpos)
        out = da.decode_attention(q, kc3, vc3, rows, mask, L)
    kc3.copy_(kc)
    vc3.copy_(vc)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
