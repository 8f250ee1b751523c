"""The routed-experts block (`draftinfer.models.moe`): its three computations (grouped
products, gather, the dense reference) equal on random routes in fp32, in both weight layouts
and both activations; the routers and the experts equal transformers' gpt-oss and Qwen3-MoE
modules on the same weights; offsets counted on device; the forward traces as one graph (no
host sync: a `.item()`, `nonzero` or data-dependent shape would break it)."""

from __future__ import annotations

import pytest
import torch

from draftinfer.models.moe import (
    EXPERTS,
    ClampedSwiGLU,
    Experts,
    MoEBlock,
    SiluGLU,
    SoftmaxTopKRouter,
    TopKSoftmaxRouter,
    expert_offsets,
    experts_reference,
    grouped_mm_supported,
    sum_rows,
    topk_by_rank,
)
from tests.support.utils import assert_close  # fp32: the same products summed in other orders


def random_experts(E, H, inter, *, gpt_oss: bool, seed=0) -> Experts:
    act = ClampedSwiGLU(1.702, 7.0) if gpt_oss else SiluGLU()
    ex = Experts(E, H, inter, act, bias=gpt_oss, x_at_w=gpt_oss)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ex.named_parameters():
            # gate/up large enough that gpt-oss's clamps at +-7 are reached by some columns;
            # down small, so outputs are O(1) and fp32's tolerance is the one of tests.support.
            scale = 0.05 if name.startswith("down") else 0.4
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return ex


def random_route(N, E, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g)
    return weights / weights.sum(-1, keepdim=True), experts


CASES = [
    # N tokens, E experts, top-k, H, I
    (1, 4, 2, 64, 32),  # a one-token decode step
    (7, 8, 2, 64, 48),  # a verify pass: experts shared between tokens, some unused
    (23, 4, 1, 32, 16),
    (5, 2, 2, 16, 8),  # every token uses every expert
    (40, 16, 4, 64, 32),  # more experts than any token uses
]


@pytest.mark.parametrize("gpt_oss", [True, False], ids=["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_paths_equal_the_reference(case, gpt_oss):
    N, E, k, H, inter = case
    ex = random_experts(E, H, inter, gpt_oss=gpt_oss)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(2))
    weights, experts = random_route(N, E, k)
    w1, w2 = ex.mats()
    assert w1.shape == (E, H, 2 * inter) and w2.shape == (E, inter, H)
    args = (x, weights, experts, w1, ex.gate_up_proj_bias, w2, ex.down_proj_bias, ex.act)
    want = experts_reference(*args)
    if gpt_oss and H >= 32:  # the clamps at +-7 are reached (they matter in this case)
        h = torch.einsum("nh,ehf->enf", x, w1) + ex.gate_up_proj_bias[:, None]
        assert (h.abs() > 7).any()
    # A slow but independent oracle for the oracle: token by token, expert by expert.
    for n in range(N):
        acc = torch.zeros(H)
        for j in range(k):
            e = int(experts[n, j])
            h = x[n] @ w1[e] + (ex.gate_up_proj_bias[e] if gpt_oss else 0)
            y = ex.act(h) @ w2[e] + (ex.down_proj_bias[e] if gpt_oss else 0)
            acc += weights[n, j] * y
        assert_close(want[n], acc)
    assert grouped_mm_supported(x, w1, w2)
    for name, fn in EXPERTS.items():
        assert_close(fn(*args), want)
        ex.path = name
        assert_close(ex(x, weights, experts), want)


def test_expert_offsets_count_rows_on_device():
    ids = torch.tensor([0, 0, 2, 2, 2, 5, 7, 7])
    assert expert_offsets(ids, 8).tolist() == [2, 2, 5, 5, 5, 6, 6, 8]
    assert expert_offsets(ids, 8).dtype == torch.int32
    assert expert_offsets(torch.tensor([0]), 1).tolist() == [1]


@pytest.mark.parametrize("E,k", [(32, 4), (128, 8), (5, 5), (7, 1)])
def test_topk_by_rank_is_torch_topk(E, k):
    # distinct scores (fp32 normals): the same values and indices, largest first
    scores = torch.randn(9, E, generator=torch.Generator().manual_seed(E + k))
    want_v, want_i = torch.topk(scores, k, dim=-1)
    got_v, got_i = topk_by_rank(scores, k)
    assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v)
    assert got_i.dtype == torch.int64


def test_topk_by_rank_gives_ties_to_the_lower_index():
    scores = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, -3.0]]).bfloat16()
    values, experts = topk_by_rank(scores, 4)
    assert experts.tolist() == [[1, 3, 2, 4]]
    assert values.float().tolist() == [[2.0, 2.0, 1.0, 1.0]]


@pytest.mark.parametrize("k", [1, 4, 8])
def test_sum_rows_is_the_sum_over_k(k):
    # The kernel path's k-sum, written as adds so that it fuses into the residual add: the
    # same bits as the reduction (fp32 accumulation in index order, rounded once).
    rows = torch.randn(5, k, 64, generator=torch.Generator().manual_seed(k)).bfloat16() * 3
    want = torch.zeros(5, 64)
    for j in range(k):
        want = want + rows[:, j].float()
    assert torch.equal(sum_rows(rows), want.bfloat16())


def test_path_is_chosen_from_shapes_and_dtypes():
    ex = random_experts(4, 64, 32, gpt_oss=True)
    w1, w2 = ex.mats()
    assert grouped_mm_supported(torch.zeros(3, 64), w1, w2)
    assert not grouped_mm_supported(torch.zeros(3, 64, dtype=torch.bfloat16), w1, w2)
    odd = random_experts(4, 64, 6, gpt_oss=False)  # I * 4 bytes is not a multiple of 16
    assert not grouped_mm_supported(torch.zeros(3, 64), *odd.mats())
    # The unsupported shape still runs (the reference); the supported one grouped.
    x = torch.randn(9, 64)
    weights, experts = random_route(9, 4, 2)
    want = experts_reference(x, weights, experts, *_args(odd))
    assert_close(odd(x, weights, experts), want)


@pytest.mark.parametrize("gpt_oss", [True, False])
def test_one_token_gathers_only_from_the_x_at_w_layout(gpt_oss, monkeypatch):
    """One token: gpt-oss's `[E, H, 2I]` experts are gathered; Qwen3-MoE's `[E, 2I, H]` ones
    go through the grouped products (a gathered transposed view was 2.6x slower than a whole
    round on an H200); more tokens are grouped either way."""
    import draftinfer.models.moe as moe

    ex = random_experts(4, 64, 32, gpt_oss=gpt_oss)
    ran = []
    for name, fn in list(moe.EXPERTS.items()):
        monkeypatch.setitem(moe.EXPERTS, name, lambda *a, _n=name, _f=fn: ran.append(_n) or _f(*a))
    for n in (1, 5):
        x = torch.randn(n, 64)
        weights, experts = random_route(n, 4, 2)
        assert_close(ex(x, weights, experts), experts_reference(x, weights, experts, *_args(ex)))
    assert ran == (["gather", "grouped"] if gpt_oss else ["grouped", "grouped"])
    assert moe.choose_path(1, False, grouped_ok=False) == "gather"
    assert moe.choose_path(5, True, grouped_ok=False) == "reference"


def _args(ex: Experts):
    w1, w2 = ex.mats()
    return w1, ex.gate_up_proj_bias, w2, ex.down_proj_bias, ex.act


def _hf_config(gpt_oss: bool, E=8, k=2):
    from tests.support.moe_models import gpt_oss_config, qwen3_moe_config

    if gpt_oss:
        cfg = gpt_oss_config(experts=E, top_k=k, hidden=64, intermediate=32)
    else:
        cfg = qwen3_moe_config(experts=E, top_k=k, hidden=64, moe_intermediate=32)
    cfg._experts_implementation = "eager"
    return cfg


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routers_equal_transformers(norm_topk_prob):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(5)
    x = torch.randn(31, 64, generator=g)
    cfg = _hf_config(True)
    hf, ours = GptOssTopKRouter(cfg), TopKSoftmaxRouter(64, 8, 2)
    with torch.no_grad():
        for p in (hf.weight, hf.bias):
            p.copy_(torch.randn(p.shape, generator=g))
    ours.load_state_dict(hf.state_dict())
    _, hf_w, hf_e = hf(x)
    w, e = ours(x)
    assert torch.equal(e, hf_e) and torch.equal(w, hf_w)

    cfg = _hf_config(False)
    cfg.norm_topk_prob = norm_topk_prob
    hf, ours = Qwen3MoeTopKRouter(cfg), SoftmaxTopKRouter(64, 8, 2, norm_topk_prob)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=g))
    ours.load_state_dict(hf.state_dict())
    _, hf_w, hf_e = hf(x)
    w, e = ours(x)
    assert torch.equal(e, hf_e) and torch.equal(w, hf_w)
    assert torch.allclose(w.sum(-1), torch.ones(31)) == norm_topk_prob


@pytest.mark.parametrize("gpt_oss", [True, False], ids=["gpt_oss", "qwen3_moe"])
def test_block_equals_transformers(gpt_oss):
    """The whole block (router + experts) against HF's `GptOssMLP` / `Qwen3MoeSparseMoeBlock`
    with the same state dict (HF's names and layouts), on every path."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = _hf_config(gpt_oss)
    hf = GptOssMLP(cfg) if gpt_oss else Qwen3MoeSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 0.05 if "down" in name else 0.4
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    if gpt_oss:
        router, name = TopKSoftmaxRouter(64, 8, 2), "router"
    else:
        router, name = SoftmaxTopKRouter(64, 8, 2, cfg.norm_topk_prob), "gate"
    ours = MoEBlock(router, random_experts(8, 64, 32, gpt_oss=gpt_oss), router_name=name)
    ours.load_state_dict(hf.state_dict())  # strict: the same names and shapes
    x = torch.randn(3, 5, 64, generator=g)
    want = hf(x)
    want = want[0] if isinstance(want, tuple) else want
    for path in EXPERTS:
        ours.experts.path = path
        assert_close(ours(x), want)


@pytest.mark.parametrize("path", list(EXPERTS))
def test_forward_traces_as_one_graph(path):
    """`fullgraph=True` fails on a graph break: a host sync (`.item()`, `.tolist()`), a
    data-dependent shape (`nonzero`, boolean indexing) or Python control flow on tensor values.
    Traced with the eager backend (no code generation), once per computation; in bf16, the
    only dtype `F.grouped_mm` traces in."""
    torch._dynamo.reset()
    ours = MoEBlock(TopKSoftmaxRouter(64, 8, 2), random_experts(8, 64, 32, gpt_oss=True))
    ours = ours.to(torch.bfloat16)
    ours.experts.path = path
    x = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    compiled = torch.compile(ours, backend="eager", fullgraph=True)
    assert_close(compiled(x), ours(x))
