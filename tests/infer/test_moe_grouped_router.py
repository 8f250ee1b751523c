"""DeepSeek-V3's routing (`draftinfer.models.moe.GroupedSigmoidRouter`) and the MoE block's
shared experts against transformers' own modules (`DeepseekV3TopkRouter`, `DeepseekV3MoE`)
on the same weights: sigmoid scores, `e_score_correction_bias` that selects but never weights,
group-limited top-k (`n_group`, `topk_group`), renormalised weights times
`routed_scaling_factor`; the router stays fp32 in a bf16 model and traces as one graph."""

from __future__ import annotations

import random

import pytest
import torch

from draftinfer.models.layers import SwiGLU
from draftinfer.models.moe import EXPERTS, Experts, GroupedSigmoidRouter, MoEBlock, SiluGLU
from tests.support.utils import assert_close

# (E, n_group, topk_group, k): groups of 2 and more, every group kept, one kept group.
ROUTES = [(8, 4, 2, 2), (16, 4, 1, 3), (16, 8, 3, 4), (6, 3, 3, 4), (32, 8, 4, 8), (4, 2, 1, 2)]


def _hf_config(E, n_group, topk_group, k, norm=True, scale=2.5, H=32, inter=16):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        hidden_size=H,
        moe_intermediate_size=inter,
        n_routed_experts=E,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=k,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
        n_shared_experts=2,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    cfg._experts_implementation = "eager"
    return cfg


def _sorted(weights, experts):
    """A route in expert order (HF's top-k is unsorted)."""
    experts, order = experts.sort(-1)
    return weights.gather(-1, order), experts


def _hf_router(cfg, g, bias_std=0.5):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=g))
        hf.e_score_correction_bias.copy_(torch.randn(hf.weight.shape[0], generator=g) * bias_std)
    return hf


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: "E{}g{}t{}k{}".format(*r))
def test_router_equals_transformers(route, norm):
    E, n_group, topk_group, k = route
    cfg = _hf_config(E, n_group, topk_group, k, norm=norm, scale=1.7)
    g = torch.Generator().manual_seed(E * 100 + k)
    hf = _hf_router(cfg, g)
    ours = GroupedSigmoidRouter(32, E, k, n_group, topk_group, norm, 1.7)
    ours.load_state_dict(hf.state_dict())  # the same names: weight, e_score_correction_bias
    x = torch.randn(57, 32, generator=g)
    _, hf_w, hf_e = hf(x)
    w, e = ours(x)
    w, e = _sorted(w, e)
    hf_w, hf_e = _sorted(hf_w, hf_e)
    assert torch.equal(e, hf_e)
    assert_close(w, hf_w)
    # The chosen experts lie in at most `topk_group` groups.
    used = torch.stack([(e // (E // n_group) == gi).any(-1) for gi in range(n_group)])
    assert (used.sum(0) <= topk_group).all()
    if norm:
        assert_close(w.sum(-1), torch.full((57,), 1.7))


def test_correction_bias_selects_but_never_weights():
    """The bias changes which experts are chosen; the weights are the chosen experts' sigmoid
    scores (renormalised, scaled), never score + bias."""
    E, n_group, topk_group, k = 16, 4, 2, 4
    g = torch.Generator().manual_seed(3)
    hf = _hf_router(_hf_config(E, n_group, topk_group, k, norm=False, scale=1.0), g, 2.0)
    ours = GroupedSigmoidRouter(32, E, k, n_group, topk_group, False, 1.0)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(40, 32, generator=g)
    w, e = ours(x)
    scores = torch.sigmoid(x @ ours.weight.T)
    assert torch.equal(w, scores.gather(-1, e))
    unbiased = GroupedSigmoidRouter(32, E, k, n_group, topk_group, False, 1.0)
    unbiased.load_state_dict({"weight": ours.weight, "e_score_correction_bias": torch.zeros(E)})
    _, e0 = unbiased(x)
    assert not torch.equal(e.sort(-1)[0], e0.sort(-1)[0])  # the bias moved some routes


def test_group_limit_excludes_the_best_expert_of_a_dropped_group():
    """One group holds the single best expert but its second best is poor, so its group score
    (sum of its top two) ranks last: with one group kept, that expert is not chosen."""
    ours = GroupedSigmoidRouter(2, 8, 2, 4, 1, True, 1.0)
    with torch.no_grad():
        ours.weight.zero_()
        # logits = x . w: x = [1, 0]; group 0 = experts 0, 1; ...
        ours.weight[:, 0] = torch.tensor([9.0, -9.0, 2.0, 2.0, 1.0, 1.0, -1.0, -1.0])
    _, e = ours(torch.tensor([[1.0, 0.0]]))
    assert sorted(e[0].tolist()) == [2, 3]
    ours.topk_group = 4  # every group kept: the best expert wins again
    _, e = ours(torch.tensor([[1.0, 0.0]]))
    assert 0 in e[0].tolist()


def test_block_with_shared_experts_equals_transformers():
    """`MoEBlock` with `shared_experts` against HF's `DeepseekV3MoE` (state dict by HF names:
    `gate.*`, `experts.{gate_up,down}_proj`, `shared_experts.*`), on every experts path."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = _hf_config(16, 4, 2, 3)
    hf = DeepseekV3MoE(cfg)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            std = 1.0 if name.startswith("gate") else (0.05 if "down" in name else 0.4)
            p.copy_(torch.randn(p.shape, generator=g) * std)
        hf.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
    router = GroupedSigmoidRouter(32, 16, 3, 4, 2, True, 2.5)
    experts = Experts(16, 32, 16, SiluGLU(), bias=False, x_at_w=False)
    ours = MoEBlock(router, experts, "gate", shared_experts=SwiGLU(32, 32))
    ours.load_state_dict(hf.state_dict())  # strict
    x = torch.randn(2, 7, 32, generator=g)
    want = hf(x)
    for path in EXPERTS:
        if path == "kernel":
            continue  # CUDA only
        ours.experts.path = path
        assert_close(ours(x), want)
    ours.shared_experts = None  # the shared experts matter
    assert not torch.allclose(ours(x), want, atol=1e-3)


def test_router_stays_fp32_in_a_bf16_model_and_traces_as_one_graph():
    torch._dynamo.reset()
    ours = GroupedSigmoidRouter(32, 16, 4, 4, 2, True, 2.5)
    with torch.no_grad():
        ours.e_score_correction_bias.copy_(torch.arange(16) * 1e-3 + 0.1)
    bias = ours.e_score_correction_bias.detach().clone()
    block = MoEBlock(ours, Experts(16, 32, 16, SiluGLU(), bias=False, x_at_w=False), "gate")
    block = block.to(torch.bfloat16)
    assert ours.weight.dtype == ours.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(ours.e_score_correction_bias, bias)  # not rounded through bf16
    x = torch.randn(9, 32).bfloat16()
    compiled = torch.compile(ours, backend="eager", fullgraph=True)
    w, e = compiled(x)
    w0, e0 = ours(x)
    assert w.dtype == torch.bfloat16 and torch.equal(e, e0) and torch.equal(w, w0)


def test_routes_are_valid_on_random_configs():
    """Many random group layouts: `k` distinct experts per token, from kept groups only."""
    rng = random.Random(0)
    for i in range(30):
        n_group = rng.choice([1, 2, 4, 8])
        E = n_group * rng.choice([2, 3, 4])
        topk_group = rng.randint(1, n_group)
        k = rng.randint(1, topk_group * (E // n_group))
        cfg = _hf_config(E, n_group, topk_group, k, norm=rng.random() < 0.5)
        g = torch.Generator().manual_seed(i)
        hf = _hf_router(cfg, g)
        ours = GroupedSigmoidRouter(32, E, k, n_group, topk_group, cfg.norm_topk_prob, 2.5)
        ours.load_state_dict(hf.state_dict())
        x = torch.randn(13, 32, generator=g)
        _, hf_w, hf_e = hf(x)
        w, e = _sorted(*ours(x))
        hf_w, hf_e = _sorted(hf_w, hf_e)
        assert torch.equal(e, hf_e), (E, n_group, topk_group, k)
        assert_close(w, hf_w)
        assert (e[:, 1:] != e[:, :-1]).all()
