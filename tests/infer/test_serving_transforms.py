"""Serving transforms of native targets (`draftinfer.models.transforms`) change how a step
runs, never what it computes: fused q/k/v and gate/up projections, the `maths_decode`
attention backend, the single-row cache view, the skinny-GEMM kernel. Exact or fp32-tight against the untransformed
model, through the HF-named loader and state dict."""

from __future__ import annotations

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.decoding.baseline import greedy_generate
from draftinfer.files.loading import load_native_target, load_weights
from draftinfer.models.decoder import DecoderLayer, NativeCausalLM, NativeConfig
from draftinfer.models.kv_cache import (
    ATTENTION,
    cached_attention,
    decode_attention,
    read_rows,
    visibility_mask,
    write_index,
)
from draftinfer.models.target import FeatureSpec
from draftinfer.models.transforms import (
    FusedQKVAttention,
    FusedSwiGLU,
    NormFusedDecoderLayer,
    SkinnyLinear,
    fuse_projections,
    gate_up_product,
    use_attention,
    use_skinny_gemm,
)

ATOL = 1e-5  # fp32, the same maths in another order


pytestmark = pytest.mark.usefixtures("one_thread")


def _biased_model(seed: int = 0) -> NativeCausalLM:
    """A Qwen2-like tiny model with biases on q/k/v and the MLP (the fused biases)."""
    cfg = NativeConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        qkv_bias=True,
        mlp_bias=True,
    )
    torch.manual_seed(seed)
    model = NativeCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.requires_grad_(False).eval()
    model.setup_caches(3, 40)
    return model


def _forward(model, ids, pos, rows, attn_len=None, features=None):
    dev = model.lm_head.weight.device

    def t(x):
        return torch.tensor(x, device=dev)

    return model(t(ids), Slots(t(rows), t(pos), attn_len=attn_len), features)


def _prefill_and_decode(model):
    """Logits and features of a ragged prefill (a padding slot) then a one-token decode
    in permuted rows: the cache paths the runner uses."""
    feats = FeatureSpec((0, 1), "post_norm")
    a = _forward(model, [[5, 6, 7, 8], [9, 10, 11, 0]], [[0, 1, 2, 3], [0, 1, 2, -1]], [2, 0])
    b = _forward(model, [[12], [13]], [[4], [3]], [2, 0], attn_len=16, features=feats)
    return a.logits, b.logits, b.features


def test_decode_attention_equals_sdpa():
    """The plain-maths one-token attention equals the SDPA path on a ragged batch (GQA
    group 3, a prime attention length, a padding slot, rows out of order)."""
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, d, max_len, L = 3, 6, 2, 8, 40, 37
    k_cache = torch.randn(4, max_len + 1, nkv, d, generator=g)
    v_cache = torch.randn(4, max_len + 1, nkv, d, generator=g)
    q = torch.randn(B, 1, nh, d, generator=g)
    k, v = torch.randn(B, 1, nkv, d, generator=g), torch.randn(B, 1, nkv, d, generator=g)
    rows = torch.tensor([3, 0, 1])
    cache_pos = torch.tensor([[20], [36], [-1]])
    mask = visibility_mask(cache_pos, L, nh // nkv)
    write_pos = write_index(cache_pos, max_len)
    kc1, vc1 = k_cache.clone(), v_cache.clone()
    want = cached_attention(q, k, v, kc1, vc1, rows, write_pos, mask, L)
    got = decode_attention(q, read_rows(kc1, rows, L), read_rows(vc1, rows, L), mask)
    torch.testing.assert_close(got[:2], want[:2], atol=ATOL, rtol=0)
    assert torch.isfinite(got).all()  # the padding row reads index 0 only


def test_single_row_cache_is_read_as_a_view():
    cache = torch.randn(1, 9, 2, 4)
    view = read_rows(cache, torch.tensor([0]), 5)
    assert view.data_ptr() == cache.data_ptr() and view.shape == (1, 5, 2, 4)
    two = torch.randn(2, 9, 2, 4)
    torch.testing.assert_close(read_rows(two, torch.tensor([1]), 5), two[1:, :5])


@pytest.mark.parametrize("which", ["tiny_llama3_dir", "tiny_qwen3_dir"])
def test_fused_projections_keep_names_weights_and_outputs(which, request):
    path = request.getfixturevalue(which)
    model = load_native_target(path, "cpu", torch.float32, 4, 32)
    want = _prefill_and_decode(model)
    names = list(model.state_dict())
    shared = model.shared_weights()
    model = load_native_target(path, "cpu", torch.float32, 4, 32)
    fuse_projections(model)
    assert all(isinstance(layer.self_attn, FusedQKVAttention) for layer in model.model.layers)
    assert all(isinstance(layer.mlp, FusedSwiGLU) for layer in model.model.layers)
    assert list(model.state_dict()) == names  # HF names; the fused tensors are not saved
    for role, w in model.shared_weights().items():
        assert torch.equal(w, shared[role])
    got = _prefill_and_decode(model)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


def test_fused_projections_with_biases_and_a_later_load(tmp_path):
    """Biases fuse too; the loader writes through the HF-named views into the fused
    tensors (a checkpoint loaded after fusing gives the checkpoint's outputs)."""
    from safetensors.torch import save_file

    src = _biased_model(seed=1)
    want = _prefill_and_decode(src)
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, tmp_path / "m.safetensors")
    model = _biased_model(seed=2)
    fuse_projections(model)
    fuse_projections(model)  # idempotent: re-fuses from the current weights
    load_weights(model, [tmp_path / "m.safetensors"])
    model.setup_caches(3, 40)
    got = _prefill_and_decode(model)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


def test_maths_decode_backend_traced_matches_eager(tiny_llama3_dir):
    """`maths_decode` under torch.compile (aot_eager: the traced one-token attention) decodes
    the same greedy tokens as eager SDPA, fused or not; prefill stays on SDPA."""
    prompts = [[5, 9, 11], [7, 3], [4, 4, 8, 15, 16]]
    eager = load_native_target(tiny_llama3_dir, "cpu", torch.float32, 4, 32)
    ref = greedy_generate(eager, prompts, 6, [])
    torch._dynamo.reset()
    for fuse in (False, True):
        model = load_native_target(tiny_llama3_dir, "cpu", torch.float32, 4, 32)
        if fuse:
            fuse_projections(model)
        use_attention(model, "maths_decode")
        step = torch.compile(
            lambda i, p, r, a, m=model: m(i, Slots(r, p, attn_len=32)).logits,
            backend="aot_eager",
            dynamic=False,
        )
        assert greedy_generate(model, prompts, 6, [], step_fn=step) == ref
        first = torch.tensor([[3], [5]]), torch.tensor([[3], [2]]), torch.tensor([0, 1])
        torch.testing.assert_close(
            step(*first, 32),
            model(first[0], Slots(first[2], first[1], attn_len=32)).logits,
            atol=ATOL,
            rtol=0,
        )
    torch._dynamo.reset()


def test_use_attention_names_the_backends(tiny_llama3_dir):
    model = load_native_target(tiny_llama3_dir, "cpu", torch.float32, 1, 16)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*sdpa"):
        use_attention(model, "flash")
    use_attention(model, "maths_decode")
    assert all(
        layer.self_attn.attention is ATTENTION["maths_decode"] for layer in model.model.layers
    )


def test_skinny_gemm_swaps_every_linear_and_back(tiny_llama3_dir):
    """Every `nn.Linear` becomes a `SkinnyLinear` (same names, same weights) and the fused
    projections take the kernel's `linear`; on the CPU that is `F.linear`, so the outputs are
    the same bits; `on=False` restores the modules."""
    import draftkernels.skinny_gemm as skinny
    import torch.nn.functional as F

    model = load_native_target(tiny_llama3_dir, "cpu", torch.float32, 4, 32)
    fuse_projections(model)
    want = _prefill_and_decode(model)
    names = list(model.state_dict())
    use_skinny_gemm(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is SkinnyLinear for m in linears)
    assert all(layer.self_attn.linear is skinny.linear for layer in model.model.layers)
    assert all(layer.mlp.product is skinny.swiglu for layer in model.model.layers)
    assert list(model.state_dict()) == names
    for x, y in zip(_prefill_and_decode(model), want):
        assert torch.equal(x, y)
    use_skinny_gemm(model, on=False)
    assert all(type(m) is torch.nn.Linear for m in linears)
    assert all(layer.mlp.product is gate_up_product for layer in model.model.layers)
    assert all(layer.self_attn.linear is F.linear for layer in model.model.layers)


@pytest.mark.parametrize(
    "device,compile_,setting,before,want",
    [
        ("cuda", True, None, False, True),
        ("cuda", False, None, False, False),
        ("cuda", False, None, True, True),
        ("cpu", True, None, False, False),
        ("cuda", True, False, True, False),
        ("cuda", False, True, False, True),
    ],
)
def test_the_runner_launches_with_pdl_when_it_compiles_on_cuda(
    device, compile_, setting, before, want, monkeypatch
):
    """`InferConfig.pdl`: null = programmatic dependent launch on for CUDA with `compile`,
    ours and inductor's together (`serving_transforms`; the launch itself is checked on a GPU
    by the kernels' `-k pdl` tests and the rounds' tests); eager or on the CPU the switch
    stays as the process set it (`DRAFTKERNELS_PDL`); `pdl=false` / `pdl=true` force it."""
    import torch._inductor.config as inductor_config
    from draftkernels import runtime

    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.run import serving_transforms

    assert "triton.enable_pdl" in inductor_config.get_config_copy()  # this torch has it
    monkeypatch.setitem(runtime.PDL, "on", before)
    cfg = InferConfig(
        drafter="d", pdl=setting, compile=compile_, fuse_projections=False, skinny_gemm=False
    )
    # inductor's own patch API (restored on exit), not attribute monkeypatching of its config
    # module, whose proxies pytest's monkeypatch does not handle on every version.
    with inductor_config.patch({"triton.enable_pdl": before}):
        serving_transforms(cfg, None, None, torch.device(device))
        assert runtime.PDL["on"] is want and inductor_config.triton.enable_pdl is want


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's fp32 kernel")
def test_norm_fused_layers_run_the_norms_and_adds_in_the_gemms(monkeypatch):
    """`use_skinny_gemm` turns a target's decoder layers (fused projections; on CUDA in
    bf16/fp16, here allowed on the CPU in fp32) into `NormFusedDecoderLayer`: each norm's
    weight folded into its projection (ones left in the norm); off the kernel the plain
    layer's outputs within fp32 rounding (only the fold's rounding differs); on the kernel
    (the Triton interpreter: the rows of a prefill, a two-row and a one-row decode) every
    GEMM of a layer takes its norm or its residual inside the launch -- counted -- with the
    same outputs. `norms=False` and `on=False` restore the plain layers, weights folded."""
    from draftinfer.models import transforms
    from tests.support.utils import import_kernel_module

    skinny = import_kernel_module("draftkernels.skinny_gemm")
    model = _biased_model(seed=5)
    fuse_projections(model)

    def run():  # the prefill and a two-row decode, then row 2's next token alone
        both = _prefill_and_decode(model)
        return (*both, _forward(model, [[14]], [[5]], [2], attn_len=16).logits)

    def close(got, want):
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, atol=1e-4 * y.abs().max().item(), rtol=1e-4)

    want = run()
    layer = model.model.layers[0]
    g1 = layer.input_layernorm.weight.clone()
    w_qkv = layer.self_attn.qkv_weight.clone()
    use_skinny_gemm(model)
    assert all(type(layer) is DecoderLayer for layer in model.model.layers)  # the CPU, fp32
    monkeypatch.setattr(transforms, "norms_fusable", lambda layer: True)
    use_skinny_gemm(model)
    assert all(type(layer) is NormFusedDecoderLayer for layer in model.model.layers)
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(g1))
    assert torch.equal(layer.self_attn.qkv_weight, w_qkv * g1)
    assert torch.equal(layer.self_attn.q_proj.weight, (w_qkv * g1)[: g1.shape[0]])  # the views
    close(run(), want)  # the CPU: no kernel

    calls = []
    launch = skinny._launch
    monkeypatch.setattr(skinny, "_takes_kernel", skinny.supports)  # fp32, one row too
    monkeypatch.setattr(
        skinny,
        "_launch",
        lambda x, *a, **k: (
            calls.append((x.shape[0], "eps" in k, "residual" in k)) or launch(x, *a, **k)
        ),
    )
    close(run(), want)
    rows = {m for m, *_ in calls}
    assert {1, 2, 8} <= rows, calls  # the one-row and the MMA paths
    for m in rows:  # per forward and layer: q/k/v and gate/up normed, o and down added
        kinds = [c[1:] for c in calls if c[0] == m]
        assert kinds.count((True, False)) == kinds.count((False, True)) > 0, (m, kinds)
    use_skinny_gemm(model, norms=False)
    assert all(type(layer) is DecoderLayer for layer in model.model.layers)
    use_skinny_gemm(model)
    use_skinny_gemm(model, on=False)
    assert all(type(layer) is DecoderLayer for layer in model.model.layers)
    assert torch.equal(layer.self_attn.qkv_weight, w_qkv * g1)  # folded once


def test_weights_loaded_into_a_norm_fused_model_are_folded_again(tmp_path, monkeypatch):
    """`load_weights` into a model whose layers fold their norms (the checkpoint's own
    projections and norm weights written through the views) folds again: the checkpoint's
    outputs, not its projections with the norms' weights dropped."""
    from safetensors.torch import save_file

    from draftinfer.models import transforms

    src = _biased_model(seed=1)
    want = _prefill_and_decode(src)
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, tmp_path / "m.safetensors")
    model = _biased_model(seed=2)
    fuse_projections(model)
    monkeypatch.setattr(transforms, "norms_fusable", lambda layer: True)
    use_skinny_gemm(model)
    load_weights(model, [tmp_path / "m.safetensors"])
    layer = model.model.layers[1]
    assert torch.equal(layer.post_attention_layernorm.weight, torch.ones(48))
    model.setup_caches(3, 40)
    for x, y in zip(_prefill_and_decode(model), want):
        torch.testing.assert_close(x, y, atol=1e-4 * y.abs().max().item(), rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_skinny_gemm_serves_the_same_logits_on_cuda(monkeypatch):
    """bf16 on CUDA: the GEMMs of the 8-row prefill and the 2-row decode (biases too) run the
    kernel -- counted -- and the logits stay within bf16 rounding of cuBLAS's."""
    import draftkernels.skinny_gemm as skinny

    model = _biased_model(seed=3).to("cuda", torch.bfloat16)
    model.setup_caches(3, 40)
    fuse_projections(model)
    want = _prefill_and_decode(model)
    monkeypatch.setattr(skinny, "MIN_COLS_MMA", 0)  # this tiny model's GEMMs are narrow
    calls = []
    launch = skinny._launch
    monkeypatch.setattr(
        skinny, "_launch", lambda *a, **k: calls.append(a[0].shape) or launch(*a, **k)
    )
    use_skinny_gemm(model)
    got = _prefill_and_decode(model)
    assert calls and all(shape[0] <= skinny.MAX_ROWS for shape in calls)
    for x, y in zip(got, want):
        scale = y.float().abs().max().item()
        torch.testing.assert_close(x.float(), y.float(), atol=3e-2 * scale, rtol=0)
