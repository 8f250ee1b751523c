"""Attention of a few query slots per row over the static KV cache (decode, verify, drafting).

    decode_attention(q [B, T, nh, D], k_cache [MB, ML + 1, nkv, D], v_cache, rows [B] int64,
                     mask [B, 1, T * g, L] bool, attn_len L, sinks [nh] fp32 | None)
        -> o [B, T, nh, D] (q's dtype)

The arguments are `draftinfer.models.kv_cache.cached_attention`'s after its cache write: query slot
`(b, t)`, head `h` reads cache row `rows[b]`, indices `0..L-1` of KV head `h // g` (`g = nh //
nkv`, HF's repeat_kv order), where `mask[b, 0, t * g + h % g, j]` is True.

Why a kernel: a one-token step at batch 1 has `B * nkv = 8` (Llama-3.1-8B) query groups of 4
rows each. A flash-attention kernel tiles the query axis, so it runs 8 programs of at most 4
useful rows: on an H100 cuDNN's flash forward took 24 us per layer at L = 512, where reading
2 MB of K/V takes under 1 us (`docs/results.md`). Here the keys are split instead (flash
decoding): pass 1 runs program `(b * nkv + h, split s)` over keys `[s * CHUNK, (s + 1) *
CHUNK)` for all `T * g` query rows of that KV head at once (one `tl.dot` per tile, the GQA
group folded into the rows, no K/V copy per query head), keeping the running max `m`, sum `l`
and unnormalised output in a workspace; pass 2 merges the splits per row. Where the plan has
one split (at most 64 keys, or at least `TARGET_PROGRAMS` query groups: batch 16 and up at
eight KV heads) pass 1 normalises and writes the output itself and pass 2 is not launched
(on an H100, 0.9-4 us less a call there, `docs/results.md`). The cache is read in place
through `rows` (no gather of the row's prefix, at any batch). Under programmatic dependent
launch (`runtime.pdl`, off by default) both passes wait for the kernels before them first.

Attention sinks (gpt-oss: `sinks`, one logit per query head that joins the softmax and carries
no value) enter where the splits are merged: as one more split with maximum `sink * log2(e)`,
sum 1 and a zero output (in pass 2, or in pass 1's normalisation where there is one split).

Softmax in base 2 with the scale folded into the scores, fp32 statistics and accumulator, `p`
cast to V's dtype for the second product (as flash attention does). A split whose keys are
all masked for a row keeps `m = -1e30` and weight 0 in pass 2; every row sees index 0, so no
row is empty overall.

`decode_attention_ref` is the pure-torch reference with the same signature (test oracle, CPU
path, benchmark baseline). `decode_attention` is registered as the custom op
`draftkernels::decode_attention`, so `torch.compile` keeps it as one opaque call (inside
CUDA graphs too). `supports(q, k_cache)` says when the kernel applies (CUDA, or the CPU
interpreter, and `fits`: `T * g <= MAX_LAUNCHES * MAX_ROWS`, power-of-two head_dim); `fits`
checks only the shapes, so a compiled caller can choose the kernel without a graph break.
More than `MAX_ROWS` query rows (a verify of K + 1 = 9 slots at g = 8: gpt-oss-20b and
Qwen3-30B-A3B at K = 8) run as launches over consecutive slot ranges of at most `MAX_ROWS`
rows each, every launch reading the keys again; before, such a pass fell back to SDPA (the
prefill path) in every layer.
"""

from __future__ import annotations

import math

import torch
from draftkernels.runtime import pdl, triton_available, use_triton

TRITON = triton_available()
# Query rows (T * g) one program holds: decode (g), verify of K + 1 <= 16 slots at g = 4.
MAX_ROWS = 64
# Launches one call may take over consecutive query-slot ranges (`T * g` up to twice MAX_ROWS):
# verify passes at g = 8 up to K + 1 = 16 slots; prefill chunks stay with SDPA.
MAX_LAUNCHES = 2
BLOCK_N = 64
# Programs pass 1 aims for (about one wave on an H100's 132 SMs), and the most key splits
# (pass 2 merges one row's splits in one vector load).
TARGET_PROGRAMS = 128
MAX_SPLITS = 32
# Keys a split covers at least: fewer splits at short lengths (one split skips pass 2). 0: no
# floor. `python -m draftbench.decode_attention --plans` sweeps it; on an H100 a floor of 256
# to 1024 keys cost 3-20 us at batch 1 and 1024 keys and saved about 1 us only at batch 8 and
# 256 keys (2026-11-27), so the plan is the programs target alone.
MIN_CHUNK = 0

if triton_available():
    import triton
    import triton.language as tl
    from draftkernels.runtime import pdl_enter

    @triton.jit
    def _split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        rows_ptr,
        mask_ptr,
        m_ptr,  # [B * nkv, S, BLOCK_M] fp32
        l_ptr,  # [B * nkv, S, BLOCK_M] fp32
        acc_ptr,  # [B * nkv, S, BLOCK_M, D] fp32
        L,
        M,  # T * G query rows
        CHUNK,
        NS,
        scale_log2,
        sq_b,
        sq_t,
        sq_h,
        sk_b,
        sk_l,
        sk_h,
        sv_b,
        sv_l,
        sv_h,
        sm_b,
        sm_m,
        G: tl.constexpr,
        NKV: tl.constexpr,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        o_ptr,  # the output [B, T, nh, D] (written here only under DIRECT)
        so_b,
        so_t,
        so_h,
        DIRECT: tl.constexpr,  # one split: normalise and write o (no pass 2, no workspace)
        PDL: tl.constexpr = False,  # programmatic dependent launch (`runtime.pdl_enter`)
        sink_ptr=None,  # [nh] fp32 sink logits (SINKS)
        SINKS: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        pid = tl.program_id(0)
        s = tl.program_id(1)
        b = pid // NKV
        h = pid % NKV
        row = tl.load(rows_ptr + b)
        mi = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        rows_ok = mi < M
        t = mi // G
        head = h * G + mi % G
        q = tl.load(
            q_ptr + b * sq_b + t[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
            mask=rows_ok[:, None],
            other=0.0,
        )
        k_base = k_ptr + row * sk_b + h * sk_h
        v_base = v_ptr + row * sv_b + h * sv_h
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, L)
        m_i = tl.full([BLOCK_M], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            k = tl.load(k_base + n[:, None] * sk_l + d[None, :], mask=n_ok[:, None], other=0.0)
            k = k.to(q.dtype)
            if IEEE:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(k))
            vis = tl.load(
                mask_ptr + b * sm_b + mi[:, None] * sm_m + n[None, :],
                mask=rows_ok[:, None] & n_ok[None, :],
                other=0,
            )
            sc = tl.where(vis != 0, sc * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * sv_l + d[None, :], mask=n_ok[:, None], other=0.0)
            v = v.to(q.dtype)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if DIRECT:
            if SINKS:  # the sink: one more term of the sum, with no value
                sk = tl.load(sink_ptr + head, mask=rows_ok, other=0.0) * 1.4426950408889634
                m_s = tl.maximum(m_i, sk)
                l_i = l_i * tl.exp2(m_i - m_s) + tl.exp2(sk - m_s)
                acc = acc * tl.exp2(m_i - m_s)[:, None]
            # Every row sees cache index 0, so l_i > 0 for every real row.
            out = acc / tl.where(rows_ok, l_i, 1.0)[:, None]
            tl.store(
                o_ptr + b * so_b + t[:, None] * so_t + head[:, None] * so_h + d[None, :],
                out.to(o_ptr.dtype.element_ty),
                mask=rows_ok[:, None],
            )
        else:
            ws = (pid * NS + s) * BLOCK_M + mi
            tl.store(m_ptr + ws, m_i)
            tl.store(l_ptr + ws, l_i)
            tl.store(acc_ptr + ws[:, None] * D + d[None, :], acc)

    @triton.jit
    def _combine_kernel(
        m_ptr,
        l_ptr,
        acc_ptr,
        o_ptr,
        NS,
        so_b,
        so_t,
        so_h,
        G: tl.constexpr,
        NKV: tl.constexpr,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_S: tl.constexpr,
        PDL: tl.constexpr = False,
        sink_ptr=None,  # [nh] fp32 sink logits (SINKS)
        SINKS: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        pid = tl.program_id(0)
        r = tl.program_id(1)  # query row t * G + (head % G)
        b = pid // NKV
        h = pid % NKV
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, D)
        ok = s < NS
        ws = (pid * NS + s) * BLOCK_M + r
        m_s = tl.load(m_ptr + ws, mask=ok, other=-1e30)
        l_s = tl.load(l_ptr + ws, mask=ok, other=0.0)
        # Every row sees cache index 0, so some split holds a finite max; empty splits and
        # the lanes past NS weigh exp2(-1e30 - max) = 0.
        head = h * G + r % G
        m_max = tl.max(m_s, 0)
        if SINKS:  # the sink: one more split with maximum `sink * log2(e)`, sum 1, no value
            sk = tl.load(sink_ptr + head) * 1.4426950408889634
            m_max = tl.maximum(m_max, sk)
        w = tl.exp2(m_s - m_max)
        a = tl.load(acc_ptr + ws[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        den = tl.sum(l_s * w, 0)
        if SINKS:
            den += tl.exp2(sk - m_max)
        out = tl.sum(a * w[:, None], 0) / den
        tl.store(
            o_ptr + b * so_b + (r // G) * so_t + head * so_h + d, out.to(o_ptr.dtype.element_ty)
        )


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    attn_len: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference (module docstring), fp32 maths -> q's dtype."""
    B, T, nh, d = q.shape
    nkv = k_cache.shape[2]
    g = nh // nkv
    kc = k_cache[rows, :attn_len].float().permute(0, 2, 1, 3)  # [B, nkv, L, D]
    vc = v_cache[rows, :attn_len].float().permute(0, 2, 1, 3)
    qf = q.float().view(B, T, nkv, g, d).permute(0, 2, 1, 3, 4).reshape(B, nkv, T * g, d)
    s = qf @ kc.transpose(-1, -2) / math.sqrt(d)  # [B, nkv, T * g, L]
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column of the softmax, dropped before the product with V
        sink = sinks.float().view(1, nkv, 1, g, 1).expand(B, nkv, T, g, 1).reshape(B, nkv, -1, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    o = p @ vc  # [B, nkv, T * g, D]
    return o.view(B, nkv, T, g, d).permute(0, 2, 1, 3, 4).reshape(B, T, nh, d).to(q.dtype)


def fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these shapes (`T * g <= MAX_LAUNCHES * MAX_ROWS` with
    `g <= MAX_ROWS`, a power-of-two head_dim of at least 16, unit-stride last dims). Shapes
    only, so `torch.compile` traces it."""
    d = q.shape[-1]
    g = q.shape[2] // k_cache.shape[2]
    return (
        g <= MAX_ROWS
        and q.shape[1] * g <= MAX_LAUNCHES * MAX_ROWS
        and d >= 16
        and d & (d - 1) == 0
        and q.stride(-1) == 1 == k_cache.stride(-1)
    )


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `decode_attention` runs the kernel here (CUDA or the interpreter, and `fits`)."""
    return use_triton(q.device) and fits(q, k_cache)


def split_plan(programs: int, attn_len: int) -> tuple[int, int]:
    """(CHUNK, number of splits) for `programs = B * nkv` query groups over `attn_len` keys:
    about `TARGET_PROGRAMS` programs in all, at most `MAX_SPLITS` per query group and at least
    `MIN_CHUNK` keys a split, each over a whole number of `BLOCK_N` tiles."""
    want = min(MAX_SPLITS, max(1, TARGET_PROGRAMS // max(programs, 1)))
    want = min(want, max(1, attn_len // max(MIN_CHUNK, 1)))
    tiles = triton_cdiv(attn_len, BLOCK_N)
    chunk = triton_cdiv(tiles, min(want, tiles)) * BLOCK_N
    return chunk, triton_cdiv(attn_len, chunk)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch(q, k_cache, v_cache, rows, mask, attn_len: int, sinks=None) -> torch.Tensor:
    B, T, nh, d = q.shape
    nkv = k_cache.shape[2]
    g = nh // nkv
    M = T * g
    block_m = max(16, triton.next_power_of_2(M))
    chunk, ns = split_plan(B * nkv, attn_len)
    dev = q.device
    direct = ns == 1
    use_pdl = pdl(dev)
    o = torch.empty_like(q)
    if direct:  # pass 1 writes o itself: no workspace (the pointers go unread)
        m_ws = l_ws = acc_ws = o
    else:
        m_ws = torch.empty(B * nkv * ns * block_m, dtype=torch.float32, device=dev)
        l_ws = torch.empty_like(m_ws)
        acc_ws = torch.empty(B * nkv * ns * block_m * d, dtype=torch.float32, device=dev)
    mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    _split_kernel[(B * nkv, ns)](
        q,
        k_cache,
        v_cache,
        rows,
        mask,
        m_ws,
        l_ws,
        acc_ws,
        attn_len,
        M,
        chunk,
        ns,
        math.log2(math.e) / math.sqrt(d),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        mask.stride(0),
        mask.stride(2),
        G=g,
        NKV=nkv,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32,
        o_ptr=o,
        so_b=o.stride(0),
        so_t=o.stride(1),
        so_h=o.stride(2),
        DIRECT=direct,
        PDL=use_pdl,
        sink_ptr=sinks,
        SINKS=sinks is not None,
        launch_pdl=use_pdl,
    )
    if direct:
        return o
    _combine_kernel[(B * nkv, M)](
        m_ws,
        l_ws,
        acc_ws,
        o,
        ns,
        o.stride(0),
        o.stride(1),
        o.stride(2),
        G=g,
        NKV=nkv,
        D=d,
        BLOCK_M=block_m,
        BLOCK_S=triton.next_power_of_2(ns),
        PDL=use_pdl,
        sink_ptr=sinks,
        SINKS=sinks is not None,
        launch_pdl=use_pdl,
    )
    return o


def _check(q, k_cache, v_cache, rows, mask, attn_len: int, sinks=None) -> None:
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("q must be [B, T, nh, D] and the caches [MB, ML + 1, nkv, D], alike")
    B, T, nh, d = q.shape
    nkv = k_cache.shape[2]
    if k_cache.shape[3] != d or nh % nkv:
        raise ValueError(f"q heads {nh} x {d} do not fit cache heads {nkv} x {k_cache.shape[3]}")
    if rows.shape != (B,) or rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64 [{B}]")
    if mask.dtype != torch.bool or tuple(mask.shape) != (B, 1, T * (nh // nkv), attn_len):
        raise ValueError(f"mask must be bool [{B}, 1, {T * (nh // nkv)}, {attn_len}]")
    if not 1 <= attn_len <= k_cache.shape[1]:
        raise ValueError(f"attn_len={attn_len} outside 1..{k_cache.shape[1]}")
    if sinks is not None and (sinks.shape != (nh,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be fp32 [{nh}]")


@torch.library.custom_op("draftkernels::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    attn_len: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module docstring: the kernel where `supports` says so, else the reference."""
    _check(q, k_cache, v_cache, rows, mask, attn_len, sinks)
    if not supports(q, k_cache):
        return decode_attention_ref(q, k_cache, v_cache, rows, mask, attn_len, sinks)
    sinks = None if sinks is None else sinks.contiguous()
    T, g = q.shape[1], q.shape[2] // k_cache.shape[2]
    if T * g <= MAX_ROWS:
        return _launch(q, k_cache, v_cache, rows, mask, attn_len, sinks)
    # Consecutive slot ranges of at most MAX_ROWS query rows (mask rows t * g + j): each range
    # gets exactly what a call with its slots alone returns.
    step = MAX_ROWS // g
    return torch.cat(
        [
            _launch(
                q[:, t : t + step],
                k_cache,
                v_cache,
                rows,
                mask[:, :, t * g : (t + step) * g],
                attn_len,
                sinks,
            )
            for t in range(0, T, step)
        ],
        dim=1,
    )


@decode_attention.register_fake
def _(q, k_cache, v_cache, rows, mask, attn_len, sinks=None):
    return torch.empty_like(q)
