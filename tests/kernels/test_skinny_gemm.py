"""The skinny GEMM (`draftkernels.skinny_gemm`): kernel == reference == `F.linear` (the oracle
that is not this module) on both paths (one row: multiply-accumulate; 2..16 rows: MMA), with
and without bias, shapes that do and do not divide the tiles, every config class; `linear`
takes the kernel only where it fits (CPU: Triton interpreter in fp32 and fp16 -- the
interpreter's bf16 dot is wrong --; CUDA: bf16, and inside `torch.compile` + a CUDA graph)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from draftkernels.runtime import use_triton

from tests.support.utils import import_kernel_module, kernel_test_device, poison_empty  # noqa: F401

sg = import_kernel_module("draftkernels.skinny_gemm")
DEVICE = kernel_test_device()
DTYPES = [torch.float32, torch.float16] if DEVICE.type == "cpu" else [torch.bfloat16]


def make(M, N, K, dtype, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5
    b = torch.randn(N, generator=g) if bias else None
    to = dict(device=DEVICE, dtype=dtype)
    return x.to(**to), w.to(**to), None if b is None else b.to(**to)


def oracle(x, w, b):
    """`F.linear` in fp32 (on the CPU: torch's own GEMM, not this module's maths)."""
    return F.linear(x.float().cpu(), w.float().cpu(), None if b is None else b.float().cpu())


def tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


CASES = [
    # M, N, K, bias, config (BLOCK_N, BLOCK_K, warps, stages[, swap])
    (1, 64, 256, False, (8, 64, 4, 1)),  # one row, tiles divide: no masks
    (1, 37, 300, True, (8, 64, 4, 1)),  # one row, ragged N and K, bias
    (1, 16, 128, False, (16, 128, 4, 3)),  # one tile of K
    (2, 64, 256, False, (16, 64, 4, 2)),  # MMA path, tiles divide
    (5, 70, 200, True, (32, 64, 4, 3)),  # a verify of five slots, ragged, bias
    (16, 48, 96, False, (16, 32, 4, 2)),  # the largest row count
    (2, 64, 256, False, (64, 64, 4, 2, True)),  # swapped MMA (W x^T), tiles divide
    (5, 70, 200, True, (64, 64, 4, 3, True)),  # swapped, ragged, bias
    (16, 130, 96, False, (64, 32, 4, 2, True)),  # swapped, the largest row count, 3 programs
    (1, 64, 256, True, (8, 64, 4, 1, True)),  # swap is ignored at one row
    (2, 64, 256, False, (64, 64, 4, 2, "tma")),  # copy-engine loads, tiles divide
    (5, 70, 200, True, (64, 64, 4, 3, "tma")),  # copy-engine loads, ragged N and K, bias
    (16, 130, 96, False, (64, 32, 4, 2, "tma")),  # the largest row count, 3 programs
    (3, 130, 300, False, (64, 32, 4, 2, "tma")),  # copy-engine loads, three rows
    (16, 64, 256, True, (16, 64, 4, 2, False)),  # unswapped MMA, bias
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "x".join(map(str, c[:4])) + "".join(f"-{v}" for v in c[4][4:])
)
def test_kernel_and_reference_match_f_linear(case, dtype, poison_empty):  # noqa: F811
    M, N, K, bias, cfg = case
    x, w, b = make(M, N, K, dtype, bias)
    want = oracle(x, w, b)
    got = sg._launch(x, w, b, cfg)
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(sg.skinny_gemm_ref(x, w, b).float().cpu(), want, **tol(dtype))
    torch.testing.assert_close(got.float().cpu(), want, **tol(dtype))


@pytest.mark.parametrize("variant", [False, True, "tma"], ids=["mma", "swap", "tma"])
def test_every_row_count_with_and_without_bias(variant):
    """2..16 rows at 64 columns a program and 4 warps (the narrow shapes' tile), with and
    without bias: an in-kernel epilogue once lost rows 2-3 of some row counts on an H100
    (split K, since removed) while 5 and 16 rows were right."""
    dtype = DTYPES[-1]
    for M in range(2, 17):
        for bias in (False, True):
            x, w, b = make(M, 192, 256, dtype, bias=bias, seed=M)
            got = sg._launch(x, w, b, (64 if variant else 16, 128, 4, 2, variant))
            torch.testing.assert_close(
                got.float().cpu(), oracle(x, w, b), **tol(dtype), msg=f"M={M} bias={bias}"
            )


def swiglu_oracle(x, w, b):
    """SwiGLU's product of `F.linear` in fp32 on the CPU (gate rows, then up rows)."""
    gate, up = oracle(x, w, b).chunk(2, dim=-1)
    return F.silu(gate) * up


SWIGLU_CASES = [
    # M, N (= 2 I), K, bias, config of the fused gate/up weight
    (1, 128, 256, False, (8, 64, 4, 1)),  # one row, tiles divide
    (1, 74, 300, True, (8, 64, 4, 1)),  # one row, ragged I and K, bias
    (4, 256, 256, True, (128, 64, 4, 2, True)),  # swapped MMA (64 columns a program)
    (5, 140, 200, False, (64, 64, 4, 3, True)),  # swapped, ragged
    (3, 260, 96, True, (64, 32, 4, 2, "tma")),  # "tma" config: the swapped pointer path
    (16, 96, 96, False, (32, 32, 4, 2)),  # unswapped MMA, 16 rows
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case",
    SWIGLU_CASES,
    ids=lambda c: "x".join(map(str, c[:4])) + "".join(f"-{v}" for v in c[4][4:]),
)
def test_swiglu_epilogue_matches_the_unfused_product(case, dtype, poison_empty):  # noqa: F811
    """`silu(gate) * up` as the GEMM's epilogue: kernel == reference == F.linear then the
    product in fp32 (`swiglu_oracle`), each path and variant."""
    M, N, K, bias, cfg = case
    x, w, b = make(M, N, K, dtype, bias)
    want = swiglu_oracle(x, w, b)
    got = sg._launch(x, w, b, cfg, swiglu=True)
    assert got.dtype == dtype and got.shape == (M, N // 2)
    torch.testing.assert_close(sg.skinny_swiglu_ref(x, w, b).float().cpu(), want, **tol(dtype))
    torch.testing.assert_close(got.float().cpu(), want, **tol(dtype))
    torch.testing.assert_close(sg.skinny_swiglu(x, w, b).float().cpu(), want, **tol(dtype))


def test_swiglu_off_the_kernel_is_the_modules_maths():
    """On the CPU `swiglu` is F.linear, the halves, `F.silu(gate) * up`: the same bits."""
    x, w, b = make(5, 40, 64, torch.float32, bias=True)
    gate, up = F.linear(x.cpu(), w.cpu(), b.cpu()).chunk(2, dim=-1)
    assert torch.equal(sg.swiglu(x.cpu(), w.cpu(), b.cpu()), F.silu(gate) * up)
    with pytest.raises(ValueError, match="even row count"):
        sg.skinny_swiglu(x, w[:-1], None)


def test_tma_variant_falls_back_where_the_copy_engine_cannot():
    """An x row stride that is not a multiple of 16 bytes (a column slice): the "tma" config
    runs the swapped path instead, with the same result."""
    dtype = DTYPES[-1]
    x, w, b = make(3, 64, 200, dtype, bias=True, seed=5)
    wide = torch.zeros(3, 203, dtype=dtype, device=DEVICE)
    wide[:, :200] = x
    xs = wide[:, :200]  # row stride 203 elements
    assert not sg.tma_ok(xs, w) and (sg.TensorDescriptor is None or sg.tma_ok(x, w))
    got = sg._launch(xs, w, b, (64, 64, 4, 2, "tma"))
    torch.testing.assert_close(got.float().cpu(), oracle(x, w, b), **tol(dtype))


def test_default_configs_and_custom_op_match():
    dtype = DTYPES[-1]
    for M in (1, 3):
        x, w, b = make(M, 96, 1100, dtype, bias=True, seed=M)
        torch.testing.assert_close(
            sg.skinny_gemm(x, w, b).float().cpu(), oracle(x, w, b), **tol(dtype)
        )


def test_config_table_is_consulted(monkeypatch):
    monkeypatch.setitem(sg.TABLE, (1, 96, 512), (4, 128, 4, 1))
    assert sg.config(1, 96, 512) == (4, 128, 4, 1)
    assert sg.config(2, 96, 512) == sg.DEFAULT["m16"]
    assert sg.config(1, 97, 512) == sg.DEFAULT[1]


def test_linear_takes_the_kernel_only_where_it_fits():
    x16 = torch.zeros(2, 3, 64, dtype=torch.float16)
    w16 = torch.zeros(sg.MIN_COLS_MMA, 64, dtype=torch.float16)
    assert sg.fits(x16, w16)  # 6 rows, 16-bit
    assert not sg.fits(torch.zeros(3, 6, 64, dtype=torch.float16), w16)  # 18 rows
    assert not sg.fits(x16, w16[:-1])  # several rows: too few columns for the MMA path
    assert sg.fits(x16[:1, :1], w16[:32])  # one row: any width
    assert not sg.fits(x16.float(), w16.float())  # fp32 models keep cuBLAS
    assert not sg.fits(x16, w16.t().contiguous().t()[:, :64])  # weight not unit-stride in K
    # On the CPU `linear` is F.linear (the kernel is for CUDA); its shape is F.linear's.
    x, w, b = make(5, 40, 64, torch.float32, bias=True)
    y = sg.linear(x.view(1, 5, 64).cpu(), w.cpu(), b.cpu())
    assert y.shape == (1, 5, 40)
    torch.testing.assert_close(y[0], oracle(x, w, b))


def test_the_kernel_runs_here():
    x, w, _ = make(1, 16, 32, DTYPES[-1])
    assert use_triton(torch.device(DEVICE)) and sg.supports(x, w)


def test_rejects_bad_inputs():
    x, w, b = make(2, 16, 32, torch.float32, bias=True)
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        sg.skinny_gemm(x, w[:, :31], None)
    with pytest.raises(ValueError, match="bias must be"):
        sg.skinny_gemm(x, w, b[:-1])
    with pytest.raises(ValueError, match="share a dtype"):
        sg.skinny_gemm(x, w.half(), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 3, 4, 5, 8, 16])
def test_real_shapes_compiled_and_graph_captured(M):
    """Llama-3.1-8B's fused q/k/v and down projections and a block drafter's fused context
    k/v through `linear` under `torch.compile(fullgraph=True)`, replayed from a CUDA graph
    three times, == F.linear in fp32, with the table's configs."""
    torch._dynamo.reset()
    fn = torch.compile(sg.linear, fullgraph=True)
    for N, K in ((6144, 4096), (4096, 14336), (2048, 4096)):
        x, w, b = make(M, N, K, torch.bfloat16)
        x = x.view(1, M, K)
        want = oracle(x[0], w, b)
        fn(x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(x, w)
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out[0].float().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 4, 5, 8, 16])
def test_swiglu_at_llama_shape_compiled_and_graph_captured(M):
    """Llama-3.1-8B's fused gate/up `[28672, 4096]` with the SwiGLU epilogue under
    `torch.compile(fullgraph=True)`, replayed from a CUDA graph, == the fp32 product."""
    torch._dynamo.reset()
    fn = torch.compile(sg.swiglu, fullgraph=True)
    x, w, b = make(M, 28672, 4096, torch.bfloat16, seed=M)
    want = swiglu_oracle(x, w, b)
    fn(x.view(1, M, -1), w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x.view(1, M, -1), w)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out[0].float().cpu(), want, atol=2e-2, rtol=2e-2)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_enable_pdl_turns_ours_and_inductors_on_together(monkeypatch):
    """`enable_pdl` sets this package's switch and inductor's together (ours alone, between
    inductor kernels launched the usual way, measured slower), and back off; a CPU or
    interpreted launch never uses it."""
    import torch._inductor.config as inductor_config
    from draftkernels import runtime

    assert "triton.enable_pdl" in inductor_config.get_config_copy()  # this torch has it
    monkeypatch.setitem(runtime.PDL, "on", False)
    with inductor_config.patch({"triton.enable_pdl": False}):  # restored on exit
        runtime.enable_pdl()
        assert runtime.PDL["on"] and inductor_config.triton.enable_pdl
        assert not runtime.pdl(torch.device("cpu"))
        runtime.enable_pdl(False)
        assert not runtime.PDL["on"] and not inductor_config.triton.enable_pdl


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter, PDL's waits as no-ops")
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "x".join(map(str, c[:4])) + "".join(f"-{v}" for v in c[4][4:])
)
def test_pdl_branches_compute_what_the_plain_launch_does(case, monkeypatch):
    """The kernels' PDL branches (the one-row path's first weight tile read before the wait
    and its loop from the second tile; the MMA, swapped and copy-engine paths waiting first;
    with SwiGLU's up rows, the norm's sums of squares, the residual) give the plain launch's
    bits, tiles that do and do not divide included. The interpreter has no `griddepcontrol`:
    the wait is a no-op here and the ordering itself is checked on a Hopper GPU
    (`test_pdl_launch_gives_the_same_bits_in_a_chain`)."""
    import triton.language.extra.cuda as cuda_ext

    monkeypatch.setattr(cuda_ext, "gdc_wait", lambda *a, **k: None)
    monkeypatch.setattr(cuda_ext, "gdc_launch_dependents", lambda *a, **k: None)
    M, N, K, bias, cfg = case
    x, w, b = make(M, N, K, torch.float32, bias)
    r = torch.randn(M, N, generator=torch.Generator().manual_seed(3))
    outs = []
    for on in (False, True):
        monkeypatch.setattr(sg, "pdl", lambda device, on=on: on)
        ys = [sg._launch(x, w, b, cfg), sg._launch(x, w, b, cfg, eps=1e-5)]
        ys.append(sg._launch(x, w, b, cfg, residual=r))
        if N % 2 == 0:
            ys.append(sg._launch(x, w, b, cfg, swiglu=True))
        outs.append(ys)
    for i, (a, c) in enumerate(zip(*outs)):
        assert torch.equal(a, c), i


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (or later) GPU")
@pytest.mark.parametrize("M", [1, 4, 8])
def test_pdl_launch_gives_the_same_bits_in_a_chain(M, monkeypatch):
    """Launched with programmatic dependent launch (`runtime.PDL`; the one-row path reads its
    first weight tile before the wait) the kernel returns the bits it returns without, on
    Llama-3.1-8B's shapes, SwiGLU's epilogue, the norm and the residual modes; and a chain of
    four GEMMs, each reading the one before it, replayed from a CUDA graph on new inputs,
    gives the chain's bits without PDL (a read before the previous kernel's write would see
    the last replay's values)."""
    from draftkernels.runtime import PDL

    def launches(x, w, r):
        ys = [sg._launch(x, w, None), sg._launch(x, w, None, eps=1e-5)]
        ys.append(sg._launch(x, w, None, residual=r))
        if M > 1:
            ys += [
                sg._launch(x, w, None, swiglu=True),
                sg._launch(x, w, None, swiglu=True, eps=1e-5),
            ]
        return ys

    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
    for N, K in shapes:
        x, w, _ = make(M, N, K, torch.bfloat16, seed=N)
        r = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
        monkeypatch.setitem(PDL, "on", False)
        want = launches(x, w, r)
        monkeypatch.setitem(PDL, "on", True)
        got = launches(x, w, r)
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), (N, K, M, i)
    ws = [make(1, 4096, 4096, torch.bfloat16, seed=s)[1] for s in range(4)]

    def chain(x):
        for w in ws:
            x = sg.skinny_gemm(x, w, None)  # one kernel after the other (weights 1/sqrt(K))
        return x

    x = torch.randn(M, 4096, device=DEVICE, dtype=torch.bfloat16)
    chain(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for s in range(3):
        x.copy_(torch.randn(M, 4096, generator=torch.Generator().manual_seed(s)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setitem(PDL, "on", False)
        assert torch.equal(out, chain(x)), s
        monkeypatch.setitem(PDL, "on", True)


# ---- the RMSNorm inside the GEMM and the residual epilogue ---------------------------------
def norm_oracle(x, eps, w, b):
    """RMS normalisation (no weight: folded into w) then `F.linear`, in fp32 on the CPU
    (torch's maths, not the kernel's order)."""
    xf = x.float().cpu()
    return oracle(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), w, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "x".join(map(str, c[:4])) + "".join(f"-{v}" for v in c[4][4:])
)
def test_norm_and_residual_epilogue_match_the_unfused_maths(case, dtype):
    """`eps`: the rows' sums of squares taken from the tiles the GEMM reads, the outputs
    scaled by 1 / rms == RMS normalisation then F.linear (`norm_oracle`) and == the
    reference, on every path and variant ("tma" takes the swapped pointer path);
    `residual`: the GEMM's output rounded, plus the residual, rounded once: the bits of the
    unfused GEMM then add (16-bit), the reference within fp32 rounding."""
    M, N, K, bias, cfg = case
    x, w, b = make(M, N, K, dtype, bias)
    x = x * 3  # rms away from 1
    want = norm_oracle(x, 1e-5, w, b)
    got = sg._launch(x, w, b, cfg, eps=1e-5)
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(
        sg.skinny_rms_gemm_ref(x, 1e-5, w, b).float().cpu(), want, **tol(dtype)
    )
    torch.testing.assert_close(got.float().cpu(), want, **tol(dtype))
    r = torch.randn(M, N, generator=torch.Generator().manual_seed(7)).to(x)
    got = sg._launch(x, w, b, cfg, residual=r)
    unfused = (sg._launch(x, w, b, cfg).float() + r.float()).to(dtype)
    if dtype != torch.float32:
        assert torch.equal(got, unfused)
    torch.testing.assert_close(
        got.float(), sg.skinny_gemm_add_ref(x, w, b, r).float(), **tol(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case",
    SWIGLU_CASES,
    ids=lambda c: "x".join(map(str, c[:4])) + "".join(f"-{v}" for v in c[4][4:]),
)
def test_norm_with_the_swiglu_epilogue(case, dtype):
    """RMS normalisation, the fused gate/up GEMM and SwiGLU's product in one launch == the
    three unfused in fp32, each path and variant."""
    M, N, K, bias, cfg = case
    x, w, b = make(M, N, K, dtype, bias)
    gate, up = norm_oracle(x, 1e-6, w, b).chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = sg._launch(x, w, b, cfg, swiglu=True, eps=1e-6)
    torch.testing.assert_close(got.float().cpu(), want, **tol(dtype))
    ref = sg.skinny_rms_swiglu_ref(x, 1e-6, w, b)
    torch.testing.assert_close(ref.float().cpu(), want, **tol(dtype))
    torch.testing.assert_close(
        sg.skinny_rms_swiglu(x, 1e-6, w, b).float().cpu(), want, **tol(dtype)
    )


def test_norm_and_add_off_the_kernel_are_the_modules_maths():
    """`rms_norm_ref` is the RMSNorm module's maths (`draftinfer.models.layers.RMSNorm`, the same
    bits, with a weight and with a unit one for a folded weight); on the CPU `rms_linear`,
    `rms_swiglu` and `linear_add` are that norm with unit weight, `F.linear`, the product
    and the add: the same bits (what the norm-fused decoder layer runs at prefill); a
    residual of the wrong shape raises."""
    from draftinfer.models.layers import RMSNorm

    x, w, b = make(5, 40, 64, torch.float32, bias=True)
    x, w, b = x.cpu().bfloat16() * 4, w.cpu().bfloat16(), b.cpu().bfloat16()
    norm = RMSNorm(64, 1e-6).bfloat16()
    with torch.no_grad():
        unit = norm(x)
        norm.weight.normal_(1.0, 0.3)
        weighted = norm(x)
    assert torch.equal(sg.rms_norm_ref(x, norm.weight, 1e-6), weighted)
    assert torch.equal(sg.rms_norm_ref(x, None, 1e-6), unit)
    assert torch.equal(sg.rms_linear(x, 1e-6, w, b), F.linear(unit, w, b))
    gate, up = F.linear(unit, w, b).chunk(2, dim=-1)
    assert torch.equal(sg.rms_swiglu(x, 1e-6, w, b), F.silu(gate) * up)
    r = torch.randn(5, 40).bfloat16()
    assert torch.equal(sg.linear_add(x, w, b, r), r + F.linear(x, w, b))
    with pytest.raises(ValueError, match="residual must be"):
        sg.skinny_gemm_add(x, w, b, r[:, :-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 4, 8, 16])
def test_norm_and_add_at_llama_shapes_compiled_and_graph_captured(M):
    """A Llama-3.1-8B layer's four fused launches (q/k/v and gate/up with the norm, o and
    down with the residual; one row: the unfused pieces) through `rms_linear`, `rms_swiglu`
    and `linear_add` under `torch.compile(fullgraph=True)`, replayed from a CUDA graph, ==
    the unfused maths in fp32 (bf16 tolerance)."""
    torch._dynamo.reset()
    x, wqkv, _ = make(M, 6144, 4096, torch.bfloat16, seed=M)
    _, wgu, _ = make(1, 28672, 4096, torch.bfloat16, seed=M + 1)
    _, wo, _ = make(1, 4096, 4096, torch.bfloat16, seed=M + 2)
    _, wd, _ = make(1, 4096, 14336, torch.bfloat16, seed=M + 3)
    o = torch.randn(M, 4096, generator=torch.Generator().manual_seed(9)).to(x)
    mid = torch.randn(M, 14336, generator=torch.Generator().manual_seed(10)).to(x)
    x = x * 5

    def layer(x, o, mid):
        qkv = sg.rms_linear(x, 1e-5, wqkv)
        h = sg.linear_add(o, wo, None, x)
        return qkv, h, sg.rms_swiglu(h, 1e-5, wgu), sg.linear_add(mid, wd, None, h)

    h = layer(x, o, mid)[1].float().cpu()
    gate, up = norm_oracle(h, 1e-5, wgu, None).chunk(2, dim=-1)
    wants = (
        norm_oracle(x, 1e-5, wqkv, None),
        x.float().cpu() + oracle(o, wo, None),
        F.silu(gate) * up,
        h + oracle(mid, wd, None),
    )
    fn = torch.compile(layer, fullgraph=True)
    fn(x, o, mid)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(x, o, mid)
    for _ in range(2):
        for t in outs:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, wants):
            scale = want.abs().max().item()
            torch.testing.assert_close(got.float().cpu(), want, atol=2e-2 * scale, rtol=2e-2)
