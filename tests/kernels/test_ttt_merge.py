"""TTT's diagonal merge (`draftkernels.ttt_merge`): the Triton kernels == the torch references
== oracles that share neither's formulas (CPU: Triton interpreter; CUDA: compiled).

Forward oracle: merging a causal block (output `out_c`, log-sum-exp `lse_c`) with extra keys is
a softmax over `[lse_c, scores]` applied to `[out_c, values]` (the block acts as one key whose
score is its log-sum-exp). Backward oracle: autograd through that softmax with the block held
fixed, plus the block's own `dq_c` (what its kernel's backward gives with the merged output and
log-sum-exp)."""

from __future__ import annotations

import pytest
import torch

from tests.support.utils import import_kernel_module, kernel_test_device, poison_empty  # noqa: F401

tm = import_kernel_module("draftkernels.ttt_merge")
DEVICE = kernel_test_device()
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def case(N, nh, nkv, S, D, seed=0, dtype=DTYPE):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=g)).to(DEVICE, dtype)

    q, out_c = r(N, nh, D), r(N, nh, D)
    lse_c = (2 * torch.randn(N, nh, generator=g)).to(DEVICE)
    ks, vs = r(N, nkv, S, D), r(N, nkv, S, D)
    return q, out_c, lse_c, ks, vs, D**-0.5


def oracle(q, out_c, lse_c, ks, vs, scale):
    """Softmax over [the block, each extra key] per (row, head), in fp64."""
    N, nh, D = q.shape
    g = nh // ks.shape[1]
    k = ks.double().repeat_interleave(g, dim=1)  # [N, nh, S, D]
    v = vs.double().repeat_interleave(g, dim=1)
    sd = (q.double()[:, :, None] * k).sum(-1) * scale  # [N, nh, S]
    w = torch.softmax(torch.cat([lse_c.double()[..., None], sd], -1), -1)
    out = w[..., :1] * out_c.double() + (w[..., 1:, None] * v).sum(-2)
    return out, torch.logsumexp(torch.cat([lse_c.double()[..., None], sd], -1), -1)


SHAPES = [
    # N, nh, nkv, S, D
    (7, 4, 2, 1, 16),
    (5, 4, 2, 3, 16),
    (3, 8, 2, 6, 32),  # four query heads per kv head, six keys (TTT step 6)
    (4, 3, 3, 2, 24),  # no GQA; D not a power of two
    (6, 6, 2, 5, 8),  # three heads per group (not a power of two)
]


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference_and_oracle(shape, poison_empty):  # noqa: F811
    args = case(*shape)
    tol = dict(rtol=2e-2, atol=2e-2) if DTYPE == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    want_out, want_lse = oracle(*args)
    for fn in (tm.ttt_merge, tm.ttt_merge_ref):
        out, lse = fn(*args)
        assert out.dtype == args[0].dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), want_out, **tol)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_reference_and_oracle(shape, poison_empty):  # noqa: F811
    q, out_c, lse_c, ks, vs, scale = case(*shape, seed=1)
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(q.shape, generator=g).to(DEVICE, DTYPE)
    dq_c = torch.randn(q.shape, generator=g).to(DEVICE, DTYPE)
    out, lse = tm.ttt_merge_ref(q, out_c, lse_c, ks, vs, scale)
    # The oracle: autograd through the fp64 softmax over [block, keys], the block held fixed.
    leaves = [t.double().requires_grad_() for t in (q, ks, vs)]
    o, _ = oracle(leaves[0], out_c, lse_c, leaves[1], leaves[2], scale)
    want = torch.autograd.grad((o * dout.double()).sum(), leaves)
    want = (want[0] + dq_c.double(), want[1], want[2])
    tol = dict(rtol=3e-2, atol=3e-2) if DTYPE == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for fn in (tm.ttt_merge_backward, tm.ttt_merge_backward_ref):
        got = fn(dout, out, q, lse, ks, vs, dq_c, scale)
        for a, b, t in zip(got, want, (q, ks, vs)):
            assert a.dtype == t.dtype and a.shape == t.shape
            torch.testing.assert_close(a.double(), b, **tol)


def test_kernel_takes_strided_inputs(poison_empty):  # noqa: F811
    """The attention hands over transposed views (`[B, nh, T, D]` kernels' outputs read as
    `[B, T, nh, D]`): the launcher makes them contiguous, same numbers."""
    q, out_c, lse_c, ks, vs, scale = case(6, 4, 2, 2, 16, seed=3)
    strided = out_c.view(2, 3, 4, 16).transpose(1, 2).contiguous().transpose(1, 2).reshape(6, 4, 16)
    a = tm.ttt_merge(q, out_c, lse_c, ks, vs, scale)
    b = tm.ttt_merge(q, strided, lse_c.t().contiguous().t(), ks, vs, scale)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_bad_shapes_fail_in_one_line():
    q, out_c, lse_c, ks, vs, scale = case(4, 4, 2, 2, 16)
    with pytest.raises(ValueError, match="does not fit"):
        tm.ttt_merge(q, out_c, lse_c, ks[:, :, :, :8], vs, scale)
    with pytest.raises(ValueError, match="lse_c must have"):
        tm.ttt_merge(q, out_c, lse_c[:, :2].contiguous(), ks, vs, scale)
