"""The routed-experts block the MoE target families share (DESIGN 14: one block, one router per
routing rule): a router picks `k` of `E` experts per token with weights, the experts run as
grouped matrix products, and the token's output is the weighted sum of its experts' outputs.

    router = TopKSoftmaxRouter(H, E, k)            # gpt-oss: top-k logits, softmax over the k
    router = SoftmaxTopKRouter(H, E, k, norm=True)  # Qwen3-MoE: softmax over E, top-k, renormalise
    router = GroupedSigmoidRouter(H, E, k, n_group, topk_group, True, 2.5)  # DeepSeek-V3 noaux_tc
    experts = Experts(E, H, I, ClampedSwiGLU(1.702, 7.0), bias=True, x_at_w=True)
    block = MoEBlock(router, experts, router_name="router")   # [B, T, H] -> [B, T, H]
    block = MoEBlock(router, experts, "gate", shared_experts=SwiGLU(H, I_shared))  # + shared

Vocabulary: a *route* of a token is its `k` (expert, weight) pairs, `experts [N, k]` int64 and
`weights [N, k]`; a *row* is one (token, expert) pair, `S = N * k` of them.

Experts are stacked 3-D parameters with Hugging Face's names, in either layout transformers
uses: `x_at_w` (gpt-oss: `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`, `out = x @ W`) or
not (Qwen3-MoE: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, `out = x @ W.T`), optional
biases `gate_up_proj_bias [E, 2I]`, `down_proj_bias [E, H]`. The activation maps the `2I`
gate/up columns to `I`: `SiluGLU` (gate, then up halves) or `ClampedSwiGLU` (gpt-oss:
interleaved columns, clamped).

Four computations with one signature `(x [N, H], weights [N, k], experts [N, k], w1 [E, H,
2I], b1 [E, 2I] | None, w2 [E, I, H], b2 [E, H] | None, act) -> [N, H]` (`w1`/`w2` are views
in the `x @ W` layout whatever the parameters' layout):

- `experts_grouped`: rows sorted by expert, per-expert row counts by `torch.histc` and their
  `cumsum` as the group offsets, two `F.grouped_mm` (each expert's weights read once for all
  its rows: a verify pass of K + 1 tokens reads the union of their experts), biases gathered
  per row, the inverse permutation, the weighted sum over each token's `k` rows;
- `experts_gather`: gpt-fast's `ConditionalFeedForward`: each token's `k` experts' weights
  gathered by index and two einsums (a one-token decode step: no sort, no offsets; compiled,
  the gather fuses into the GEMV and reads exactly `k` experts);
- `experts_reference`: dense, each expert over every token, masked by the route; the test
  oracle and the fallback where none of the others applies;
- `experts_kernel`: the Triton kernel `draftkernels.moe_experts` (CUDA, up to 16 tokens):
  rows sorted by expert on the device, each touched expert's weights streamed once for all
  its rows, the activation and the route weight as the launches' epilogues.

No host-device sync anywhere (no `.item()`, `nonzero`, boolean indexing or data-dependent
shape): every shape follows from `N`, `k`, `E`, so a round with MoE layers stays capturable in
a CUDA graph. `Experts.forward` picks the computation from shapes and dtypes alone:
the kernel where it runs (`kernel_supported`), else `experts_gather` for at most
`GATHER_MAX_TOKENS` tokens over `x @ W`-layout weights, `experts_grouped` where
`grouped_mm_supported` says the device and dtype take `F.grouped_mm`, `experts_reference`
otherwise (`choose_path`).
"""

from __future__ import annotations

from collections.abc import Callable

import draftkernels.moe_experts as moe_kernel
import torch
import torch.nn.functional as F
from torch import nn

from draftinfer.models.decoder import TensorSource

# Whether routers take the top k by `topk_by_rank` (elementwise comparisons and sums, which a
# compiled step fuses into one or two small kernels) rather than `torch.topk` (two aten
# launches a layer on CUDA: a radix select and a bitonic sort, 8.8 us a layer at gpt-oss-20b's
# one-token step on an H200). `draftbench.moe_experts --router` times the two.
RANK_TOPK = True

# Tokens up to which `Experts.forward` gathers each token's experts (`experts_gather`) instead
# of grouping rows by expert: a one-token decode step. Above it the grouped products read each
# touched expert once.
GATHER_MAX_TOKENS = 1


def topk_by_rank(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(scores, k, dim=-1)` (sorted, largest first) computed from ranks: expert
    `e`'s rank is the number of experts scoring above it, or equal with a lower index, so ties
    go to the lower index (`torch.topk` leaves them unspecified). `[N, E]` -> (values `[N, k]`,
    indices `[N, k]` int64). Comparisons and sums only: no sort, no data-dependent shape."""
    E = scores.shape[-1]
    idx = torch.arange(E, device=scores.device)
    mine, other = scores.unsqueeze(-1), scores.unsqueeze(-2)  # [N, E, 1], [N, 1, E]
    before = idx[None, :] < idx[:, None]  # [E(mine), E(other)]: other has the lower index
    rank = ((other > mine) | ((other == mine) & before)).sum(-1)  # [N, E]
    hit = rank.unsqueeze(-2) == torch.arange(k, device=scores.device)[:, None]  # [N, k, E]
    experts = (hit * idx).sum(-1)
    return scores.gather(-1, experts), experts


def router_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routers' top k: `topk_by_rank` (`RANK_TOPK`), else `torch.topk`."""
    if RANK_TOPK:
        return topk_by_rank(scores, k)
    return torch.topk(scores, k, dim=-1)


class Router(nn.Module):
    """What the routers share: `linear` is their projection, `F.linear` until
    `draftinfer.models.transforms.use_skinny_gemm` sets the skinny-GEMM kernel's (one launch
    with the bias for a one-token step, where cuBLAS runs a split-K GEMV and its reduce)."""

    linear = staticmethod(F.linear)


class TopKSoftmaxRouter(Router):
    """gpt-oss (HF `GptOssTopKRouter`): `logits = x W^T + b`, the top `k` logits, a softmax over
    those `k` (no softmax over all experts). Parameters `weight [E, H]`, `bias [E]`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, bias: bool = True):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, H]` -> (weights `[N, k]` in x's dtype, experts `[N, k]` int64)."""
        logits = self.linear(x, self.weight, self.bias)  # [N, E]
        top, experts = router_topk(logits, self.top_k)
        return torch.softmax(top, dim=-1), experts


class SoftmaxTopKRouter(Router):
    """Qwen3-MoE (HF `Qwen3MoeTopKRouter`): `p = softmax(x W^T)` over all experts in fp32, the
    top `k` probabilities, renormalised to sum to 1 when `norm_topk_prob`. `weight [E, H]`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, H]` -> (weights `[N, k]` in x's dtype, experts `[N, k]` int64)."""
        logits = self.linear(x, self.weight, None)  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = router_topk(probs, self.top_k)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), experts


class GroupedSigmoidRouter(Router):
    """DeepSeek-V3 (HF `DeepseekV3TopkRouter`, `topk_method: noaux_tc`): sigmoid scores
    `s = sigmoid(x W^T)` in fp32; the selection reads `c = s + e_score_correction_bias` (the
    bias only selects, it never weights): the experts are split into `n_group` groups of
    `E / n_group`, a group scores the sum of its two best `c`, the `topk_group` best groups are
    kept and the others' experts masked to -inf, and the top `k` of the masked `c` are chosen.
    Their weights are their `s` (not `c`), renormalised to sum to 1 when `norm_topk_prob` (HF's
    `+ 1e-20`), times `routed_scaling_factor`.

    Static shapes only: both top-k's are `router_topk` over fixed sizes and the group mask is a
    comparison against the kept groups' ranks (no `nonzero`, no boolean indexing), so a round
    stays capturable. Parameters `weight [E, H]` and `e_score_correction_bias [E]` (a buffer in
    HF; a parameter here so the checkpoint fills it by name), both kept in fp32 whatever the
    model's dtype (HF `_keep_in_fp32_modules_strict`: a bf16 bias would move the selection)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ):
        super().__init__()
        if num_experts % n_group or num_experts // n_group < 2:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups of >= 2")
        if not 1 <= topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
            raise ValueError(
                f"top {top_k} of {topk_group} kept groups of {num_experts // n_group} experts"
            )
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))

    def _apply(self, fn, recurse=True):
        # A cast of the model (`.to(bfloat16)`) leaves the router in fp32, unrounded (class
        # docstring); device moves and `to_empty` apply as usual.
        before = {name: p.data for name, p in self._parameters.items()}
        super()._apply(fn, recurse)
        for name, p in self._parameters.items():
            if p.dtype != torch.float32:
                old = before[name].float()
                p.data = (
                    torch.empty_like(p, dtype=torch.float32) if old.is_meta else old.to(p.device)
                )
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, H]` -> (weights `[N, k]` in x's dtype, experts `[N, k]` int64)."""
        N, E = x.shape[0], self.weight.shape[0]
        logits = self.linear(x.float(), self.weight.float(), None)  # [N, E] fp32
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.float()  # selects, never weights
        per_group = choice.view(N, self.n_group, E // self.n_group)  # [N, G, E/G]
        group_scores = router_topk(per_group, 2)[0].sum(-1)  # [N, G]
        _, kept = router_topk(group_scores, self.topk_group)  # [N, topk_group]
        groups = torch.arange(self.n_group, device=x.device)
        keep = (kept[..., None] == groups).any(-2)  # [N, G]
        keep = keep[..., None].expand(N, self.n_group, E // self.n_group).reshape(N, E)
        masked = choice.masked_fill(~keep, float("-inf"))
        _, experts = router_topk(masked, self.top_k)
        weights = scores.gather(-1, experts)  # [N, k]: the sigmoid scores, not `choice`
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        return weights.to(x.dtype), experts


class SiluGLU(nn.Module):
    """SwiGLU on `[..., 2I]` whose first half is the gate, the second the up projection:
    `silu(gate) * up` (Qwen3-MoE's experts, HF `chunk(2, dim=-1)`)."""

    def kernel_spec(self) -> tuple[bool, int, float, float]:
        """(interleaved, act, alpha, limit) as `draftkernels.moe_experts` takes them."""
        return False, 0, 0.0, 0.0

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert activation on interleaved columns (gate at even, up at odd indices):
    `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
    `(up + 1) * gate * sigmoid(alpha * gate)` (HF `GptOssExperts._apply_gate`)."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def kernel_spec(self) -> tuple[bool, int, float, float]:
        """(interleaved, act, alpha, limit) as `draftkernels.moe_experts` takes them."""
        return True, 1, float(self.alpha), float(self.limit)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


Activation = Callable[[torch.Tensor], torch.Tensor]


def experts_reference(
    x: torch.Tensor,  # [N, H]
    weights: torch.Tensor,  # [N, k]
    experts: torch.Tensor,  # [N, k] int64
    w1: torch.Tensor,  # [E, H, 2I]
    b1: torch.Tensor | None,  # [E, 2I]
    w2: torch.Tensor,  # [E, I, H]
    b2: torch.Tensor | None,  # [E, H]
    act: Activation,
) -> torch.Tensor:
    """Dense: every expert over every token, each token keeping its routed experts' outputs
    times their weights. `E` times the FLOPs of the routed computation, obviously right; the
    oracle of the other two and the fallback where they do not apply. -> `[N, H]`."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        h = x @ w1[e]
        if b1 is not None:
            h = h + b1[e]
        y = act(h) @ w2[e]
        if b2 is not None:
            y = y + b2[e]
        chosen = experts == e  # [N, k]
        weight = (weights * chosen).sum(-1, keepdim=True)  # [N, 1]: 0 where e is not routed
        # `where`, not a product: an expert a token does not use contributes nothing, even
        # if its output there is not finite.
        out = out + torch.where(chosen.any(-1, keepdim=True), weight * y, 0)
    return out


def experts_gather(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    act: Activation,
) -> torch.Tensor:
    """gpt-fast style: each token's `k` experts' weights gathered (`w1[experts]`, `[N, k, H,
    2I]`) and two einsums. Eager materialises the gathered weights; compiled, the gather
    fuses into the product and a one-token step reads exactly its `k` experts. -> `[N, H]`."""
    h = torch.einsum("nh,nkhf->nkf", x, w1[experts])  # [N, k, 2I]
    if b1 is not None:
        h = h + b1[experts]
    y = torch.einsum("nki,nkih->nkh", act(h), w2[experts])  # [N, k, H]
    if b2 is not None:
        y = y + b2[experts]
    return (y * weights[..., None]).sum(1)


def experts_kernel(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    act: Activation,
) -> torch.Tensor:
    """The Triton kernel `draftkernels.moe_experts` (two weight-streaming launches; each
    touched expert read once for all its rows), for activations that name their kernel form
    (`kernel_spec`). `w1`/`w2` go in as the `x @ W` views, the kernel reading them through
    their strides (no copy). -> `[N, H]`."""
    interleaved, code, alpha, limit = act.kernel_spec()
    rows = moe_kernel.moe_experts(
        x, weights, experts, w1, b1, w2, b2, True, interleaved, code, alpha, limit
    )
    return sum_rows(rows)


def sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """`rows [N, k, H]` summed over `k` in a fixed order, in fp32, rounded once to the rows'
    dtype: the same value as `rows.sum(1)`, written as `k - 1` elementwise adds so that a
    compiled step fuses it into the residual add that follows (a reduction over `k` is a
    launch of its own: 4.3 us a layer at gpt-oss-20b's one-token step on an H200)."""
    out = rows[:, 0].float()
    for j in range(1, rows.shape[1]):
        out = out + rows[:, j].float()
    return out.to(rows.dtype)


def kernel_supported(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, act: Activation) -> bool:
    """Whether `experts_kernel` runs natively for these operands (shapes, dtypes, device:
    CUDA only; the CPU interpreter is for the kernel's own tests, not the runner) and `act`."""
    return (
        x.is_cuda
        and moe_kernel.TRITON
        and hasattr(act, "kernel_spec")
        and moe_kernel.fits(x, w1, w2)
    )


def expert_offsets(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[E]` int32: the end of each expert's rows among `sorted_experts [S]` (row ids sorted by
    expert), i.e. the cumulative row counts `F.grouped_mm` takes as `offs`. Counted on device
    with `torch.histc` (a `bincount` sizes its output from the data: a host sync on CUDA), one
    bin per expert; histc takes float input on the CPU and int on CUDA (transformers'
    `grouped_mm_experts_forward` does the same, deterministic on both)."""
    ids = sorted_experts.float() if sorted_experts.device.type == "cpu" else sorted_experts.int()
    counts = torch.histc(ids, bins=num_experts, min=0, max=num_experts)  # bin e = [e, e + 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def experts_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    act: Activation,
) -> torch.Tensor:
    """Rows sorted by expert, two grouped products over per-expert row groups
    (`F.grouped_mm` with offsets from `expert_offsets`; its `bias` is not supported, so biases
    are gathered per row and added), then back to token order and the weighted sum over each
    token's `k` rows. Needs `grouped_mm_supported`. -> `[N, H]`."""
    N, k = experts.shape
    flat = experts.reshape(-1)  # [S]
    sorted_experts, order = torch.sort(flat, stable=True)  # order: row ids, by expert
    offs = expert_offsets(sorted_experts, w1.shape[0])
    rows = x[order // k]  # [S, H]
    h = F.grouped_mm(rows, w1, offs=offs)  # [S, 2I]
    if b1 is not None:
        h = h + b1[sorted_experts]
    y = F.grouped_mm(act(h), w2, offs=offs)  # [S, H]
    if b2 is not None:
        y = y + b2[sorted_experts]
    y = y * weights.reshape(-1)[order, None]
    # Back to token order (a permutation: index_copy_ with unique indices is deterministic),
    # then each token's k rows summed in a fixed order (no atomics).
    y = torch.empty_like(y).index_copy_(0, order, y)
    return y.view(N, k, -1).sum(1)


# Device and dtypes `F.grouped_mm` runs without a host sync: CUDA sm80 to sm100 in bf16 (its
# CUTLASS path; other architectures loop over the groups with a device-to-host sync, pytorch
# #194227); the CPU in any float dtype.
_GROUPED_CUDA_MAJORS = (8, 9, 10)
_GROUPED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `experts_grouped` runs for these operands, from device, dtype and shapes only
    (no sync, so a compiled step decides it at trace time): `F.grouped_mm` exists (torch >=
    2.10), the device and dtype are in the table above (compiled: bf16 only; inductor lowers
    no other dtype), and every row of the operands starts on a 16-byte boundary (the kernel's
    stride rule: `H`, `2I` and `I` times the element size are multiples of 16)."""
    if not hasattr(F, "grouped_mm") or not (x.dtype == w1.dtype == w2.dtype):
        return False
    if x.device.type == "cuda":
        major = torch.cuda.get_device_capability(x.device)[0]
        if x.dtype != torch.bfloat16 or major not in _GROUPED_CUDA_MAJORS:
            return False
    elif x.device.type != "cpu" or x.dtype not in _GROUPED_CPU_DTYPES:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    size = x.element_size()
    H, two_i = w1.shape[1], w1.shape[2]
    return all(n * size % 16 == 0 for n in (H, two_i, two_i // 2))


def choose_path(tokens: int, x_at_w: bool, grouped_ok: bool, kernel_ok: bool = False) -> str:
    """The computation `Experts.forward` runs for `tokens` rows (module docstring): the
    kernel wherever `kernel_supported` (CUDA, at most `moe_kernel.MAX_TOKENS` tokens); else
    `experts_gather` for a one-token step over weights stored in the `x @ W` layout (gpt-oss),
    the grouped products wherever `grouped_mm_supported`, the gather for one token otherwise,
    the reference for the rest.

    Without the kernel, weights stored as `[E, 2I, H]` (Qwen3-MoE) take the grouped products
    even for one token: at Qwen3-30B-A3B's shapes on an H200 the gather path's one-token step
    took 16.2 ms while a whole ptd round at K=3, its verify pass of 4 rows through the grouped
    products included, took 6.3 ms (docs/results.md, "MoE targets", 2026-11-29); the gather of
    a transposed view is a transposing copy of each routed expert."""
    if kernel_ok and tokens <= moe_kernel.MAX_TOKENS:
        return "kernel"
    if tokens <= GATHER_MAX_TOKENS and x_at_w:
        return "gather"
    if grouped_ok:
        return "grouped"
    return "gather" if tokens <= GATHER_MAX_TOKENS else "reference"


ExpertsFn = Callable[..., torch.Tensor]
EXPERTS: dict[str, ExpertsFn] = {
    "grouped": experts_grouped,
    "gather": experts_gather,
    "reference": experts_reference,
    "kernel": experts_kernel,
}


class Experts(nn.Module):
    """`E` gated experts as stacked parameters with HF's names (module docstring): each maps
    `x [H]` to `down(act(gate_up(x)))`, `act` taking the `2I` gate/up columns to `I`.

    `path` (None: chosen per call from shapes and dtypes, module docstring) forces one of
    `EXPERTS` (tests, benchmarks).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act: nn.Module,
        *,
        bias: bool,
        x_at_w: bool,
    ):
        super().__init__()
        E, H, inter = num_experts, hidden, intermediate
        self.num_experts, self.x_at_w, self.act = E, x_at_w, act
        self.path: str | None = None
        gate_up = (E, H, 2 * inter) if x_at_w else (E, 2 * inter, H)
        self.gate_up_proj = nn.Parameter(torch.zeros(gate_up))
        self.down_proj = nn.Parameter(torch.zeros((E, inter, H) if x_at_w else (E, H, inter)))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * inter))
            self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
        else:
            self.register_parameter("gate_up_proj_bias", None)
            self.register_parameter("down_proj_bias", None)

    def per_expert_sources(self, prefix: str, leaf: str) -> list[TensorSource] | None:
        """How stacked parameter `{prefix}.{leaf}` (`prefix` = this module's name) is filled
        from the per-expert tensors released checkpoints store (Qwen3-MoE, DeepSeek-V3:
        `{prefix}.{e}.{gate,up,down}_proj.weight`, `(out, in)`): gate into `gate_up_proj[e, :I]`,
        up into `[e, I:]`, down into `down_proj[e]`. For the `[E, 2I, H]` layout without biases
        (`x_at_w=False`); None for any other parameter (`NativeCausalLM.checkpoint_sources`)."""
        if self.x_at_w or leaf not in ("gate_up_proj", "down_proj"):
            return None
        if leaf == "down_proj":
            return [
                TensorSource((f"{prefix}.{e}.down_proj.weight",), index=(e,))
                for e in range(self.num_experts)
            ]
        inter = self.down_proj.shape[-1]
        return [
            TensorSource((f"{prefix}.{e}.{part}_proj.weight",), index=(e, rows))
            for e in range(self.num_experts)
            for part, rows in (("gate", slice(0, inter)), ("up", slice(inter, 2 * inter)))
        ]

    def mats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 `[E, H, 2I]`, w2 `[E, I, H]`): the weights in the `x @ W` layout (views)."""
        if self.x_at_w:
            return self.gate_up_proj, self.down_proj
        return self.gate_up_proj.transpose(-2, -1), self.down_proj.transpose(-2, -1)

    def forward(
        self,
        x: torch.Tensor,  # [N, H]
        weights: torch.Tensor,  # [N, k]
        experts: torch.Tensor,  # [N, k] int64
    ) -> torch.Tensor:
        w1, w2 = self.mats()
        path = self.path or choose_path(
            x.shape[0],
            self.x_at_w,
            grouped_mm_supported(x, w1, w2),
            kernel_supported(x, w1, w2, self.act),
        )
        fn = EXPERTS[path]
        return fn(
            x, weights, experts, w1, self.gate_up_proj_bias, w2, self.down_proj_bias, self.act
        )


class MoEBlock(nn.Module):
    """A routed-experts MLP `[B, T, H] -> [B, T, H]`: the router's `k` experts per token, their
    outputs summed with the router's weights, plus the `shared_experts` MLP over every token
    where the family has one (DeepSeek-V3: `mlp.shared_experts`, a SwiGLU of
    `moe_intermediate_size * n_shared_experts`, added after the routed sum as HF does). The
    router sits under the family's HF name (`router_name`: gpt-oss `mlp.router`, Qwen3-MoE and
    DeepSeek-V3 `mlp.gate`), the experts under `experts`."""

    def __init__(
        self,
        router: nn.Module,
        experts: Experts,
        router_name: str = "router",
        shared_experts: nn.Module | None = None,
    ):
        super().__init__()
        self.router_name = router_name
        self.add_module(router_name, router)
        self.experts = experts
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, experts = getattr(self, self.router_name)(flat)
        out = self.experts(flat, weights, experts).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
