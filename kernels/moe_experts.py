"""The routed experts of an MoE layer for a few tokens (decode, verify, drafting), in two
weight-streaming launches:

    moe_experts(x [N, H], weights [N, k], experts [N, k] int64, gate_up [E, *, *],
                gate_up_bias [E, 2I] | None, down [E, *, *], down_bias [E, H] | None,
                x_at_w, interleaved, act, alpha, limit) -> [N, k, H] (x's dtype)

returns each route row's weighted expert output; the caller sums over `k` (`.sum(1)`: in a
compiled step inductor fuses that sum into the residual add after the block).

`gate_up` and `down` are the stacked expert parameters as Hugging Face stores them: `x_at_w`
(gpt-oss) `[E, H, 2I]` and `[E, I, H]`, `out = x @ W`; else (Qwen3-MoE) `[E, 2I, H]` and
`[E, H, I]`, `out = x @ W.T`. The gate/up columns are `interleaved` (gate at even, up at odd:
gpt-oss) or halves (gate first: Qwen3-MoE). `act` 0 is `silu(gate) * up`, 1 gpt-oss's clamped
SwiGLU `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = min(gate, limit)`.

Why a kernel: a decode step over an MoE target reads, per layer, its attention and the `k`
routed experts; at gpt-oss-20b's sizes the experts are 4.8 of the 7.2 GB a step must read, and
compiled gather-then-einsum (gpt-fast's `ConditionalFeedForward`, the runner's one-token path
before this) streamed them well under the copy bandwidth (docs/results.md, "MoE targets").

How: the `S = N * k` rows (token, expert) are sorted by expert on the device (`torch.sort`, no
host sync; one token's `k` experts are distinct, so it skips the sort). A program owns one
slot of that order and one tile of output columns; the *lead* slot of each expert (the first
of its run) streams that expert's weight tile once over the
reduction dimension for all of the expert's rows (at most `N`, one per token: `BLOCK_M >= N`),
the others run no loop and store nothing. So a verify pass of K + 1 tokens reads each expert
it touches once, however many of its tokens route there.

- launch 1 (`GLU`): `a[slot] = act(x[token] @ W1[e] + b1[e])`, `[S, I]` in sorted order; the
  gate and up columns of an output tile are the two halves of one accumulator (interleaved:
  one contiguous `[*, 2 * BLOCK_N]` weight tile, split at the end);
- launch 2: `y[row] = (a[slot] @ W2[e] + b2[e]) * weight[row]`, `[S, H]` back in route order,
  returned as `[N, k, H]` (the caller's sum over `k`: a fixed order, no atomics).

Rounding follows the unfused computation: each product is accumulated in fp32 and rounded to
x's dtype (plus its bias, rounded), the activation in fp32 rounded once, the route weight's
product rounded once. One row (`BLOCK_M == 1`) multiplies and accumulates a `[BLOCK_K,
BLOCK_N]` fp32 tile summed at the end; more rows take `tl.dot` with 16 padded rows.

The config (`BLOCK_N`, `BLOCK_K`, warps, stages) per launch comes from `config(...)`, a table
measured by `python -m draftbench.moe_experts --sweep` (a default elsewhere); no autotuning
at run time, so a CUDA graph captures one fixed kernel.

`moe_experts_ref` is the pure-torch reference with the same signature (each row's expert
weights indexed, fp32 products rounded as above; the CPU path and the test oracle besides the
dense reference in `draftinfer.models.moe`). `moe_experts` is the custom op
`draftkernels::moe_experts`: `torch.compile` keeps it as one opaque call (CUDA graphs too).
"""

from __future__ import annotations

import torch
from draftkernels.runtime import pdl, triton_available, use_triton

TRITON = triton_available()
# One token through the MMA path with the several-token configs (True), so a token's output is
# the same bits whether it runs alone (a plain decode step) or among the K + 1 of a verify pass
# (the MMA's per-row sums do not depend on the other rows); False: one token through the
# multiply-accumulate path (`rows_class`). Why: a random-weight gpt-oss-20b amplifies one
# rounding difference per layer into logit differences of up to 1.7 over 24 layers, and the
# runner's lossless check compares the two (docs/results.md, "MoE targets").
ROW_INVARIANT = True
# Tokens one call takes (a verify of K + 1 <= 16 slots at batch 1); the caller groups above.
MAX_TOKENS = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# (BLOCK_N, BLOCK_K, num_warps, num_stages) keyed ("glu" | "down", rows class, N_out, K):
# rows class 1 (a decode step through multiply-accumulate), "m1" (a decode step through the
# MMA path, `ROW_INVARIANT`) or "m16" (several tokens). "m1" has configs of its own: one token
# has a quarter of the programs a verify pass has, so it wants other tiles, and an MMA's
# per-row sums run over the reduction in the same order whatever the tile (a GPU test pins it
# at the measured shapes: one token alone and among nine, bit for bit). Measured by
# `python -m draftbench.moe_experts --sweep` (docs/results.md); DEFAULT elsewhere.
DEFAULT = {
    ("glu", 1): (32, 128, 4, 3),
    ("down", 1): (64, 128, 4, 3),
    ("glu", "m1"): (32, 64, 4, 3),
    ("down", "m1"): (64, 64, 4, 3),
    ("glu", "m16"): (32, 64, 4, 3),
    ("down", "m16"): (64, 64, 4, 3),
}
# H200, 2026-11-29 (docs/results.md, "MoE targets"): gpt-oss-20b (I = H = 2880) and
# Qwen3-30B-A3B (H = 2048, I = 768) at one token and at nine (a verify of K = 8); "m1" from
# `--sweep --tokens 1` (docs/results.md, "One token's own configs").
TABLE: dict[tuple, tuple[int, int, int, int]] = {
    ("glu", 1, 2880, 2880): (32, 128, 4, 3),
    ("down", 1, 2880, 2880): (32, 256, 4, 3),
    ("glu", "m1", 2880, 2880): (32, 128, 4, 3),
    ("down", "m1", 2880, 2880): (64, 128, 4, 4),
    ("glu", "m1", 768, 2048): (64, 128, 4, 4),
    ("down", "m1", 2048, 768): (64, 128, 4, 3),
    ("glu", "m16", 2880, 2880): (64, 128, 4, 3),
    ("down", "m16", 2880, 2880): (64, 32, 4, 3),
    ("glu", 1, 768, 2048): (16, 256, 4, 3),
    ("down", 1, 2048, 768): (32, 256, 4, 3),
    ("glu", "m16", 768, 2048): (32, 128, 4, 3),
    ("down", "m16", 2048, 768): (64, 128, 4, 3),
}

if TRITON:
    import triton
    import triton.language as tl
    from draftkernels.runtime import pdl_enter

    @triton.jit
    def _act(g, u, ACT: tl.constexpr, alpha, limit):
        """The expert activation on fp32 gate and up outputs (module docstring)."""
        if ACT == 0:
            return g * tl.sigmoid(g) * u
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return (u + 1.0) * (g * tl.sigmoid(g * alpha))

    @triton.jit
    def _moe_kernel(
        in_ptr,  # GLU: x [N, K]; else a [S, K] in sorted order
        w_ptr,  # [E, ...] the stacked weights, strides below
        b_ptr,  # [E, *] bias (HAS_BIAS)
        out_ptr,  # GLU: a [S, N_out] in sorted order; else y [S, N_out] in route order
        sorted_ptr,  # [S] int64 the experts of the rows, sorted
        order_ptr,  # [S] int64 the route rows in that order (row = token * TOP_K + j)
        rw_ptr,  # [S] route weights in route order (not GLU)
        S,
        N_out,  # output columns (GLU: I, the pair count)
        K,  # reduction length
        s_in,  # row stride of in
        s_we,  # weight strides: expert, reduction index, output column
        s_wk,
        s_wn,
        s_be,  # bias expert stride
        s_out,
        alpha,
        limit,
        TOP_K: tl.constexpr,
        GLU: tl.constexpr,  # 0: plain; 1: interleaved gate/up columns; 2: halves
        ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ACC_N: tl.constexpr,  # accumulator columns: 2 * BLOCK_N interleaved, else BLOCK_N
        IEEE: tl.constexpr,
        PDL: tl.constexpr,
        SORTED: tl.constexpr,  # rows sorted by expert (several tokens); else one token's rows
    ):
        slot = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N_out
        rk0 = tl.arange(0, BLOCK_K)
        pdl_enter(PDL)
        e = tl.load(sorted_ptr + slot)
        rm = slot + tl.arange(0, BLOCK_M)
        if SORTED:
            prev = tl.load(sorted_ptr + tl.maximum(slot - 1, 0))
            lead = (slot == 0) | (prev != e)
            # the expert's rows: the slots from this one on that carry the same expert (sorted);
            # the lead flag broadcast through int32 (the CPU interpreter's `&` of a bool vector
            # and a bool scalar is an integer vector, which it does not take as a mask)
            m_ok = (rm < S) & (tl.zeros((BLOCK_M,), tl.int32) + lead.to(tl.int32) != 0)
            m_ok = m_ok & (tl.load(sorted_ptr + rm, mask=m_ok, other=-1) == e)
            row = tl.load(order_ptr + rm, mask=m_ok, other=0)
            k_end = tl.where(lead, K, 0)
        else:  # one token: its k experts are distinct, each slot its own lead and only row
            m_ok = rm == slot
            row = rm
            k_end = K
        if GLU:
            in_row = row // TOP_K
        else:
            in_row = rm
        w_base = w_ptr + e * s_we
        # output column c of the accumulator: GLU interleaved 2n (gate) and 2n + 1 (up) side by
        # side in one 2 * BLOCK_N tile; halves: the gate tile n and the up tile N_out + n
        if GLU == 1:
            rc = tl.program_id(1) * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
            c_ok = rc < 2 * N_out
        else:
            rc = rn
            c_ok = n_ok
        if BLOCK_M == 1:
            acc = tl.zeros((BLOCK_K, ACC_N), dtype=tl.float32)
            accu = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, k_end, BLOCK_K):
                rk = k0 + rk0
                k_ok = rk < K
                xv = tl.load(in_ptr + in_row * s_in + rk, mask=k_ok & m_ok, other=0.0)
                xv = xv.to(tl.float32)[:, None]
                w_ptrs = w_base + rk[:, None] * s_wk + rc[None, :] * s_wn
                w_ok = k_ok[:, None] & c_ok[None, :]
                acc += tl.load(w_ptrs, mask=w_ok, other=0.0).to(tl.float32) * xv
                if GLU == 2:
                    wu = tl.load(w_ptrs + N_out * s_wn, mask=w_ok, other=0.0)
                    accu += wu.to(tl.float32) * xv
            acc_r = tl.sum(acc, 0)[None, :]
            accu_r = tl.sum(accu, 0)[None, :]
        else:
            acc_r = tl.zeros((BLOCK_M, ACC_N), dtype=tl.float32)
            accu_r = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, k_end, BLOCK_K):
                rk = k0 + rk0
                k_ok = rk < K
                xt = tl.load(
                    in_ptr + in_row[:, None] * s_in + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                w_ptrs = w_base + rk[:, None] * s_wk + rc[None, :] * s_wn
                w_ok = k_ok[:, None] & c_ok[None, :]
                w = tl.load(w_ptrs, mask=w_ok, other=0.0)
                if IEEE:
                    acc_r = tl.dot(xt, w, acc_r, input_precision="ieee")
                else:
                    acc_r = tl.dot(xt, w, acc_r)
                if GLU == 2:
                    wu = tl.load(w_ptrs + N_out * s_wn, mask=w_ok, other=0.0)
                    if IEEE:
                        accu_r = tl.dot(xt, wu, accu_r, input_precision="ieee")
                    else:
                        accu_r = tl.dot(xt, wu, accu_r)
        dt = out_ptr.dtype.element_ty
        if GLU == 1:
            acc_r = tl.reshape(acc_r, (acc_r.shape[0], BLOCK_N, 2))
            g, u = tl.split(acc_r)
        else:
            g = acc_r
            u = accu_r
        # each product rounded, its bias added and rounded: the unfused `x @ W + b`
        g = g.to(dt).to(tl.float32)
        if HAS_BIAS:
            if GLU == 1:
                bg = tl.load(b_ptr + e * s_be + 2 * rn, mask=n_ok, other=0.0)
            else:
                bg = tl.load(b_ptr + e * s_be + rn, mask=n_ok, other=0.0)
            g = (g + bg.to(tl.float32)[None, :]).to(dt).to(tl.float32)
        if GLU:
            u = u.to(dt).to(tl.float32)
            if HAS_BIAS:
                if GLU == 1:
                    bu = tl.load(b_ptr + e * s_be + 2 * rn + 1, mask=n_ok, other=0.0)
                else:
                    bu = tl.load(b_ptr + e * s_be + N_out + rn, mask=n_ok, other=0.0)
                u = (u + bu.to(tl.float32)[None, :]).to(dt).to(tl.float32)
        ok = m_ok[:, None] & n_ok[None, :]
        if GLU:
            y = _act(g, u, ACT, alpha, limit)
            tl.store(out_ptr + rm[:, None] * s_out + rn[None, :], y.to(dt), mask=ok)
        else:
            rw = tl.load(rw_ptr + row, mask=m_ok, other=0.0).to(tl.float32)
            y = g * rw[:, None]
            tl.store(out_ptr + row[:, None] * s_out + rn[None, :], y.to(dt), mask=ok)


def _act_ref(gate: torch.Tensor, up: torch.Tensor, act: int, alpha: float, limit: float):
    if act == 0:
        return gate * torch.sigmoid(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _mats(gate_up: torch.Tensor, down: torch.Tensor, x_at_w: bool):
    """(w1 `[E, H, 2I]`, w2 `[E, I, H]`): views in the `x @ W` layout."""
    if x_at_w:
        return gate_up, down
    return gate_up.transpose(-2, -1), down.transpose(-2, -1)


def moe_experts_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down: torch.Tensor,
    down_bias: torch.Tensor | None,
    x_at_w: bool,
    interleaved: bool,
    act: int,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The kernel's computation in torch (module docstring), its rounding included: per route
    row, the expert's weights indexed, fp32 products rounded to x's dtype. -> `[N, k, H]`."""
    N, k = experts.shape
    dt = x.dtype
    w1, w2 = _mats(gate_up, down, x_at_w)
    flat = experts.reshape(-1)
    rows = x.repeat_interleave(k, dim=0).float()  # [S, H]
    h = torch.bmm(rows[:, None], w1[flat].float())[:, 0].to(dt)  # [S, 2I]
    if gate_up_bias is not None:
        h = (h.float() + gate_up_bias[flat].float()).to(dt)
    if interleaved:
        gate, up = h[:, ::2], h[:, 1::2]
    else:
        gate, up = h.chunk(2, dim=-1)
    a = _act_ref(gate.float(), up.float(), act, alpha, limit).to(dt)
    y = torch.bmm(a.float()[:, None], w2[flat].float())[:, 0].to(dt)  # [S, H]
    if down_bias is not None:
        y = (y.float() + down_bias[flat].float()).to(dt)
    y = (y.float() * weights.reshape(-1, 1).float()).to(dt)
    return y.view(N, k, -1)


def rows_class(n: int) -> int | str:
    """The config class of `n` tokens: "m16" (the MMA path) for several; for one, "m1" (the
    MMA path with one-token configs) under `ROW_INVARIANT`, else 1 (multiply-accumulate)."""
    if n > 1:
        return "m16"
    return "m1" if ROW_INVARIANT else 1


def config(stage: str, n_tokens: int, n_out: int, k: int) -> tuple[int, int, int, int]:
    """The launch config of `stage` ("glu" or "down") for `n_tokens` tokens, `n_out` output
    columns (GLU: the pairs) over a reduction of `k`: `TABLE`, else `DEFAULT`."""
    cls = rows_class(n_tokens)
    return TABLE.get((stage, cls, n_out, k), DEFAULT[(stage, cls)])


def fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the kernel takes these operands, from shapes and dtypes only (a compiled
    caller decides at trace time, no graph break): one float dtype for all, at most
    `MAX_TOKENS` tokens."""
    return (
        x.dtype in DTYPES
        and x.dtype == gate_up.dtype == down.dtype
        and 1 <= x.shape[0] <= MAX_TOKENS
    )


def supports(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `moe_experts` runs the kernel here: Triton on x's device (CUDA, or the CPU
    interpreter) and `fits`."""
    return use_triton(x.device) and fits(x, gate_up, down)


def _launch(
    x, route_w, experts, gate_up, b1, down, b2, x_at_w, interleaved, act, alpha, limit, cfgs=None
):
    N, k = experts.shape
    H = x.shape[1]
    w1, w2 = _mats(gate_up, down, x_at_w)  # strided views, no copies
    E, _, two_i = w1.shape
    inter = two_i // 2
    S = N * k
    if N == 1:  # one token's k experts are distinct: no sort, every slot leads
        sorted_experts = order = experts.reshape(-1)
    else:
        sorted_experts, order = torch.sort(experts.reshape(-1), stable=True)
    block_m = 1 if rows_class(N) == 1 else 16
    ieee = x.dtype == torch.float32
    use_pdl = pdl(x.device)
    x = x.contiguous()
    a = torch.empty(S, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(S, H, dtype=x.dtype, device=x.device)
    rw = route_w.reshape(-1).contiguous()
    glu_cfg, down_cfg = cfgs or (config("glu", N, inter, H), config("down", N, H, inter))
    for stage, cfg in (("glu", glu_cfg), ("down", down_cfg)):
        bn, bk, warps, stages = cfg
        glu = stage == "glu"
        w, b = (w1, b1) if glu else (w2, b2)
        n_out, kk = (inter, H) if glu else (H, inter)
        src, dst = (x, a) if glu else (a, y)
        _moe_kernel[(S, triton.cdiv(n_out, bn))](
            src,
            w,
            b if b is not None else w,
            dst,
            sorted_experts,
            order,
            rw,
            S,
            n_out,
            kk,
            src.stride(0),
            w.stride(0),
            w.stride(1),
            w.stride(2),
            b.stride(0) if b is not None else 0,
            dst.stride(0),
            float(alpha),
            float(limit),
            TOP_K=k,
            GLU=(1 if interleaved else 2) if glu else 0,
            ACT=act,
            HAS_BIAS=b is not None,
            BLOCK_M=block_m,
            BLOCK_N=bn,
            BLOCK_K=bk,
            ACC_N=2 * bn if (glu and interleaved) else bn,
            IEEE=ieee,
            PDL=use_pdl,
            SORTED=N > 1,
            num_warps=warps,
            num_stages=stages,
            launch_pdl=use_pdl,
        )
    return y.view(N, k, H)


def _check(x, weights, experts, gate_up, down, x_at_w) -> None:
    if x.dim() != 2 or experts.dim() != 2 or weights.shape != experts.shape:
        raise ValueError(
            f"x must be [N, H], weights and experts [N, k]; got {tuple(x.shape)}, "
            f"{tuple(weights.shape)}, {tuple(experts.shape)}"
        )
    w1, w2 = _mats(gate_up, down, x_at_w)
    if w1.shape[1] != x.shape[1] or w2.shape[2] != x.shape[1] or w1.shape[2] != 2 * w2.shape[1]:
        raise ValueError(
            f"experts do not match x [N, {x.shape[1]}]: gate_up {tuple(gate_up.shape)}, down "
            f"{tuple(down.shape)} (x_at_w={x_at_w})"
        )


@torch.library.custom_op("draftkernels::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down: torch.Tensor,
    down_bias: torch.Tensor | None,
    x_at_w: bool,
    interleaved: bool,
    act: int,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """See the module docstring: the kernel where `supports` says so, else the reference."""
    _check(x, weights, experts, gate_up, down, x_at_w)
    args = (x, weights, experts, gate_up, gate_up_bias, down, down_bias, x_at_w, interleaved)
    if not supports(x, gate_up, down):
        return moe_experts_ref(*args, act, alpha, limit)
    return _launch(*args, act, alpha, limit)


@moe_experts.register_fake
def _(
    x,
    weights,
    experts,
    gate_up,
    gate_up_bias,
    down,
    down_bias,
    x_at_w,
    interleaved,
    act,
    alpha,
    limit,
):
    return x.new_empty(x.shape[0], experts.shape[1], x.shape[1])
