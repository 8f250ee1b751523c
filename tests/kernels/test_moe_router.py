"""The MoE router kernel (`draftkernels.moe_route`): kernel == reference == the routers of
`draftinfer.models.moe` (the modules the targets run, the oracle that is not this module) for
gpt-oss's rule (top-k of the logits with bias, softmax over the k) and Qwen3-MoE's (softmax over
all experts, top-k, renormalised or not), one token and several, ragged hidden sizes and
expert counts, ties to the lower id. CPU: the Triton interpreter in fp32 and fp16; CUDA: bf16
and inside `torch.compile` with a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from draftinfer.models.moe import SoftmaxTopKRouter, TopKSoftmaxRouter
from tests.support.utils import import_kernel_module, kernel_test_device

mr = import_kernel_module("draftkernels.moe_router")
DEVICE = kernel_test_device()
DTYPES = [torch.float32, torch.float16] if DEVICE.type == "cpu" else [torch.bfloat16]


def router(rule: int, H: int, E: int, k: int, norm: bool, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if rule == 0:
        r = TopKSoftmaxRouter(H, E, k)
        r.bias.data = torch.randn(E, generator=g)
    else:
        r = SoftmaxTopKRouter(H, E, k, norm)
    r.weight.data = torch.randn(E, H, generator=g) / H**0.5 * 3
    return r.to(DEVICE, dtype)


CASES = [  # rule, N, H, E, k, norm
    (0, 1, 2880 // 16, 32, 4, False),  # gpt-oss: one token, bias
    (0, 5, 100, 7, 2, False),  # ragged H and E, a verify of 5
    (1, 1, 128, 128, 8, True),  # Qwen3-MoE: 128 experts, top-8, renormalised
    (1, 9, 96, 60, 4, False),  # not renormalised, K + 1 = 9 tokens
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "rule{}-N{}-H{}-E{}-k{}".format(*c[:5]))
def test_kernel_matches_the_routers(case, dtype):
    rule, N, H, E, k, norm = case
    r = router(rule, H, E, k, norm, dtype)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    bias = r.bias if rule == 0 else None
    w, e = mr._launch(x, r.weight, bias, k, rule, norm)
    rw, re_ = mr.moe_route_ref(x, r.weight, bias, k, rule, norm)
    mw, me = r(x)  # the module the targets run
    assert e.dtype == torch.int64 and w.dtype == dtype and w.shape == (N, k)
    assert torch.equal(e.cpu(), re_.cpu()) and torch.equal(e.cpu(), me.cpu())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(w.float().cpu(), rw.float().cpu(), **tol)
    torch.testing.assert_close(w.float().cpu(), mw.float().cpu(), **tol)


def test_ties_go_to_the_lower_expert_id():
    x = torch.ones(1, 8, device=DEVICE)
    weight = torch.zeros(6, 8, device=DEVICE)
    weight[[1, 3, 4]] = 1.0  # experts 1, 3, 4 tie above the rest
    w, e = mr._launch(x, weight, None, 2, 0, False)
    assert e.tolist() == [[1, 3]]
    torch.testing.assert_close(w.cpu(), torch.tensor([[0.5, 0.5]]))


def test_op_checks_and_falls_back():
    r = router(0, 32, 8, 2, False, DTYPES[0])
    x = torch.randn(3, 32, device=DEVICE, dtype=DTYPES[0])
    w, e = mr.moe_route(x, r.weight, r.bias, 2, 0, False)
    assert e.shape == (3, 2)
    with pytest.raises(ValueError, match="rule"):
        mr.moe_route(x, r.weight, r.bias, 2, 3, False)
    with pytest.raises(ValueError, match="do not match"):
        mr.moe_route(x[:, :16], r.weight, r.bias, 2, 0, False)
    big = x.new_zeros(mr.MAX_TOKENS + 1, 32)
    assert not mr.fits(big, r.weight, 2)
    torch.testing.assert_close(
        mr.moe_route(big, r.weight, r.bias, 2, 0, False)[0],
        mr.moe_route_ref(big, r.weight, r.bias, 2, 0, False)[0],
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_in_a_cuda_graph_equals_eager():
    r = router(1, 2048, 128, 8, True, torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)

    def f(x):
        return mr.moe_route(x, r.weight, None, 8, 1, True)

    cf = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        w, e = (t.clone() for t in cf(x))
    w0, e0 = f(x)
    assert torch.equal(e, e0) and torch.equal(w, w0)
