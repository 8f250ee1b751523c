"""TTT parity: the unrolled training forward equals a naive loop that runs the drafter one
step at a time with a growing KV cache (what the runner does), and the flex and flash
backends equal the eager one (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from draftinfer.kinds.eagle3 import Eagle3Drafter
from draftinfer.models.layers import expand_kv
from drafttrain.jobs.errors import ConfigError
from drafttrain.kinds.eagle3 import Eagle3Objective, Eagle3TrainConfig
from drafttrain.objectives.ttt import (
    dense_kernel_fits,
    pick_backend,
    ttt_attention_eager,
    ttt_attention_flex,
    ttt_attention_lse,
)
from tests.support.eagle3_small import small_drafter
from tests.support.ttt_cases import grads_of, ttt_inputs


class KVCacheAttention:
    """Naive runner-style attention: a query attends to every cached key plus its own."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.prefill = True

    def __call__(self, layer, q, k, v):
        if layer in self.k:
            self.k[layer] = torch.cat([self.k[layer], k], 1)
            self.v[layer] = torch.cat([self.v[layer], v], 1)
        else:
            self.k[layer], self.v[layer] = k, v
        K, V = expand_kv(self.k[layer], q.shape[2]), expand_kv(self.v[layer], q.shape[2])
        s = torch.einsum("bqhd,bkhd->bhqk", q, K) / q.shape[-1] ** 0.5
        Tq, Tk = q.shape[1], K.shape[1]
        allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(
            Tk - Tq
        )  # causal within the query block
        s = s.masked_fill(~allowed, float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), V)


def naive_chain_logits(d: Eagle3Drafter, ids, aux, pos, anchor: int, steps: int):
    """Logits of steps 0..steps-1 for drafter row `anchor`, one step at a time."""
    attn = KVCacheAttention()
    # Step 0: prefill rows 0..anchor with target features: row j consumes (t_{j+1}, f_j) @ pos_j.
    feat = d.project_features(aux[:, : anchor + 1])
    normed, pre = d(ids[:, 1 : anchor + 2], feat, pos[:, : anchor + 1], attn)
    out = [d.logits(normed[:, -1])]
    carried = pre[:, -1:]
    for k in range(1, steps):
        tok = ids[:, anchor + 1 + k : anchor + 2 + k]  # teacher-forced token t_{anchor+1+k}
        p = pos[:, anchor : anchor + 1] + k  # the k-th chained draft sits at pos_anchor + k
        normed, carried = d(tok, carried, p, attn)
        out.append(d.logits(normed[:, -1]))
    return out


@pytest.mark.parametrize("layers", [1, 2])
def test_ttt_unroll_equals_naive_chain(layers):
    d = small_drafter(layers)
    B, T, steps = 2, 13, 4
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (B, T))
    aux = torch.randn(B, T, 96)
    pos = torch.arange(T).expand(B, T) + torch.tensor([[0], [5]])  # non-zero offset for row 1
    obj = Eagle3Objective(d, Eagle3TrainConfig(ttt_steps=steps), "eager")
    with torch.no_grad():
        unrolled = obj.unroll(ids, aux, pos, steps)
        for anchor in [0, 3, T - 1 - steps]:
            naive = naive_chain_logits(d, ids, aux, pos, anchor, steps)
            for k in range(steps):
                torch.testing.assert_close(unrolled[k][:, anchor], naive[k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_extra", [0, 1, 3])
def test_flex_equals_eager(n_extra):
    torch.manual_seed(n_extra)
    B, T, nh, nkv, D = 2, 19, 4, 2, 8
    q = torch.randn(B, T, nh, D)
    k0, v0 = torch.randn(B, T, nkv, D), torch.randn(B, T, nkv, D)
    extra = [(torch.randn(B, T, nkv, D), torch.randn(B, T, nkv, D)) for _ in range(n_extra)]
    torch.testing.assert_close(
        ttt_attention_flex(q, k0, v0, extra),
        ttt_attention_eager(q, k0, v0, extra),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("n_extra", [0, 1, 3])
@pytest.mark.parametrize("nkv", [2, 4])
def test_flash_equals_eager_values_and_gradients(n_extra, nkv):
    """The causal block by the flash kernel (the CPU one here), the diagonal merged by
    log-sum-exp, and backward through the kernel's backward with the merged output and
    log-sum-exp: every input's gradient equals the explicit softmax's. A merge or a backward
    that dropped the diagonal's share of the normalizer would leave the values right only at
    step 0 and the gradients wrong at every later step."""
    torch.manual_seed(10 + n_extra)
    q, k0, v0, extra, leaves = ttt_inputs(2, 23, 4, nkv, 8, n_extra)
    got = ttt_attention_lse(q, k0, v0, extra)
    want = ttt_attention_eager(q, k0, v0, extra)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    up = torch.randn_like(want)
    grads = grads_of(got, leaves, up)
    for a, b in zip(grads, grads_of(want, leaves, up)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if n_extra:  # the diagonal keys matter: their gradients are not zero
        assert all(g.abs().sum() > 0 for g in grads[3:])


def test_the_objective_trains_the_same_with_flash_and_eager():
    """The whole TTT unroll (4 steps, GQA drafter): the same logits and parameter gradients
    with the flash backend as with the eager one."""
    torch.manual_seed(3)
    ids, aux = torch.randint(0, 97, (2, 11)), torch.randn(2, 11, 96)
    pos = torch.arange(11).expand(2, 11)
    d = small_drafter().train()
    results = []
    for backend in ("eager", "flash"):
        d.zero_grad(set_to_none=True)
        obj = Eagle3Objective(d, Eagle3TrainConfig(ttt_steps=4), backend)
        logits = obj.unroll(ids, aux, pos, 4)
        sum(lg.square().mean() for lg in logits).backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        results.append(([lg.detach() for lg in logits], grads))
    (l_e, g_e), (l_f, g_f) = results
    for a, b in zip(l_f, l_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert g_e.keys() == g_f.keys() and g_e
    for n in g_e:
        torch.testing.assert_close(g_f[n], g_e[n], rtol=1e-4, atol=1e-5, msg=n)


def test_what_the_dense_kernels_take():
    """CUDA's flash / cuDNN kernels take fp16 / bf16 heads of up to 128 (multiples of 8); the
    backends run flex for anything else on CUDA (fp32 training without autocast)."""
    q = torch.empty(1, 4, 8, 128)
    assert not dense_kernel_fits(q)
    assert dense_kernel_fits(q.bfloat16()) and dense_kernel_fits(q.half())
    assert not dense_kernel_fits(torch.empty(1, 4, 8, 256, dtype=torch.bfloat16))
    assert not dense_kernel_fits(torch.empty(1, 4, 8, 36, dtype=torch.bfloat16))


def test_a_dense_kernel_that_raises_gives_way_to_flex_once(monkeypatch):
    """A torch / cuDNN build whose kernel refuses the inputs: the first call warns and runs
    flex, later calls run flex without trying the kernel again. (On the CPU, which has no flex
    backward, the stand-ins here: the eager backend for flex, the CPU treated as a flex device.)"""
    from drafttrain.objectives import ttt

    calls = []

    def refusing(*args):
        calls.append(1)
        raise RuntimeError("no kernel for these inputs")

    monkeypatch.setitem(ttt.CAUSAL_KERNELS, "flash", (refusing, ttt.CAUSAL_KERNELS["flash"][1]))
    monkeypatch.setattr(ttt, "FLEX_DEVICES", {"cpu"})
    monkeypatch.setattr(ttt, "ttt_attention_flex", ttt_attention_eager)
    monkeypatch.setattr(ttt, "_REFUSED", set())
    monkeypatch.setattr(ttt, "dense_kernel_fits", lambda q: True)
    q, k0, v0, extra, _ = ttt_inputs(1, 9, 4, 2, 8, 2)
    with pytest.warns(UserWarning, match="flash kernel failed .* flex from now on"):
        got = ttt_attention_lse(q, k0, v0, extra)
    torch.testing.assert_close(got, ttt_attention_eager(q, k0, v0, extra))
    ttt_attention_lse(q, k0, v0, extra)
    assert len(calls) == 1  # not tried again


def test_backend_names():
    assert pick_backend("auto", torch.device("cpu")) == "eager"
    assert pick_backend("flash", torch.device("cpu")) == "flash"
    assert pick_backend("cudnn") == "cudnn"  # the name alone: valid
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        pick_backend("cudnn", torch.device("cpu"))
    with pytest.raises(ConfigError, match="auto or one of eager, flex, flash, cudnn"):
        pick_backend("fast")


def test_eager_backward_runs_on_cpu():
    d = small_drafter().train()
    obj = Eagle3Objective(d, Eagle3TrainConfig(ttt_steps=3), "eager")
    ids = torch.randint(0, 97, (1, 9))
    logits = obj.unroll(ids, torch.randn(1, 9, 96), torch.arange(9)[None], 3)
    sum(lg.square().mean() for lg in logits).backward()
    assert d.fc.weight.grad is not None and d.fc.weight.grad.abs().sum() > 0
    assert d.embed_tokens.weight.grad is None  # shared target embedding stays frozen
