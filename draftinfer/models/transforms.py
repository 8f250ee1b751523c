"""Serving transforms of a loaded native target, applied from outside the model code (STYLE
rule 3, like `torch.compile`): they change how a decode step runs, never what it computes.

    model = load_native_target(path, "cuda", torch.bfloat16, max_batch=1, max_seq_len=4096)
    fuse_projections(model)                # q/k/v -> one GEMM, gate/up -> one GEMM
    use_attention(model, "maths_decode")   # a compiled one-token step's attention by inductor
    use_skinny_gemm(model)                 # GEMMs of <= 16 rows by the skinny-GEMM kernel

- `fuse_projections`: each layer's q/k/v weights become row slices of one `[(nh + 2 nkv) d, H]`
  tensor and gate/up of one `[2 I, H]` tensor, and the layer runs one GEMM (GEMV at batch 1)
  for each group, as gpt-fast's `wqkv`. It takes a target or a drafter: every attention block
  (`CachedAttention`, the drafters' `layers.Attention`) and SwiGLU MLP in the module; a block
  drafter's context keys/values (rows that ask no query) run one GEMM over the fused k/v rows. The HF-named parameters (`self_attn.q_proj.weight`,
  `mlp.gate_proj.weight`, ...) stay, as views into the fused tensors: `state_dict`, the
  safetensors loader (`load_weights` copies into the views, so into the fused tensor),
  `shared_weights` and the drafters' taps see the same model. The fused tensors are
  non-persistent buffers, never saved. Apply it after the model is on its device and dtype:
  `.to()` copies parameters and buffers apart (values stay equal, the views no longer alias);
  calling it again re-fuses. A state dict of a fused model holds views of one storage, which
  `safetensors.save_file` refuses: save an unfused model.
- `use_attention`: the attention backend of every layer (`draftinfer.models.kv_cache.ATTENTION`).
- `use_skinny_gemm`: every `nn.Linear` of a module (a target or a drafter), the fused
  projections and the MoE routers' projections run `draftkernels.skinny_gemm.linear`: the weight-streaming Triton kernel for
  inputs of at most 16 rows in bf16/fp16 on CUDA (decode, verify, drafting), `F.linear` for
  anything else (prefill, fp32, the CPU), so CPU numerics do not change. A fused gate/up
  runs `skinny_gemm.swiglu`: SwiGLU's `silu(gate) * up` as the same kernel's epilogue (each
  program streams the gate and the up rows of its columns), one launch fewer a layer. Same weights, same
  parameter names; `on=False` undoes it. Serving only: the kernel has no backward.
  On CUDA in bf16/fp16 a target's decoder layers with fused projections become
  `NormFusedDecoderLayer` (`norms=True`): at 2..16 rows (a verify, a batch) the RMSNorms run
  inside the q/k/v and gate/up GEMMs and the residual adds are the o and down GEMMs'
  epilogues, two kernels fewer a layer. For that each norm's weight is folded into the
  projection that reads it (`fold_norm_weights`, once; the norm's weight becomes ones): the
  one place a transform changes rounding (each folded weight rounded once instead of the
  product `g * normed` every forward), not the function; prefill and one-row steps read the
  same folded weights.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import draftkernels.skinny_gemm as skinny
import torch
import torch.nn.functional as F
from torch import nn

from draftinfer.models.decoder import CachedAttention, DecoderLayer, NativeCausalLM
from draftinfer.models.kv_cache import ATTENTION, AttentionFn
from draftinfer.models.layers import Attention, SwiGLU
from draftinfer.models.moe import Router


class _FusedQKV:
    """q, k and v projected with one GEMM over `qkv_weight` (the attention classes below)."""

    n_heads: int
    n_kv: int
    head_dim: int
    qkv_weight: torch.Tensor  # [(nh + 2 nkv) * d, in_features]
    qkv_bias: torch.Tensor | None
    linear = staticmethod(F.linear)  # `use_skinny_gemm` sets the kernel's

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        return self.linear(x, self.qkv_weight, self.qkv_bias).split([q, kv, kv], dim=-1)


class FusedQKVAttention(_FusedQKV, CachedAttention):
    """`CachedAttention` projecting q, k and v with one GEMM over `qkv_weight`."""


class FusedAttention(_FusedQKV, Attention):
    """A drafter's `layers.Attention` projecting q, k and v with one GEMM over `qkv_weight`,
    and the k/v of rows that ask no query (a block drafter's context) with one GEMM over its
    k/v rows (a contiguous row slice)."""

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        b = None if self.qkv_bias is None else self.qkv_bias[q:]
        return self.linear(x, self.qkv_weight[q:], b).split([kv, kv], dim=-1)


def gate_up_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """`silu(gate) * up` of one GEMM over a fused gate/up weight, as `SwiGLU` computes it."""
    gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
    return F.silu(gate) * up


class FusedSwiGLU(SwiGLU):
    """`SwiGLU` with gate and up projected by one GEMM over `gate_up_weight`."""

    gate_up_weight: torch.Tensor  # [2 * I, H]: gate rows, then up rows
    gate_up_bias: torch.Tensor | None
    # `use_skinny_gemm` sets the kernel's (`silu(gate) * up` as the GEMM's epilogue)
    product = staticmethod(gate_up_product)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.product(x, self.gate_up_weight, self.gate_up_bias))


class NormFusedDecoderLayer(DecoderLayer):
    """A target's `DecoderLayer` (fused q/k/v and gate/up) whose RMSNorms run inside the GEMMs
    that read them and whose residual adds are the GEMMs' epilogues
    (`use_skinny_gemm(norms=True)`): at 2..16 rows four launches where the plain layer's
    four GEMMs come with two more kernels (the residual add and the norm, fused by
    inductor). Each norm's weight is folded into the projection that reads the norm's
    output (`fold_norm_weights`; that projection is the norm's only reader), so the kernel
    reads x as its MMA does and scales by `1 / rms` after the loop. At one row and where the
    kernel does not take the rows (prefill, the CPU) each piece runs the norm, `linear` and
    the add as the plain layer does."""

    self_attn: FusedQKVAttention
    mlp: FusedSwiGLU

    def forward(self, x: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        a, m = self.self_attn, self.mlp
        eps1, eps2 = self.input_layernorm.eps, self.post_attention_layernorm.eps
        q, kv = a.n_heads * a.head_dim, a.n_kv * a.head_dim
        qkv = skinny.rms_linear(x, eps1, a.qkv_weight, a.qkv_bias)
        o = a.attend(*qkv.split([q, kv, kv], dim=-1), *attn_args)
        h = skinny.linear_add(o, a.o_proj.weight, a.o_proj.bias, x)
        mid = skinny.rms_swiglu(h, eps2, m.gate_up_weight, m.gate_up_bias)
        return skinny.linear_add(mid, m.down_proj.weight, m.down_proj.bias, h)

    def after_load_weights(self) -> None:
        """`load_weights` wrote the checkpoint's projections and norm weights: fold again."""
        fold_norm_weights(self)


def norms_fusable(layer: DecoderLayer) -> bool:
    """Whether `use_skinny_gemm` makes `layer` a `NormFusedDecoderLayer`: fused q/k/v and
    gate/up, on CUDA in a dtype the kernel takes (elsewhere the fused layer would only
    round its folded weights differently, so CPU numerics stay as they are)."""
    a, m = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (
        isinstance(a, FusedQKVAttention)
        and isinstance(m, FusedSwiGLU)
        and a.qkv_weight.is_cuda
        and a.qkv_weight.dtype in skinny.DTYPES
        # The kernels scale like Llama's norm; an fp32-scaled norm (gpt-oss) stays as it is.
        and not any(getattr(n, "scale_in_fp32", False) for n in norms)
    )


@torch.no_grad()
def fold_norm_weights(layer: DecoderLayer) -> None:
    """Fold each RMSNorm's weight into the projection that reads its output, in place: the
    input norm's into the fused q/k/v rows' columns, the post-attention norm's into the
    fused gate/up's, and the norms' weights become ones. The same model, each folded weight
    rounded once (`W * g` in fp32, then the weights' dtype) where the plain layer rounds the
    product `g * normed` of every forward; a second call multiplies by ones."""
    for norm, weight in (
        (layer.input_layernorm, layer.self_attn.qkv_weight),
        (layer.post_attention_layernorm, layer.mlp.gate_up_weight),
    ):
        weight.copy_(weight.float() * norm.weight.float())
        norm.weight.fill_(1.0)


class SkinnyLinear(nn.Linear):
    """`nn.Linear` running `draftkernels.skinny_gemm.linear` (the kernel for skinny inputs on
    CUDA, `F.linear` elsewhere); same parameters and names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny.linear(x, self.weight, self.bias)


@torch.no_grad()
def _fuse(module: nn.Module, linears: list[nn.Linear], name: str) -> None:
    """Concatenate the `linears`' weights (and biases) into buffers `{name}_weight` /
    `{name}_bias` of `module` and turn each linear's parameters into row views of them."""
    for attr in ("weight", "bias"):
        parts = [getattr(lin, attr) for lin in linears]
        if parts[0] is None:
            module.register_buffer(f"{name}_{attr}", None, persistent=False)
            continue
        fused = torch.cat([p.detach() for p in parts])
        module.register_buffer(f"{name}_{attr}", fused, persistent=False)
        start = 0
        for lin, p in zip(linears, parts):
            n = p.shape[0]
            setattr(lin, attr, nn.Parameter(fused[start : start + n], p.requires_grad))
            start += n


def fuse_projections(model: nn.Module, qkv: bool = True, gate_up: bool = True) -> None:
    """Fuse the q/k/v and gate/up projections of every attention block and SwiGLU MLP of
    `model` (a target's decoder layers, a drafter's layers) in place (module docstring)."""
    for m in list(model.modules()):
        if qkv and isinstance(m, (CachedAttention, Attention)):
            _fuse(m, [m.q_proj, m.k_proj, m.v_proj], "qkv")
            if type(m) in (CachedAttention, Attention):
                m.__class__ = FusedQKVAttention if type(m) is CachedAttention else FusedAttention
        elif gate_up and isinstance(m, SwiGLU):
            _fuse(m, [m.gate_proj, m.up_proj], "gate_up")
            m.__class__ = FusedSwiGLU


def use_attention(model: NativeCausalLM, backend: str | AttentionFn) -> None:
    """Set every layer's attention backend: a name of `kv_cache.ATTENTION` or a function with
    `cached_attention`'s signature."""
    if isinstance(backend, str):
        if backend not in ATTENTION:
            raise ValueError(
                f"unknown attention backend {backend!r} (known: {', '.join(ATTENTION)})"
            )
        backend = ATTENTION[backend]
    for layer in model.model.layers:
        if not isinstance(layer.self_attn, CachedAttention):
            raise TypeError(f"{type(layer.self_attn).__name__} is not a CachedAttention")
        layer.self_attn.attention = backend


def use_skinny_gemm(
    module: nn.Module, on: bool = True, swiglu: bool = True, norms: bool = True
) -> None:
    """Run every `nn.Linear` of `module` and its fused projections through the skinny-GEMM
    kernel's `linear` (`on`), or back through `F.linear` (module docstring); `swiglu`: a fused
    gate/up's product as the kernel's epilogue (`skinny_gemm.swiglu`), else after it; `norms`
    (with `swiglu`): a target's decoder layers with fused projections run their norms and
    residual adds inside the GEMMs (`NormFusedDecoderLayer`; their norms' weights are folded
    into the projections once, `fold_norm_weights`, and stay so when undone)."""
    for m in module.modules():
        if type(m) in (DecoderLayer, NormFusedDecoderLayer):
            if on and swiglu and norms and norms_fusable(m):
                fold_norm_weights(m)
                m.__class__ = NormFusedDecoderLayer
            else:  # the norms' weights stay folded: the plain layer computes the same
                m.__class__ = DecoderLayer
        if type(m) in (nn.Linear, SkinnyLinear):
            m.__class__ = SkinnyLinear if on else nn.Linear
        elif isinstance(m, (FusedQKVAttention, FusedAttention, Router)):
            m.linear = skinny.linear if on else F.linear
        elif isinstance(m, FusedSwiGLU):
            epilogue = skinny.swiglu if swiglu else partial(skinny.swiglu, epilogue=False)
            m.product = epilogue if on else gate_up_product
