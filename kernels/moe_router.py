"""An MoE router for a few tokens in one launch: the router's GEMV, the top-k and the routing
weights, one program per token.

    moe_route(x [N, H], weight [E, H], bias [E] | None, top_k, rule, norm)
        -> (weights [N, k] in x's dtype, experts [N, k] int64)

`rule` 0 is gpt-oss's (`TopKSoftmaxRouter`: the top k of the logits, a softmax over those k),
1 Qwen3-MoE's (`SoftmaxTopKRouter`: a softmax over all experts in fp32, the top k, divided by
their sum when `norm`). Rounding as the unfused torch: the logits are `F.linear`'s (fp32 sums,
the bias added in fp32, rounded once to x's dtype); gpt-oss's softmax over the k in fp32 from
those rounded logits, rounded once; Qwen3-MoE's softmax in fp32 over the rounded logits. Ties
go to the lower expert id; the k experts come out in descending order of their score.

Why a kernel: at gpt-oss-20b's sizes on an H200 the unfused router took about 15 us a layer
in a one-token step (a cuBLAS GEMV and its split-K reduce, `topk`'s two kernels, the softmax:
docs/results.md, "MoE targets"), 0.36 of the step's 3.1 ms over 24 layers, for 184 KB of
weights a layer. Each program reads its token and the whole `[E, H]` weight in `[BLOCK_E,
BLOCK_H]` tiles (E <= `MAX_EXPERTS` experts in one tile row), sums in fp32, and takes the top
k by k rounds of max-and-mask.

`moe_route_ref` is the pure-torch reference with the same signature (the routers' own
formulas; CPU path, test oracle); `moe_route` is the custom op `draftkernels::moe_route`.
`fits` checks shapes and dtypes only, for compiled callers.
"""

from __future__ import annotations

import torch
from draftkernels.runtime import pdl, triton_available, use_triton

TRITON = triton_available()
MAX_EXPERTS = 256
MAX_TOKENS = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_H = 64
NUM_WARPS = 8

if TRITON:
    import triton
    import triton.language as tl
    from draftkernels.runtime import pdl_enter

    @triton.jit
    def _router_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        wout_ptr,  # [N, TOP_K] x's dtype
        eout_ptr,  # [N, TOP_K] int64
        H,
        E,
        s_x,
        s_w,
        TOP_K: tl.constexpr,
        RULE: tl.constexpr,  # 0: top-k then softmax over the k; 1: softmax then top-k
        NORM: tl.constexpr,  # RULE 1: the k weights divided by their sum
        HAS_BIAS: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        n = tl.program_id(0)
        re = tl.arange(0, BLOCK_E)
        e_ok = re < E
        pdl_enter(PDL)
        acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            rh = h0 + tl.arange(0, BLOCK_H)
            h_ok = rh < H
            xv = tl.load(x_ptr + n * s_x + rh, mask=h_ok, other=0.0).to(tl.float32)
            w = tl.load(
                w_ptr + re[:, None] * s_w + rh[None, :],
                mask=e_ok[:, None] & h_ok[None, :],
                other=0.0,
            )
            acc += w.to(tl.float32) * xv[None, :]
        logits = tl.sum(acc, 1)  # [BLOCK_E] fp32
        if HAS_BIAS:
            logits += tl.load(b_ptr + re, mask=e_ok, other=0.0).to(tl.float32)
        dt = wout_ptr.dtype.element_ty
        logits = logits.to(dt).to(tl.float32)  # F.linear's output, rounded once
        vals = tl.where(e_ok, logits, float("-inf"))
        if RULE == 1:  # softmax over every expert, fp32
            p = tl.exp(vals - tl.max(vals, 0))
            vals = tl.where(e_ok, p / tl.sum(p, 0), float("-inf"))
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < TOP_K
        top_v = tl.full((BLOCK_K,), float("-inf"), tl.float32)
        top_i = tl.zeros((BLOCK_K,), tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(vals, 0)
            idx = tl.min(tl.where(vals == best, re, BLOCK_E), 0)  # ties: the lower id
            top_v = tl.where(ks == j, best, top_v)
            top_i = tl.where(ks == j, idx.to(tl.int64), top_i)
            vals = tl.where(re == idx, float("-inf"), vals)
        if RULE == 0:  # softmax over the k
            p = tl.where(k_ok, tl.exp(top_v - tl.max(top_v, 0)), 0.0)
            wk = p / tl.sum(p, 0)
        else:
            wk = tl.where(k_ok, top_v, 0.0)
            if NORM:
                wk = wk / tl.sum(wk, 0)
        tl.store(wout_ptr + n * TOP_K + ks, wk.to(dt), mask=k_ok)
        tl.store(eout_ptr + n * TOP_K + ks, top_i, mask=k_ok)


def moe_route_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    rule: int,
    norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routers' own formulas (`draftinfer.models.moe`), in torch."""
    logits = torch.nn.functional.linear(x, weight, bias)  # [N, E]
    if rule == 0:
        top, experts = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, top_k, dim=-1)
    if norm:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), experts


def fits(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Shapes and dtypes only (a compiled caller decides at trace time): a few tokens, at most
    `MAX_EXPERTS` experts, one float dtype."""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_TOKENS
        and weight.shape[0] <= MAX_EXPERTS
        and 1 <= top_k <= weight.shape[0]
        and x.dtype in DTYPES
        and x.dtype == weight.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def _launch(x, weight, bias, top_k: int, rule: int, norm: bool):
    N, H = x.shape
    E = weight.shape[0]
    wout = torch.empty(N, top_k, dtype=x.dtype, device=x.device)
    eout = torch.empty(N, top_k, dtype=torch.int64, device=x.device)
    use_pdl = pdl(x.device)
    _router_kernel[(N,)](
        x,
        weight,
        bias if bias is not None else weight,
        wout,
        eout,
        H,
        E,
        x.stride(0),
        weight.stride(0),
        TOP_K=top_k,
        RULE=rule,
        NORM=bool(norm),
        HAS_BIAS=bias is not None,
        BLOCK_E=triton.next_power_of_2(E),
        BLOCK_H=BLOCK_H,
        BLOCK_K=triton.next_power_of_2(top_k),
        PDL=use_pdl,
        num_warps=NUM_WARPS,
        launch_pdl=use_pdl,
    )
    return wout, eout


@torch.library.custom_op("draftkernels::moe_route", mutates_args=())
def moe_route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    rule: int,
    norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring: the kernel where Triton runs and `fits`, else the reference."""
    if rule not in (0, 1):
        raise ValueError(f"rule must be 0 (top-k, softmax) or 1 (softmax, top-k), got {rule}")
    if x.shape[-1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(
            f"router shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if not (use_triton(x.device) and fits(x, weight, top_k)):
        return moe_route_ref(x, weight, bias, top_k, rule, norm)
    return _launch(x, weight, bias, top_k, rule, norm)


@moe_route.register_fake
def _(x, weight, bias, top_k, rule, norm):
    n = x.shape[0]
    return x.new_empty(n, top_k), x.new_empty(n, top_k, dtype=torch.int64)
