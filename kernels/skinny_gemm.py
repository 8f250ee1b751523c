"""`F.linear` for a few rows of input (decode, verify, drafting): a weight-streaming GEMM.

    skinny_gemm(x [M, K], weight [N, K], bias [N] | None) -> y [M, N] (x's dtype)

Why a kernel: at batch 1 a decode step is a chain of GEMVs whose cost is reading the weights
once. On an H100, cuBLAS streamed a Llama-3.1-8B step's weights (15 GB) at 2.66 TB/s and
inductor's coordinate-descent-tuned reductions (gpt-fast's step) at 2.92; this kernel at 2.96
(`python -m draftbench.skinny_gemm`, `docs/results.md`). Each program owns `BLOCK_N` output
columns and streams their weight rows over K once, in `BLOCK_K` tiles, for all `M` input rows:

- `M == 1` (`BLOCK_M == 1`): a multiply-accumulate into a `[BLOCK_N, BLOCK_K]` fp32 tile,
  summed over K at the end (no reduction inside the loop; wide vector loads of W).
- `1 < M <= MAX_ROWS`: `tl.dot` of the x tile (`BLOCK_M = 16` rows, the smallest MMA tile;
  padding rows are masked) with the transposed weight tile, fp32 accumulator; or swapped
  (`swap`, the tables' choice): `tl.dot` of the weight tile with the transposed x tile, so
  the weight's `BLOCK_N` (64 or 128) rows are the MMA's M side (Hopper's warpgroup MMA needs
  64) and the output is written transposed back; or swapped with the tiles brought in by
  the tensor memory accelerator (`"tma"`: host tensor descriptors, rows past M and columns
  past K zero-filled by the copy, no masks). Split K (partial sums of several programs per
  column block added in an fp32 workspace, the last to arrive writing y) was tried and
  removed: on an H100 under Triton 3.6 its in-kernel epilogue returned wrong rows for some
  row counts, and it paid only on the narrow weights (`docs/results.md`, 2026-11-26).

`swiglu(x, gate_up_weight [2N, K])` -> `silu(gate) * up` `[M, N]`: at 2..16 rows the same
kernel with each program streaming the gate and the up rows of its output columns and the
product as its epilogue (one launch fewer a SwiGLU MLP); at one row the GEMM, then the product.

`skinny_rms_gemm(x, eps, weight, bias)`: `F.linear` of x's rows RMS-normalised (no norm
weight: the caller folds it into `weight`), in one launch: each program sums the squares of
the x tiles its loop reads anyway and scales its outputs by each row's `1 / rms` at the end
(`skinny_rms_swiglu` the same with SwiGLU's epilogue). `skinny_gemm_add(x, weight, bias,
residual)`: `residual + F.linear(x, weight, bias)`, the add as the epilogue (the same bits as
the GEMM then the add). `rms_linear`, `rms_swiglu` and `linear_add` take them at 2..16 rows
on CUDA (a decoder layer's two norm kernels fewer, `draftinfer.models.transforms`); at one row
the norm's extra reduction in every program costs more than it saves, and they run unfused.
Scaling the operand by the norm's weight inside the loop (the tile's trip through registers
before the MMA) cost more than the norm kernel: hence the fold.

The config (`BLOCK_N`, `BLOCK_K`, warps, stages) comes from `config(M, N, K)`, a table
measured by `python -m draftbench.skinny_gemm --sweep` (one per M class and weight shape,
a default elsewhere); no autotuning at run time, so a CUDA graph captures one fixed kernel.

Launched with programmatic dependent launch (`runtime.pdl`; the runner's default when it
compiles on CUDA, `InferConfig.pdl`) a program waits for the kernels before it
(`runtime.pdl_enter`) before it reads x or writes y; the one-row path reads its first weight
tile before that wait (no kernel writes the weights). The MMA paths read nothing before it:
their first tile read ahead so (a stage of shared memory more) made a Llama layer's four
launches at 8 rows 1% slower on an H100 (`docs/results.md`, 2026-11-27).

`skinny_gemm_ref` (and `skinny_swiglu_ref`, `skinny_rms_gemm_ref`, `skinny_rms_swiglu_ref`,
`skinny_gemm_add_ref`) is the pure-torch reference with the same signature (fp32 maths, test
oracle, CPU path). `skinny_gemm` is registered as the custom op `draftkernels::skinny_gemm`,
so `torch.compile` keeps it as one opaque call (inside CUDA graphs too). `fits(x, weight)`
checks only shapes and dtypes (a compiled caller picks it without a graph break); `linear`
has `F.linear`'s signature and takes the kernel where it fits, `F.linear` elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from draftkernels.runtime import pdl, triton_available, use_triton

TRITON = triton_available()
# Input rows one launch takes (a verify of K + 1 <= 16 slots at batch 1); above, cuBLAS.
MAX_ROWS = 16
# Output columns below which several rows stay on cuBLAS: the MMA path's 64-column programs
# are too few there. At 1024 columns (a Llama k or v), 5 rows: 7.9 us vs cuBLAS's 8.2 on an
# H100.
MIN_COLS_MMA = 1024
DTYPES = (torch.bfloat16, torch.float16)
# Shared memory the MMA path's pipeline stages may take with SwiGLU's two weight tiles a stage
# (the H100 has 232,448 bytes a block).
SWIGLU_SMEM = 196_608

# (BLOCK_N, BLOCK_K, num_warps, num_stages[, variant]); keys (M class, N, K), M class 1 or
# "m16"; variant (several rows): False = MMA, True = swapped MMA, "tma" = swapped MMA with
# tensor-memory-accelerator loads (swapped where the operands do not allow it, `tma_ok`).
# Measured on an H100 (`python -m draftbench.skinny_gemm --sweep`; one row 2026-11-26 session
# 7, "m16" 2026-11-26): Llama-3.1-8B's fused q/k/v, o, gate/up, down and head; the unfused k/v;
# EAGLE-3's fc and draft head; MTP's eh_proj. One row: one weight row a program, K in
# 4096-wide tiles, 8 warps. Several rows: the swapped MMA (the weight tile as the MMA's 64- or
# 128-row side, Hopper's warpgroup MMA) beat the unswapped one on every shape by 0.5-3%; its
# copy-engine loads ("tma") another 1-3% on the 4096-column shapes, nothing elsewhere.
DEFAULT = {1: (2, 2048, 8, 1), "m16": (64, 256, 4, 4, True)}
TABLE: dict[tuple, tuple[int, int, int, int]] = {
    (1, 6144, 4096): (1, 4096, 8, 1),
    (1, 4096, 4096): (1, 4096, 8, 3),
    (1, 28672, 4096): (1, 4096, 8, 1),
    (1, 4096, 14336): (1, 2048, 4, 3),
    (1, 128256, 4096): (1, 4096, 8, 1),
    (1, 4096, 12288): (1, 4096, 8, 3),
    (1, 32000, 4096): (1, 4096, 8, 3),
    (1, 4096, 8192): (1, 4096, 8, 3),
    (1, 1024, 4096): (1, 2048, 4, 1),
    (1, 2048, 4096): (1, 4096, 8, 1),
    # gpt-oss-20b's and Qwen3-30B-A3B's fused q/k/v, o and head, one row: measured on an H200
    # 2026-11-29 (`--sweep --sweep-classes 1 --shapes oss_qkv,...`): 9.6, 7.9, 258.0, 7.2,
    # 6.2, 139.5 us, cold L2.
    (1, 5120, 2880): (2, 1024, 4, 3),
    (1, 2880, 4096): (2, 1024, 4, 1),
    (1, 201088, 2880): (2, 1024, 4, 1),
    (1, 5120, 2048): (4, 1024, 4, 3),
    # Qwen3-30B-A3B's o (2048 x 4096, swept at 6.2 us with (4, 2048, 4, 1)) is the key of the
    # fused k/v above, measured on the H100: that entry stays.
    (1, 151936, 2048): (4, 1024, 4, 1),
    ("m16", 6144, 4096): (64, 128, 4, 6, True),
    ("m16", 4096, 4096): (64, 256, 4, 4, "tma"),
    ("m16", 28672, 4096): (128, 128, 4, 4, True),
    ("m16", 4096, 14336): (64, 256, 4, 5, "tma"),
    ("m16", 128256, 4096): (64, 128, 4, 6, True),
    ("m16", 1024, 4096): (64, 256, 4, 5, "tma"),
    ("m16", 2048, 4096): (64, 256, 4, 5, "tma"),
    ("m16", 4096, 12288): (64, 256, 4, 5, "tma"),
    ("m16", 32000, 4096): (64, 128, 4, 6, True),
    ("m16", 4096, 8192): (64, 256, 4, 5, "tma"),
}

TensorDescriptor = None
if TRITON:
    import triton
    import triton.language as tl
    from draftkernels.runtime import pdl_enter

    try:  # host-side tensor descriptors (the "tma" variant); Triton >= 3.4
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover
        pass

    @triton.jit
    def _finish(
        acc,
        rm,
        rn,
        M,
        N,
        b_ptr,
        y_ptr,
        sy_m,
        HAS_BIAS: tl.constexpr,
        r_ptr=None,
        sr_m=0,
        RESID: tl.constexpr = False,
    ):
        """Store `acc` `[BLOCK_M, BLOCK_N]` (fp32, plus the bias) as rows `rm`, columns `rn`
        of y; under `RESID` plus the residual's rows (the GEMM's output rounded to y's dtype
        first, the sum in fp32 rounded once: the unfused `residual + linear(x)`)."""
        ok = (rm < M)[:, None] & (rn < N)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if RESID:
            res = tl.load(r_ptr + rm[:, None] * sr_m + rn[None, :], mask=ok, other=0.0)
            acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)
        tl.store(y_ptr + rm[:, None] * sy_m + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _mma(w, xt, acc, SWAP: tl.constexpr, IEEE: tl.constexpr):
        """acc + the product of a weight tile `[BLOCK_N, BLOCK_K]` and an x tile `[BLOCK_M,
        BLOCK_K]`: `[BLOCK_N, BLOCK_M]` swapped (the weight as the MMA's M side), else
        `[BLOCK_M, BLOCK_N]`."""
        if SWAP:
            a_op, b_op = w, tl.trans(xt)
        else:
            a_op, b_op = xt, tl.trans(w)
        if IEEE:
            return tl.dot(a_op, b_op, acc, input_precision="ieee")
        return tl.dot(a_op, b_op, acc)

    @triton.jit
    def _finish2(
        acc,
        accu,
        rm,
        rn,
        M,
        N,
        b_ptr,
        y_ptr,
        sy_m,
        HAS_BIAS: tl.constexpr,
        SWIGLU: tl.constexpr,
        r_ptr,
        sr_m,
        RESID: tl.constexpr,
    ):
        """`_finish`, or under `SWIGLU` `silu(gate) * up` of the gate (`acc`) and up (`accu`)
        outputs, each rounded to y's dtype first (the unfused GEMM's output) and the
        product in fp32, rounded once (the fused elementwise kernel inductor makes)."""
        if not SWIGLU:
            _finish(acc, rm, rn, M, N, b_ptr, y_ptr, sy_m, HAS_BIAS, r_ptr, sr_m, RESID)
        else:
            n_ok = rn < N
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                accu += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            g = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            u = accu.to(y_ptr.dtype.element_ty).to(tl.float32)
            y = g * tl.sigmoid(g) * u
            _finish(y, rm, rn, M, N, b_ptr, y_ptr, sy_m, False)

    @triton.jit
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        sx_m,
        sw_n,
        sy_m,
        eps,  # the RMSNorm epsilon (NORM)
        r_ptr,  # [M, N] the residual (RESID)
        sr_m,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks in the loop
        IEEE: tl.constexpr,
        SWAP: tl.constexpr,  # MMA path: y^T = W x^T (the weight tile as the MMA's M side)
        SWIGLU: tl.constexpr = False,  # W is [2N, K] (gate rows, then up): y = silu(g) * u
        PDL: tl.constexpr = False,  # programmatic dependent launch (`runtime.pdl_enter`)
        NORM: tl.constexpr = False,  # y scaled by each row's 1 / rms(x) (`skinny_rms_gemm`)
        RESID: tl.constexpr = False,  # the residual added to y (`skinny_gemm_add`)
    ):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk0 = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        up = N * sw_n  # the up row of output column n is weight row N + n
        if BLOCK_M == 1:
            acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            acc2u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            ssv = tl.zeros((BLOCK_K,), dtype=tl.float32)  # NORM: x's sum of squares
            if PDL:
                # The weights are no earlier kernel's output: the first weight tile is read
                # before waiting for the kernels before this one, x after; the loop then
                # starts at the second tile.
                w_ptrs = w_ptr + rn[:, None] * sw_n + rk0[None, :]
                if EVEN:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=n_ok[:, None] & (rk0 < K)[None, :], other=0.0)
                pdl_enter(PDL)
                if EVEN:
                    xv = tl.load(x_ptr + rk0).to(tl.float32)
                else:
                    xv = tl.load(x_ptr + rk0, mask=rk0 < K, other=0.0).to(tl.float32)
                if NORM:
                    ssv += xv * xv
                acc2 += w.to(tl.float32) * xv[None, :]
            for k0 in range(BLOCK_K if PDL else 0, K, BLOCK_K):
                rk = k0 + rk0
                w_ptrs = w_ptr + rn[:, None] * sw_n + rk[None, :]
                if EVEN:
                    w = tl.load(w_ptrs)
                    xv = tl.load(x_ptr + rk).to(tl.float32)
                    if SWIGLU:
                        wu = tl.load(w_ptrs + up)
                else:
                    k_ok = rk < K
                    w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    xv = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
                    if SWIGLU:
                        wu = tl.load(w_ptrs + up, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if NORM:
                    ssv += xv * xv
                acc2 += w.to(tl.float32) * xv[None, :]
                if SWIGLU:
                    acc2u += wu.to(tl.float32) * xv[None, :]
            yg = tl.sum(acc2, 1)[None, :]  # [1, BLOCK_N]
            yu = tl.sum(acc2u, 1)[None, :]
            if NORM:
                rs = tl.rsqrt(tl.sum(ssv, 0) / K + eps)
                yg *= rs
                yu *= rs
            rm = tl.arange(0, 1)
            _finish2(yg, yu, rm, rn, 1, N, b_ptr, y_ptr, sy_m, HAS_BIAS, SWIGLU, r_ptr, sr_m, RESID)
        else:
            pdl_enter(PDL)
            rm = tl.arange(0, BLOCK_M)
            m_ok = rm < M
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)  # NORM: each row's sum of squares
            if SWAP:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                accu = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                accu = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + rk0
                x_ptrs = x_ptr + rm[:, None] * sx_m + rk[None, :]
                w_ptrs = w_ptr + rn[:, None] * sw_n + rk[None, :]
                if EVEN:
                    xt = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                    w = tl.load(w_ptrs)
                    if SWIGLU:
                        wu = tl.load(w_ptrs + up)
                else:
                    k_ok = rk < K
                    xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                    w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    if SWIGLU:
                        wu = tl.load(w_ptrs + up, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if NORM:
                    # the rows' sums of squares from the tile the MMA reads as it is (scaling
                    # the operand in registers here cost 16 us of a 20 us q/k/v GEMM at 8 rows
                    # on an H100: the operand's trip through registers stalls the pipeline)
                    xf = xt.to(tl.float32)
                    ss += tl.sum(xf * xf, 1)
                acc = _mma(w, xt, acc, SWAP, IEEE)
                if SWIGLU:
                    accu = _mma(wu, xt, accu, SWAP, IEEE)
            if SWAP:
                acc = tl.trans(acc)
                accu = tl.trans(accu)
            if NORM:
                rs = tl.rsqrt(ss / K + eps)[:, None]
                acc *= rs
                accu *= rs
            _finish2(
                acc, accu, rm, rn, M, N, b_ptr, y_ptr, sy_m, HAS_BIAS, SWIGLU, r_ptr, sr_m, RESID
            )


if TRITON:

    @triton.jit
    def _skinny_tma_kernel(
        w_desc,  # [N, K] weight, blocks [BLOCK_N, BLOCK_K]
        x_desc,  # [M, K] input, blocks [BLOCK_M, BLOCK_K] (rows past M read as zeros)
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        sy_m,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
        PDL: tl.constexpr = False,
        r_ptr=None,  # [M, N] the residual (RESID)
        sr_m=0,
        RESID: tl.constexpr = False,
    ):
        """The swapped MMA path with tensor-memory-accelerator loads (variant "tma"): bulk
        copies of the weight and x tiles into shared memory, out-of-range rows and columns
        zero-filled by the copy engine, so no masks in the loop (no `NORM` mode: a
        normalised input takes the swapped pointer path)."""
        pdl_enter(PDL)
        off_n = tl.program_id(0) * BLOCK_N
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = w_desc.load([off_n, k0])
            xt = x_desc.load([0, k0])
            if IEEE:
                acc = tl.dot(w, tl.trans(xt), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(xt), acc)
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        rn = off_n + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        _finish(acc, rm, rn, M, N, b_ptr, y_ptr, sy_m, HAS_BIAS, r_ptr, sr_m, RESID)


def skinny_gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Pure-torch reference (module docstring): fp32 maths, x's dtype out."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def skinny_swiglu_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Pure-torch reference of `skinny_swiglu`: the fused gate/up GEMM rounded to x's dtype,
    then `silu(gate) * up` in fp32, rounded once."""
    gate, up = skinny_gemm_ref(x, weight, bias).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as the models compute it (`draftinfer.models.layers.RMSNorm`, HF Llama/Qwen): fp32
    statistics, the normalised row rounded to x's dtype, then times the weight (none: a
    weight folded into the next GEMM's)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) if weight is None else weight * xf.to(x.dtype)


def skinny_rms_gemm_ref(
    x: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Pure-torch reference of `skinny_rms_gemm`, the kernel's maths in fp32: `x @ weight.T`
    scaled by each row's `1 / rms(x)`, then the bias (the normalised row is never rounded;
    `rms_norm_ref` then a GEMM rounds it)."""
    xf = x.float()
    y = (xf @ weight.float().T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def skinny_rms_swiglu_ref(
    x: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Pure-torch reference of `skinny_rms_swiglu`: `skinny_rms_gemm_ref` over the fused
    gate/up weight, then `silu(gate) * up` in fp32, rounded once."""
    gate, up = skinny_rms_gemm_ref(x, eps, weight, bias).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def skinny_gemm_add_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """Pure-torch reference of `skinny_gemm_add`: the GEMM rounded to x's dtype, plus the
    residual in fp32, rounded once (the unfused `residual + linear(x)`)."""
    return (skinny_gemm_ref(x, weight, bias).float() + residual.float()).to(x.dtype)


def m_class(M: int) -> int | str:
    """The config class of `M` input rows: 1 (the multiply-accumulate path) or "m16" (MMA)."""
    return 1 if M == 1 else "m16"


def config(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for `M` rows of a `[N, K]` weight."""
    cls = m_class(M)
    return TABLE.get((cls, N, K), DEFAULT[cls])


def _shapes_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        1 <= rows <= MAX_ROWS
        and weight.dim() == 2
        and weight.dtype == x.dtype
        and x.stride(-1) == 1 == weight.stride(-1)
        and x.shape[-1] == weight.shape[1]
    )


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes the kernel for `F.linear(x, weight)`: one row, or at most
    `MAX_ROWS` rows (all leading dims together) of a weight with at least `MIN_COLS_MMA`
    output columns; a 16-bit float dtype shared by x and the weight, unit-stride last dims, a
    2-D weight. Shapes and dtypes only, so `torch.compile` traces it."""
    one_row = x.numel() == x.shape[-1]
    return (
        x.dtype in DTYPES and (one_row or weight.shape[0] >= MIN_COLS_MMA) and _shapes_ok(x, weight)
    )


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_gemm` runs the kernel here: CUDA or the interpreter, the shapes of
    `fits`, and fp32 too (exact-dot tests on the CPU interpreter)."""
    return use_triton(x.device) and x.dtype in (*DTYPES, torch.float32) and _shapes_ok(x, weight)


def tma_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the copy engine can stream these operands (variant "tma"): 16-byte aligned
    bases and row strides, unit-stride rows, and a Triton with host tensor descriptors."""
    if TensorDescriptor is None:
        return False
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(1) == 1
        for t in (x, weight)
    )


def _launch(
    x,
    weight,
    bias,
    cfg: tuple | None = None,
    swiglu: bool = False,
    eps: float | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel: `x @ weight.T + bias`, or under `swiglu` (weight `[2N, K]`, gate rows then
    up rows) `silu(gate) * up` `[M, N]`; `eps`: x's rows RMS-normalised first, with no
    weight (`skinny_rms_gemm_ref`); `residual` `[M, N]`: added to the output."""
    M, K = x.shape
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    block_n, block_k, warps, stages, *opt = cfg or config(M, weight.shape[0], K)
    variant = opt[0] if opt else False
    if swiglu and M > 1:  # two weight tiles (gate, up) a stage: the same shared memory
        block_n = max(64, block_n // 2) if variant else max(16, block_n // 2)
        per_stage = (2 * block_n + 16) * block_k * x.element_size()
        stages = max(1, min(stages, SWIGLU_SMEM // per_stage))
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else weight  # never read without HAS_BIAS
    res, sr_m = (residual, residual.stride(0)) if residual is not None else (weight, 0)
    grid = (triton.cdiv(N, block_n),)
    # The one-row path reads its weights ahead under PDL; its SwiGLU form (two weight rows a
    # program, not the runner's path) does not.
    use_pdl = pdl(x.device) and not (swiglu and M == 1)
    tma = M > 1 and variant == "tma" and not swiglu and eps is None and tma_ok(x, weight)
    if tma:
        _skinny_tma_kernel[grid](
            TensorDescriptor.from_tensor(weight, [block_n, block_k]),
            TensorDescriptor.from_tensor(x, [16, block_k]),
            bias_arg,
            y,
            M,
            N,
            K,
            y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=16,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            IEEE=x.dtype == torch.float32,
            PDL=use_pdl,
            r_ptr=res,
            sr_m=sr_m,
            RESID=residual is not None,
            num_warps=warps,
            num_stages=stages,
            launch_pdl=use_pdl,
        )
        return y
    _skinny_kernel[grid](
        x,
        weight,
        bias_arg,
        y,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        0.0 if eps is None else float(eps),
        res,
        sr_m,
        HAS_BIAS=bias is not None,
        BLOCK_M=1 if M == 1 else 16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN=N % block_n == 0 and K % block_k == 0,
        IEEE=x.dtype == torch.float32,
        SWAP=bool(variant) and M > 1,  # "tma" where the copy engine cannot: swapped
        SWIGLU=swiglu,
        PDL=use_pdl,
        NORM=eps is not None,
        RESID=residual is not None,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=use_pdl,
    )
    return y


def _check(x, weight, bias) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x must be [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share a dtype; got {x.dtype}, {weight.dtype}")


@torch.library.custom_op("draftkernels::skinny_gemm", mutates_args=())
def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """See the module docstring: the kernel where `supports` says so, else the reference."""
    _check(x, weight, bias)
    if not supports(x, weight):
        return skinny_gemm_ref(x, weight, bias)
    return _launch(x, weight, bias)


@skinny_gemm.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with the kernel for skinny inputs on CUDA (`fits`), `F.linear` elsewhere."""
    if not (x.is_cuda and TRITON and fits(x, weight)):
        return F.linear(x, weight, bias)
    y = skinny_gemm(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("draftkernels::skinny_swiglu", mutates_args=())
def skinny_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU's product from a fused gate/up weight `[2N, K]` (gate rows, then up rows) in one
    launch: each program streams the gate and the up rows of its output columns, so the
    `silu(gate) * up` pass is the epilogue (`skinny_swiglu_ref`) -> `[M, N]`. The kernel where
    `supports` says so, else the reference."""
    _check(x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(f"a fused gate/up weight has an even row count, got {weight.shape[0]}")
    if not supports(x, weight):
        return skinny_swiglu_ref(x, weight, bias)
    return _launch(x, weight, bias, swiglu=True)


@skinny_swiglu.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def swiglu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, epilogue: bool = True
) -> torch.Tensor:
    """`silu(gate) * up` of `F.linear(x, weight, bias)` split in halves: one kernel for 2..16
    rows on CUDA (`fits`, `epilogue`); the GEMM (`linear`) then the product elsewhere, at one
    row too (the one-row path streaming two rows a program took a Llama-3.1-8B step from 5.63
    to 5.98 ms on an H100, `docs/results.md`), the same bits as SwiGLU's modules off the
    kernel."""
    one_row = x.numel() == x.shape[-1]
    if not (epilogue and x.is_cuda and TRITON and fits(x, weight)) or one_row:
        gate, up = linear(x, weight, bias).chunk(2, dim=-1)
        return F.silu(gate) * up
    y = skinny_swiglu(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0] // 2)


# ---- a decoder layer's RMSNorm inside the next GEMM, its residual add as the epilogue --------
# The norm's weight is folded into the weight of the GEMM that reads its output (the caller
# does it once: `draftinfer.models.transforms.NormFusedDecoderLayer`), so the kernel reads x
# as the MMA reads it, sums its squares on the way and scales its outputs by each row's
# `1 / rms` at the end.


@torch.library.custom_op("draftkernels::skinny_rms_gemm", mutates_args=())
def skinny_rms_gemm(
    x: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(rms_norm_ref(x, None, eps), weight, bias)` in one launch: each program
    sums the squares of the x tiles its MMA reads and scales its outputs by each row's
    `1 / rms` after the loop (`skinny_rms_gemm_ref`; no separate norm kernel). The kernel
    where `supports` says so, else the reference."""
    _check(x, weight, bias)
    if not supports(x, weight):
        return skinny_rms_gemm_ref(x, eps, weight, bias)
    return _launch(x, weight, bias, eps=eps)


@skinny_rms_gemm.register_fake
def _(x, eps, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("draftkernels::skinny_rms_swiglu", mutates_args=())
def skinny_rms_swiglu(
    x: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`skinny_swiglu` of `rms_norm_ref(x, None, eps)` in one launch
    (`skinny_rms_swiglu_ref`)."""
    _check(x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(f"a fused gate/up weight has an even row count, got {weight.shape[0]}")
    if not supports(x, weight):
        return skinny_rms_swiglu_ref(x, eps, weight, bias)
    return _launch(x, weight, bias, swiglu=True, eps=eps)


@skinny_rms_swiglu.register_fake
def _(x, eps, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@torch.library.custom_op("draftkernels::skinny_gemm_add", mutates_args=())
def skinny_gemm_add(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """`residual + F.linear(x, weight, bias)` in one launch, the add as the epilogue
    (`skinny_gemm_add_ref`: the same bits as the GEMM then the add). The kernel where
    `supports` says so, else the reference."""
    _check(x, weight, bias)
    if tuple(residual.shape) != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype:
        raise ValueError(
            f"the residual must be [{x.shape[0]}, {weight.shape[0]}] in {x.dtype}; got "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    if residual.stride(-1) != 1:
        raise ValueError("the residual's rows must be contiguous")
    if not supports(x, weight):
        return skinny_gemm_add_ref(x, weight, bias, residual)
    return _launch(x, weight, bias, residual=residual)


@skinny_gemm_add.register_fake
def _(x, weight, bias, residual):
    return x.new_empty(x.shape[0], weight.shape[0])


def _takes_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_linear`, `rms_swiglu` and `linear_add` take the fused launch: where
    `linear` takes the kernel, at two rows or more. At one row each program of the one-row
    path streams one or two weight rows, and the norm's second reduction in every program
    cost more than the norm kernel it saved (Llama-3.1-8B's q/k/v, norm kernel + GEMM 20.1
    us, in the GEMM 22.3; gate/up 78.3 and 90.5, an H100, `docs/results.md`): there the
    three run unfused."""
    return x.is_cuda and TRITON and fits(x, weight) and x.numel() != x.shape[-1]


def rms_linear(
    x: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear(rms_norm_ref(x, None, eps), weight, bias)` (the norm's weight folded into
    `weight`): one launch for 2..16 rows on CUDA (`_takes_kernel`, `skinny_rms_gemm`), else
    the norm then `linear`."""
    if not _takes_kernel(x, weight):
        return linear(rms_norm_ref(x, None, eps), weight, bias)
    y = skinny_rms_gemm(x.reshape(-1, x.shape[-1]), eps, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def rms_swiglu(
    x: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`swiglu(rms_norm_ref(x, None, eps), weight, bias)` (the norm's weight folded into
    `weight`): one launch for 2..16 rows on CUDA (`_takes_kernel`, `skinny_rms_swiglu`),
    else the norm then `swiglu`."""
    if not _takes_kernel(x, weight):
        return swiglu(rms_norm_ref(x, None, eps), weight, bias)
    y = skinny_rms_swiglu(x.reshape(-1, x.shape[-1]), eps, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0] // 2)


def linear_add(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """`residual + linear(x, weight, bias)`: one launch for 2..16 rows on CUDA
    (`_takes_kernel`, `skinny_gemm_add`), else `linear` then the add (the same bits either
    way)."""
    if not _takes_kernel(x, weight):
        return residual + linear(x, weight, bias)
    y = skinny_gemm_add(
        x.reshape(-1, x.shape[-1]), weight, bias, residual.reshape(-1, weight.shape[0])
    )
    return y.view(*x.shape[:-1], weight.shape[0])
