"""TTT attention's diagonal, merged into a causal block by log-sum-exp (training, forward and
backward).

At training-time-test step `S` (`drafttrain/objectives/ttt.py`) query row `n` of head `h` sees the causal
block of the step-0 keys, which a dense attention kernel computes (its output `out_c[n, h]`
and log-sum-exp `lse_c[n, h]`), plus one key per later step on its own row: `ks[n, j, s]`,
`vs[n, j, s]` for `s < S`, `j = h // g` its kv head (GQA, `g` query heads per kv head). With
`sd[n, h, s] = scale * q[n, h] . ks[n, j, s]`:

    lse  = logaddexp(lse_c, logsumexp_s sd)
    out  = exp(lse_c - lse) * out_c + sum_s exp(sd_s - lse) * vs[s]

Backward, given `dout` and the causal block's own `dq_c` (its kernel's backward run with the
merged `out` and `lse`, which is the causal block's exact share), with `p_s = exp(sd_s - lse)`
and `rowdot = dout . out`:

    ds   = p * (dout . vs[s] - rowdot)
    dq   = dq_c + scale * sum_s ds_s ks[s]
    dks  = scale * sum_{h in j} ds_s q[h]        dvs = sum_{h in j} p_s dout[h]

    ttt_merge(q [N, nh, D], out_c [N, nh, D], lse_c [N, nh] fp32, ks [N, nkv, S, D],
              vs [N, nkv, S, D], scale) -> (out [N, nh, D] in q's dtype, lse [N, nh] fp32)
    ttt_merge_backward(dout, out, q, lse, ks, vs, dq_c, scale) -> (dq [N, nh, D] in q's dtype,
              dks, dvs [N, nkv, S, D] in their dtype)

One Triton program per (row, kv head): its `g` query heads and `S` keys are a few KB, so the
products are broadcast multiplies and sums in registers (S and g are far below a tensor-core
tile). fp32 math. `ttt_merge_ref` / `ttt_merge_backward_ref` are the pure-torch references
with the same signatures (the test oracle, the CPU path and the benchmark baseline).
"""

from __future__ import annotations

import torch
from draftkernels.runtime import check_tensor as _check
from draftkernels.runtime import triton_available, use_triton

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _load_rows(ptr, base, n_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """A `[BLOCK_R, BLOCK_D]` fp32 tile of `n_rows` rows of `D` from `ptr + base`."""
        r = tl.arange(0, BLOCK_R)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        m = (r < n_rows) & (d < D)
        return tl.load(ptr + base + r * D + d, mask=m, other=0.0).to(tl.float32), m

    @triton.jit
    def _ttt_merge_kernel(
        q_ptr,  # [N, nh, D]
        oc_ptr,  # [N, nh, D]
        lc_ptr,  # [N, nh] fp32
        k_ptr,  # [N, nkv, S, D]
        v_ptr,  # [N, nkv, S, D]
        out_ptr,  # [N, nh, D]
        lse_ptr,  # [N, nh] fp32
        nh,
        nkv,
        S,
        D,
        scale,
        G: tl.constexpr,  # query heads per kv head
        BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        hbase = (n * nh + j * G) * D  # the group's first query head
        kbase = (n * nkv + j) * S * D
        q, _ = _load_rows(q_ptr, hbase, G, D, BLOCK_G, BLOCK_D)  # [G, D]
        oc, qm = _load_rows(oc_ptr, hbase, G, D, BLOCK_G, BLOCK_D)
        k, _ = _load_rows(k_ptr, kbase, S, D, BLOCK_S, BLOCK_D)  # [S, D]
        v, _ = _load_rows(v_ptr, kbase, S, D, BLOCK_S, BLOCK_D)
        gi = tl.arange(0, BLOCK_G)
        si = tl.arange(0, BLOCK_S)
        lc = tl.load(lc_ptr + n * nh + j * G + gi, mask=gi < G, other=0.0)  # [G]
        sd = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, S]
        sd = tl.where(si[None, :] < S, sd, float("-inf"))
        m = tl.maximum(tl.max(sd, axis=1), lc)
        lse = m + tl.log(tl.exp(lc - m) + tl.sum(tl.exp(sd - m[:, None]), axis=1))
        p = tl.exp(sd - lse[:, None])  # [G, S], 0 at padded keys
        out = tl.exp(lc - lse)[:, None] * oc + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        d = tl.arange(0, BLOCK_D)[None, :]
        tl.store(out_ptr + hbase + gi[:, None] * D + d, out.to(out_ptr.dtype.element_ty), mask=qm)
        tl.store(lse_ptr + n * nh + j * G + gi, lse, mask=gi < G)

    @triton.jit
    def _ttt_merge_backward_kernel(
        do_ptr,  # [N, nh, D]
        o_ptr,  # [N, nh, D] the merged output
        q_ptr,  # [N, nh, D]
        lse_ptr,  # [N, nh] fp32, merged
        k_ptr,  # [N, nkv, S, D]
        v_ptr,  # [N, nkv, S, D]
        dqc_ptr,  # [N, nh, D] the causal block's dq
        dq_ptr,  # [N, nh, D]
        dk_ptr,  # [N, nkv, S, D]
        dv_ptr,  # [N, nkv, S, D]
        nh,
        nkv,
        S,
        D,
        scale,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        hbase = (n * nh + j * G) * D
        kbase = (n * nkv + j) * S * D
        do, qm = _load_rows(do_ptr, hbase, G, D, BLOCK_G, BLOCK_D)
        o, _ = _load_rows(o_ptr, hbase, G, D, BLOCK_G, BLOCK_D)
        q, _ = _load_rows(q_ptr, hbase, G, D, BLOCK_G, BLOCK_D)
        dqc, _ = _load_rows(dqc_ptr, hbase, G, D, BLOCK_G, BLOCK_D)
        k, km = _load_rows(k_ptr, kbase, S, D, BLOCK_S, BLOCK_D)
        v, _ = _load_rows(v_ptr, kbase, S, D, BLOCK_S, BLOCK_D)
        gi = tl.arange(0, BLOCK_G)
        si = tl.arange(0, BLOCK_S)
        lse = tl.load(lse_ptr + n * nh + j * G + gi, mask=gi < G, other=0.0)
        sd = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, S]
        live = (gi[:, None] < G) & (si[None, :] < S)
        p = tl.where(live, tl.exp(sd - lse[:, None]), 0.0)
        rowdot = tl.sum(do * o, axis=1)  # [G]
        ds = p * (tl.sum(do[:, None, :] * v[None, :, :], axis=2) - rowdot[:, None])  # [G, S]
        dq = dqc + scale * tl.sum(ds[:, :, None] * k[None, :, :], axis=1)  # [G, D]
        dk = scale * tl.sum(ds[:, :, None] * q[:, None, :], axis=0)  # [S, D]
        dv = tl.sum(p[:, :, None] * do[:, None, :], axis=0)
        d = tl.arange(0, BLOCK_D)[None, :]
        tl.store(dq_ptr + hbase + gi[:, None] * D + d, dq.to(dq_ptr.dtype.element_ty), mask=qm)
        koff = kbase + si[:, None] * D + d
        tl.store(dk_ptr + koff, dk.to(dk_ptr.dtype.element_ty), mask=km)
        tl.store(dv_ptr + koff, dv.to(dv_ptr.dtype.element_ty), mask=km)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 (fp64 stays fp64: a reference run at higher precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _grouped(x: torch.Tensor, nkv: int) -> torch.Tensor:
    """`[N, nh, D]` -> `[N, nkv, g, D]`, widened (query heads grouped by their kv head)."""
    N, nh, D = x.shape
    return _wide(x).view(N, nkv, nh // nkv, D)


def _scores(q: torch.Tensor, ks: torch.Tensor, scale: float) -> torch.Tensor:
    """`[N, nkv, g, S]`: each query head's score against its own row's keys."""
    return (_grouped(q, ks.shape[1])[:, :, :, None] * _wide(ks)[:, :, None]).sum(-1) * scale


def ttt_merge_ref(q, out_c, lse_c, ks, vs, scale: float):
    """Pure-torch reference of `ttt_merge` (same signature and outputs)."""
    N, nh, D = q.shape
    nkv = ks.shape[1]
    sd = _scores(q, ks, scale)
    lc = lse_c.view(N, nkv, nh // nkv)
    lse = torch.logaddexp(lc, torch.logsumexp(sd, dim=-1))
    p = (sd - lse[..., None]).exp()  # [N, nkv, g, S]
    out = (lc - lse).exp()[..., None] * _grouped(out_c, nkv) + (
        p[..., None] * _wide(vs)[:, :, None]
    ).sum(-2)
    return out.to(q.dtype).view(N, nh, D), lse.view(N, nh)


def ttt_merge_backward_ref(dout, out, q, lse, ks, vs, dq_c, scale: float):
    """Pure-torch reference of `ttt_merge_backward` (same signature and outputs)."""
    N, nh, D = q.shape
    nkv = ks.shape[1]
    do = _grouped(dout, nkv)  # [N, nkv, g, D]
    kw, vw = _wide(ks)[:, :, None], _wide(vs)[:, :, None]  # [N, nkv, 1, S, D]
    p = (_scores(q, ks, scale) - lse.view(N, nkv, nh // nkv)[..., None]).exp()
    rowdot = (do * _grouped(out, nkv)).sum(-1, keepdim=True)
    ds = p * ((do[:, :, :, None] * vw).sum(-1) - rowdot)  # [N, nkv, g, S]
    dq = _wide(dq_c) + (ds[..., None] * kw).sum(-2).view(N, nh, D) * scale
    dk = (ds[..., None] * _grouped(q, nkv)[:, :, :, None]).sum(2) * scale
    dv = (p[..., None] * do[:, :, :, None]).sum(2)
    return dq.to(q.dtype), dk.to(ks.dtype), dv.to(vs.dtype)


def _check_shapes(q, ks, vs, lse, name: str) -> tuple[int, int, int, int, int]:
    if q.dim() != 3 or ks.dim() != 4:
        raise ValueError("q must be [N, nh, D] and ks [N, nkv, S, D]")
    N, nh, D = q.shape
    nkv, S = ks.shape[1], ks.shape[2]
    if nh % nkv or ks.shape[0] != N or ks.shape[3] != D:
        raise ValueError(f"ks {tuple(ks.shape)} does not fit q {tuple(q.shape)}")
    _check(vs, "vs", (ks.dtype,), tuple(ks.shape))
    _check(lse, name, (torch.float32,), (N, nh))
    return N, nh, D, nkv, S


# Warps per program: one (`python -m draftbench.ttt_merge` at the 8B shape on an H200: 1 warp
# 74-297 us a call over S = 1..6, 4 warps 149-747, 8 warps 236-946; a program's work is a few KB).
NUM_WARPS = 1


def _blocks(nh: int, nkv: int, S: int, D: int) -> dict:
    g = nh // nkv
    return dict(
        G=g,
        BLOCK_G=triton.next_power_of_2(g),
        BLOCK_S=triton.next_power_of_2(S),
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=NUM_WARPS,
    )


def ttt_merge(q, out_c, lse_c, ks, vs, scale: float):
    """See the module docstring. The Triton kernel where `use_triton` says so (CUDA, or the
    CPU under `TRITON_INTERPRET=1`), else `ttt_merge_ref`."""
    if not use_triton(q.device) or q.numel() == 0:
        return ttt_merge_ref(q, out_c, lse_c, ks, vs, scale)
    q, out_c, lse_c, ks, vs = (t.contiguous() for t in (q, out_c, lse_c, ks, vs))
    N, nh, D, nkv, S = _check_shapes(q, ks, vs, lse_c, "lse_c")
    _check(out_c, "out_c", (out_c.dtype,), (N, nh, D))
    out = torch.empty_like(q)
    lse = torch.empty(N, nh, dtype=torch.float32, device=q.device)
    _ttt_merge_kernel[(N, nkv)](
        q, out_c, lse_c, ks, vs, out, lse, nh, nkv, S, D, scale, **_blocks(nh, nkv, S, D)
    )
    return out, lse


def ttt_merge_backward(dout, out, q, lse, ks, vs, dq_c, scale: float):
    """See the module docstring (Triton where it runs, else `ttt_merge_backward_ref`)."""
    if not use_triton(q.device) or q.numel() == 0:
        return ttt_merge_backward_ref(dout, out, q, lse, ks, vs, dq_c, scale)
    dout, out, q, lse, ks, vs, dq_c = (t.contiguous() for t in (dout, out, q, lse, ks, vs, dq_c))
    N, nh, D, nkv, S = _check_shapes(q, ks, vs, lse, "lse")
    for t, name in ((dout, "dout"), (out, "out"), (dq_c, "dq_c")):
        _check(t, name, (t.dtype,), (N, nh, D))
    dq = torch.empty_like(q)
    dk, dv = torch.empty_like(ks), torch.empty_like(vs)
    _ttt_merge_backward_kernel[(N, nkv)](
        dout, out, q, lse, ks, vs, dq_c, dq, dk, dv, nh, nkv, S, D, scale,
        **_blocks(nh, nkv, S, D),
    )  # fmt: skip
    return dq, dk, dv
