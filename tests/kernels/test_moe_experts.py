"""The routed-experts kernel (`draftkernels.moe_experts`): kernel == its torch reference == the
dense oracle (`draftinfer.models.moe.experts_reference`: every expert over every token, not
this module's maths) in both weight layouts (gpt-oss `x @ W` with interleaved gate/up and
biases; Qwen3-MoE `x @ W.T` with halves), both activations, one token (multiply-accumulate)
and several (MMA) with tokens sharing experts (one lead slot per expert reads it for all its
rows), ragged shapes, several configs. CPU: the Triton interpreter in fp32 and fp16; CUDA: bf16,
and inside `torch.compile`."""

from __future__ import annotations

import pytest
import torch

from draftinfer.models import moe
from tests.support.utils import import_kernel_module, kernel_test_device

mx = import_kernel_module("draftkernels.moe_experts")
DEVICE = kernel_test_device()
DTYPES = [torch.float32, torch.float16] if DEVICE.type == "cpu" else [torch.bfloat16]


def make(N, H, inter, E, k, x_at_w, bias, dtype, seed=0, shared=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    gu_shape = (E, H, 2 * inter) if x_at_w else (E, 2 * inter, H)
    dn_shape = (E, inter, H) if x_at_w else (E, H, inter)
    gate_up = torch.randn(gu_shape, generator=g) / H**0.5
    down = torch.randn(dn_shape, generator=g) / inter**0.5
    b1 = torch.randn(E, 2 * inter, generator=g) * 0.5 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.5 if bias else None
    # shared: each token picks k of the first k + 1 experts, so experts carry several rows
    pool = k + 1 if shared else E
    experts = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(N)])
    weights = torch.softmax(torch.randn(N, k, generator=g), -1)
    to = dict(device=DEVICE, dtype=dtype)
    t = [x, weights, gate_up, b1, down, b2]
    x, weights, gate_up, b1, down, b2 = [None if v is None else v.to(**to) for v in t]
    return x, weights, experts.to(DEVICE), gate_up, b1, down, b2


def oracle(x, weights, experts, gate_up, b1, down, b2, x_at_w, interleaved, act, alpha, limit):
    """The dense reference in fp32 on the CPU, with the activation module of the family."""
    f = [None if v is None else v.float().cpu() for v in (x, weights, gate_up, b1, down, b2)]
    x, weights, gate_up, b1, down, b2 = f
    w1, w2 = (gate_up, down) if x_at_w else (gate_up.transpose(1, 2), down.transpose(1, 2))
    if act == 1:
        fn = moe.ClampedSwiGLU(alpha, limit)
    else:
        fn = moe.SiluGLU()
    if interleaved != (act == 1):  # the tests pair interleaved with the clamped activation
        raise AssertionError("the oracle pairs interleaved columns with ClampedSwiGLU")
    return moe.experts_reference(x, weights, experts.cpu(), w1, b1, w2, b2, fn)


def tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


# N tokens, H, I, E, k, x_at_w (gpt-oss layout, interleaved, clamped act, bias), shared, cfgs
CASES = [
    (1, 64, 32, 4, 2, True, False, None),  # one token, gpt-oss layout, default configs
    (1, 70, 40, 5, 2, False, False, None),  # one token, Qwen3 layout, ragged
    (1, 64, 48, 8, 4, True, False, ((16, 32, 4, 1), (32, 32, 4, 2))),  # several column tiles
    (4, 64, 32, 4, 2, True, True, None),  # a verify of 4 tokens sharing experts
    (5, 72, 40, 6, 3, False, True, ((16, 32, 4, 2), (16, 32, 4, 1))),  # Qwen3, ragged, shared
    (9, 64, 32, 16, 4, True, False, ((16, 16, 4, 1), (32, 64, 4, 2))),  # K + 1 = 9 rows
    (16, 48, 24, 4, 2, False, True, None),  # the largest token count, every expert shared
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"N{c[0]}H{c[1]}I{c[2]}E{c[3]}k{c[4]}"
        f"{'gptoss' if c[5] else 'qwen3'}{'-shared' if c[6] else ''}"
    ),
)
def test_kernel_matches_reference_and_dense_oracle(case, dtype):
    N, H, inter, E, k, x_at_w, shared, cfgs = case
    gpt_oss = x_at_w
    act, alpha, limit = (1, 1.702, 7.0) if gpt_oss else (0, 1.702, 7.0)
    x, weights, experts, gate_up, b1, down, b2 = make(
        N, H, inter, E, k, x_at_w, gpt_oss, dtype, shared=shared
    )
    args = (x, weights, experts, gate_up, b1, down, b2, x_at_w, gpt_oss, act, alpha, limit)
    got = mx._launch(*args, cfgs=cfgs).sum(1)
    ref = mx.moe_experts_ref(*args).sum(1)
    dense = oracle(*args)
    assert got.shape == (N, H) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), **tol(dtype))
    torch.testing.assert_close(got.float().cpu(), dense, **tol(dtype))
    if shared:  # the case exercises an expert with several rows
        assert torch.unique(experts).numel() < experts.numel()


@pytest.mark.parametrize("row_invariant", [True, False])
def test_a_token_gets_the_same_bits_alone_or_among_others(row_invariant, monkeypatch):
    """Under `ROW_INVARIANT` a token's output does not depend on the tokens beside it (a plain
    step and a verify pass agree bitwise); without it one token takes the other path."""
    monkeypatch.setattr(mx, "ROW_INVARIANT", row_invariant)
    dtype = DTYPES[-1]
    x, weights, experts, gate_up, b1, down, b2 = make(5, 64, 48, 6, 2, True, True, dtype, seed=3)
    args = (gate_up, b1, down, b2, True, True, 1, 1.702, 7.0)
    many = mx._launch(x, weights, experts, *args).sum(1)
    one = mx._launch(x[:1], weights[:1], experts[:1], *args).sum(1)
    assert mx.rows_class(1) == ("m1" if row_invariant else 1)
    if row_invariant:
        assert torch.equal(one[0], many[0])
    else:
        torch.testing.assert_close(one[0], many[0], **tol(dtype))


def test_op_takes_kernel_where_supported_and_checks_shapes():
    dtype = DTYPES[0]
    x, weights, experts, gate_up, b1, down, b2 = make(3, 64, 32, 4, 2, True, True, dtype)
    out = mx.moe_experts(x, weights, experts, gate_up, b1, down, b2, True, True, 1, 1.702, 7.0)
    ref = mx.moe_experts_ref(x, weights, experts, gate_up, b1, down, b2, True, True, 1, 1.702, 7.0)
    torch.testing.assert_close(out, ref, **tol(dtype))
    assert mx.supports(x, gate_up, down)
    assert not mx.supports(x.new_zeros(mx.MAX_TOKENS + 1, 64), gate_up, down)
    with pytest.raises(ValueError, match="do not match"):
        mx.moe_experts(x[:, :32], weights, experts, gate_up, b1, down, b2, True, True, 1, 1.7, 7.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N", [1, 5])
def test_compiled_op_in_graph_equals_eager(N):
    """As the runner calls it: through `Experts` (the Qwen3 layout's transposed views), inside
    `torch.compile` with CUDA graphs."""
    from draftinfer.models.moe import Experts, SiluGLU

    ex = Experts(8, 256, 128, SiluGLU(), bias=False, x_at_w=False).cuda().bfloat16()
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.05)
    x, weights, experts, *_ = make(N, 256, 128, 8, 2, False, False, torch.bfloat16, shared=True)
    assert ex.path is None
    cf = torch.compile(ex, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            got = cf(x, weights, experts).clone()
        ex.path = "kernel"
        torch.testing.assert_close(got, ex(x, weights, experts), atol=0, rtol=0)
        ex.path = "reference"
        torch.testing.assert_close(got, ex(x, weights, experts), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_one_token_configs_keep_its_bits_at_the_measured_shapes(shape):
    """At the shapes `TABLE` was measured for, a token through the one-token ("m1") configs
    gets the same bits as among the K + 1 = 9 of a verify pass ("m16" configs): the plain step
    and the verify pass of the runner agree, whatever tiles the sweep picked."""
    H, inter, E, k, gpt_oss = {
        "gpt-oss-20b": (2880, 2880, 32, 4, True),
        "qwen3-30b-a3b": (2048, 768, 128, 8, False),
    }[shape]
    x, weights, experts, gate_up, b1, down, b2 = make(
        9, H, inter, E, k, gpt_oss, gpt_oss, torch.bfloat16, seed=5, shared=True
    )
    args = (gate_up, b1, down, b2, gpt_oss, gpt_oss, int(gpt_oss), 1.702, 7.0)
    many = mx._launch(x, weights, experts, *args)
    for t in range(9):
        one = mx._launch(x[t : t + 1], weights[t : t + 1], experts[t : t + 1], *args)
        assert torch.equal(one[0], many[t]), f"token {t}"
