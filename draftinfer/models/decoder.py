"""The native decoder every target family builds on: a Llama-shaped causal LM with a static KV
cache, gpt-fast style (the families under `draftinfer/families/` subclass it).

One single-device, uncompiled `nn.Module` the runner owns end to end: the decode loop calls
`forward` on a padded batch, `torch.compile` / CUDA graphs are applied from outside (STYLE
rule 3). Module names equal Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...), so
an HF safetensors checkpoint loads by name with no renaming table.

`forward(inputs, slots, features) -> TargetOutput` is the target interface of
`draftinfer.models.target`; `Slots` (cache rows, cache index, RoPE position, attention length) and
the KV-cache design (scratch column for padding slots, no rollback ever needed) are described
in `draftinfer.conventions.slots` and `draftinfer.models.kv_cache`.

The seams a family plugs into (DESIGN 2.1; no family is named here):
- `NativeCausalLM.config_from_hf`: the family's HF config fields onto its `NativeConfig`
  (a subclass for what the base lacks); a one-line `ConfigError` for what it does not serve.
- `NativeCausalLM.decoder_layer(cfg, index)`: layer `index`, built from `DecoderLayer`'s
  pieces: a `CachedAttention` with that layer's `AttentionOptions` (biases, q/k norm, sliding
  window, per-head sinks), the MLP (`SwiGLU`, or a routed block of `draftinfer.models.moe`), the
  norms (`NativeCausalLM.rms_norm`, also the final norm). `forward` gives each layer the
  visibility mask of its window (one mask per distinct window, `layer_masks`).
- `NativeCausalLM.checkpoint_sources(param, available)`: the checkpoint tensors a parameter
  is made of when the checkpoint does not hold it under its own name (per-expert tensors into
  slices of stacked experts, quantized blocks and scales), read by
  `draftinfer.files.loading.load_weights`.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from draftinfer.conventions.slots import Slots
from draftinfer.files.errors import ConfigError
from draftinfer.models.kv_cache import (
    default_attention,
    resolve_attn_len,
    visibility_mask,
    write_index,
)
from draftinfer.models.layers import RMSNorm, SwiGLU
from draftinfer.models.rope import (
    RotaryEmbedding,
    apply_rope,
    partial_rotary_factor,
    rope_axes,
    rope_from_hf,
)
from draftinfer.models.target import FeatureSpec, TargetInfo, TargetInputs, TargetOutput, as_inputs


@dataclass
class NativeConfig:
    """Architecture facts of a Llama-shaped decoder, read once from an HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    eos_token_ids: list[int] = field(default_factory=list)
    # Partial rotary (GLM-4.5: half the head): RoPE on the first `rotary_dim` dimensions of
    # each q/k head, the rest unrotated; None: the whole head (`head_dim`).
    rotary_dim: int | None = None

    @property
    def num_hidden_layers(self) -> int:  # HF spelling, for callers that use it
        return self.num_layers


@dataclass(frozen=True)
class AttentionOptions:
    """What one layer's attention has besides the model's shapes; a family chooses them per
    layer (`NativeCausalLM.decoder_layer`)."""

    qkv_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on the output projection
    qk_norm: bool = False  # RMSNorm over head_dim on q and k, before RoPE (Qwen3)
    window: int | None = None  # sliding window: a query at p reads keys p - window < j <= p
    sinks: bool = False  # a learned logit per query head in the softmax, carrying no value

    @classmethod
    def of(cls, cfg: NativeConfig, **changes: Any) -> AttentionOptions:
        """The model-wide options of `cfg` (its biases, q/k norm), with `changes`."""
        return replace(cls(cfg.qkv_bias, cfg.o_bias, cfg.qk_norm), **changes)


class CachedAttention(nn.Module):
    """GQA attention that writes its K/V into a static cache and reads the cache prefix.

    Cache buffers `k_cache`, `v_cache`: `[max_batch, max_seq_len + 1, n_kv, head_dim]`. The
    extra last column is a scratch slot that padding slots write into, so a padded batch needs
    no boolean indexing (no host sync); no query ever reads it (reads stop at `max_seq_len`).

    Serving transforms swap two pieces from outside (`draftinfer.models.transforms`): `project`
    (one fused q/k/v GEMM) and `attention` (a backend of `draftinfer.models.kv_cache.ATTENTION`).

    `options` (default: the model's, `AttentionOptions.of(cfg)`): a sliding `window` is read by
    `NativeCausalLM.layer_masks` (the layer is given the mask of its window); `sinks` adds the
    parameter `sinks [nh]` (HF name `self_attn.sinks`), passed to the backend in fp32.
    """

    # How this forward's K/V are written to the cache and attended; an instance may hold
    # another backend of `kv_cache.ATTENTION` (`transforms.use_attention`).
    attention = staticmethod(default_attention)

    def __init__(self, cfg: NativeConfig, options: AttentionOptions | None = None):
        super().__init__()
        opts = options if options is not None else AttentionOptions.of(cfg)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=opts.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=opts.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=opts.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=opts.o_bias)
        if opts.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        if opts.window is not None and opts.window < 1:
            raise ConfigError(f"sliding window must be >= 1 keys, got {opts.window}")
        self.window = opts.window
        self.sinks: nn.Parameter | None
        if opts.sinks:
            self.sinks = nn.Parameter(torch.zeros(self.n_heads))
        else:
            self.register_parameter("sinks", None)
        self.k_cache: torch.Tensor | None
        self.v_cache: torch.Tensor | None
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def allocate_cache(
        self, max_batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """The cache seam (`NativeCausalLM.setup_caches` calls it on every layer's attention):
        `k_cache`, `v_cache` `[max_batch, max_seq_len + 1, n_kv, head_dim]` (the `+ 1` is the
        padding scratch column). An attention that caches something else (MLA's latent,
        `draftinfer.models.mla`) allocates its own."""
        shape = (max_batch, max_seq_len + 1, self.n_kv, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, T, R] fp32, R = rotary_dim (partial rotary) or head_dim
        sin: torch.Tensor,  # [B, T, R] fp32
        rows: torch.Tensor,  # [B] cache row of each batch row
        write_pos: torch.Tensor,  # [B, T] cache index of each slot (scratch column for padding)
        mask: torch.Tensor,  # [B, 1, T * group, L] bool, True = may attend (this layer's window)
        attn_len: int,  # L: number of cache indices read
    ) -> torch.Tensor:
        return self.o_proj(self.attend(*self.project(x), cos, sin, rows, write_pos, mask, attn_len))

    def attend(
        self,
        q: torch.Tensor,  # [B, T, nh * d] projected
        k: torch.Tensor,  # [B, T, nkv * d]
        v: torch.Tensor,  # [B, T, nkv * d]
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: torch.Tensor,
        write_pos: torch.Tensor,
        mask: torch.Tensor,
        attn_len: int,
    ) -> torch.Tensor:
        """What `forward` does between the projections: q/k norms, RoPE, the cache write and
        the attention -> `[B, T, nh * d]`, the o projection's input."""
        B, T, _ = q.shape
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        q, k, v = q.view(B, T, nh, d), k.view(B, T, nkv, d), v.view(B, T, nkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Write first, then read: a slot sees its own K/V and those of earlier slots of the
        # same forward (causal prefill chunk) through the same cache path.
        cache = (self.k_cache, self.v_cache, rows, write_pos, mask, attn_len)
        if self.sinks is None:  # a backend from outside need not take sinks
            o = self.attention(q, k, v, *cache)
        else:
            o = self.attention(q, k, v, *cache, self.sinks.float())
        return o.reshape(B, T, nh * d)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[B, T, nh * d]`, k and v `[B, T, nkv * d]`."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class DecoderLayer(nn.Module):
    """A pre-norm block: `h = x + attn(norm(x))`, `h + mlp(norm(h))`. Its pieces are the
    family's (`NativeCausalLM.decoder_layer`); by default the dense Llama block: attention with
    the model's options, `SwiGLU` of `intermediate_size`, `RMSNorm`s. Any `mlp` maps `[B, T, H]`
    to `[B, T, H]`; `norm(dim)` builds the two norms."""

    def __init__(
        self,
        cfg: NativeConfig,
        self_attn: CachedAttention | None = None,
        mlp: nn.Module | None = None,
        norm: Callable[[int], nn.Module] | None = None,
    ):
        super().__init__()
        self.self_attn = self_attn if self_attn is not None else CachedAttention(cfg)
        if mlp is None:
            mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.mlp = mlp
        if norm is None:
            norm = lambda dim: RMSNorm(dim, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm = norm(cfg.hidden_size)
        self.post_attention_layernorm = norm(cfg.hidden_size)

    def forward(self, x: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return h + self.mlp(self.post_attention_layernorm(h))


class PrefillPlan:
    """The target inputs of one prefill, chunk by chunk: what `NativeCausalLM.prefill_plan`
    returns. Text targets feed the token ids and derive RoPE positions from the cache index;
    a multimodal family subclasses it (per-chunk encoder rows, its own position table)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids  # [n, P]

    def chunk(self, cols: slice) -> tuple[TargetInputs, torch.Tensor | None]:
        """(inputs, rope_pos) of slot columns `cols`: `TargetInputs` over `[n, len(cols)]` and
        the RoPE positions to pass in `Slots.rope_pos` (None: the target's `rope_positions`)."""
        return TargetInputs(self.ids[:, cols]), None


class Backbone(nn.Module):
    """HF's `model.*` submodule: embeddings, decoder layers (`decoder_layer(cfg, index)`, by
    default the dense `DecoderLayer`), final norm (`norm`, by default an `RMSNorm`)."""

    def __init__(
        self,
        cfg: NativeConfig,
        decoder_layer: Callable[[NativeConfig, int], nn.Module] | None = None,
        norm: nn.Module | None = None,
    ):
        super().__init__()
        make = decoder_layer if decoder_layer is not None else (lambda c, _i: DecoderLayer(c))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm if norm is not None else RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass(frozen=True)
class TensorSource:
    """Checkpoint tensors that together fill one parameter, or a slice of it:
    `param[index] = convert(*tensors named names)` (`NativeCausalLM.checkpoint_sources`)."""

    names: tuple[str, ...]
    index: tuple = ()  # into the parameter, e.g. `(e, slice(0, I))`; () = all of it
    convert: Callable[..., torch.Tensor] | None = None  # None: the one tensor as it is


class NativeCausalLM(nn.Module):
    """A Llama-shaped causal LM with a preallocated static KV cache (base of the family).

    Subclasses say how an HF config maps onto `NativeConfig` (`config_from_hf`) and, where the
    family's layers differ from the dense Llama block, how layer `i` is built
    (`decoder_layer`), the norm (`rms_norm`) and how checkpoint tensors map onto parameters
    (`checkpoint_sources`). Call `setup_caches` before `forward`.
    """

    hf_model_types: tuple[str, ...] = ()
    # Whether this family's attention rotates part of each head (`NativeConfig.rotary_dim`
    # from the HF `partial_rotary_factor`); a family that does not refuses a factor below 1.
    partial_rotary: ClassVar[bool] = False
    # The target family (`draftinfer.families`) whose registration serves this class.
    family: ClassVar[str] = ""

    def __init__(self, config: NativeConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config, self.decoder_layer, self.rms_norm(config, config.hidden_size))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        rotary_dim = config.rotary_dim or config.head_dim  # partial rotary: a narrower table
        self.rotary = RotaryEmbedding(rotary_dim, config.rope_theta, config.rope_scaling)
        self.max_batch = 0
        self.max_seq_len = 0
        self.tie_weights()

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def config_from_hf(cls, hf: Any, eos_token_ids: list[int]) -> NativeConfig:
        """Map an HF config to `NativeConfig`; a one-line `ConfigError` on what we lack (here:
        sliding windows, which a family that has them maps itself)."""
        layer_types = getattr(hf, "layer_types", None) or []
        if getattr(hf, "use_sliding_window", False) or "sliding_attention" in layer_types:
            raise ConfigError(f"{cls.__name__}: sliding-window attention layers are not supported")
        return NativeConfig(**cls.decoder_fields(hf, eos_token_ids))

    @classmethod
    def decoder_fields(cls, hf: Any, eos_token_ids: list[int]) -> dict[str, Any]:
        """The `NativeConfig` fields of an HF config's decoder (sizes, heads, RoPE, block
        flags), for `config_from_hf` and a family's subclass of the config; a one-line
        `ConfigError` for an activation or rope we lack."""
        arch = cls.__name__
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{arch}: hidden_act {act!r} is not supported (only silu)")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        theta, scaling = rope_from_hf(hf, head_dim)  # strict: unknown rope keys are errors
        factor = partial_rotary_factor(hf)
        rotary_dim = None
        if factor != 1.0:
            rotary_dim = int(head_dim * factor)  # HF's rotary width
            if not cls.partial_rotary:
                raise ConfigError(
                    f"{arch}: partial_rotary_factor {factor} is not supported (RoPE over the "
                    "whole head only)"
                )
            if not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
                raise ConfigError(
                    f"{arch}: partial_rotary_factor {factor} of head_dim {head_dim} gives "
                    f"{rotary_dim} rotary dimensions (an even number in 2..{head_dim})"
                )
        qkv_bias, o_bias, mlp_bias, qk_norm = cls.block_flags(
            bool(getattr(hf, "attention_bias", False)), bool(getattr(hf, "mlp_bias", False))
        )
        return dict(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            eos_token_ids=list(eos_token_ids),
            rotary_dim=rotary_dim,
        )

    @classmethod
    def block_flags(cls, attention_bias: bool, mlp_bias: bool) -> tuple[bool, bool, bool, bool]:
        """(qkv_bias, o_bias, mlp_bias, qk_norm) of this family's decoder layer, from the HF
        config's `attention_bias` / `mlp_bias` (one rule for the target and MTP blocks)."""
        return attention_bias, attention_bias, mlp_bias, False

    @classmethod
    def decoder_layer(cls, cfg: NativeConfig, index: int) -> nn.Module:
        """Decoder layer `index` (by default the dense Llama block, the same for every layer).
        A family whose layers differ (windows, sinks, routed experts) builds them here."""
        return DecoderLayer(cfg, norm=lambda dim: cls.rms_norm(cfg, dim))

    @classmethod
    def rms_norm(cls, cfg: NativeConfig, dim: int) -> nn.Module:
        """The family's RMSNorm over `dim` (the layers' norms and the final norm)."""
        return RMSNorm(dim, cfg.rms_norm_eps)

    def checkpoint_sources(
        self, param: str, available: Container[str]
    ) -> list[TensorSource] | None:
        """How parameter `param` is filled when the checkpoint holds no tensor of that name
        (`available`: the checkpoint's tensor names): the sources, or None (then it is a
        missing tensor). Every checkpoint tensor no parameter consumes is an unknown one
        (`draftinfer.files.loading.load_weights`)."""
        return None

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, device: torch.device | str) -> None:
        """(Re)compute the fp32 RoPE tables, e.g. after building on the meta device."""
        self.rotary.reset_parameters(device)

    @property
    def info(self) -> TargetInfo:
        c = self.config
        return TargetInfo(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=c.num_layers,
            max_position_embeddings=c.max_position_embeddings,
            rope_axes=rope_axes(c.rope_scaling),
            architecture=c.architecture,
            family=self.family,
        )

    def setup_caches(self, max_batch: int, max_seq_len: int) -> None:
        """Allocate every layer's cache on the model's device, in the model's dtype, through
        its attention's `allocate_cache` (`CachedAttention`: K/V `[max_batch, max_seq_len + 1,
        n_kv, head_dim]`, the `+ 1` the padding scratch column; MLA: its latent)."""
        if max_batch < 1 or max_seq_len < 1:
            raise ValueError(
                f"max_batch and max_seq_len must be >= 1, got {max_batch}, {max_seq_len}"
            )
        w = self.model.embed_tokens.weight
        for layer in self.model.layers:
            layer.self_attn.allocate_cache(max_batch, max_seq_len, w.dtype, w.device)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len

    # ---- access the drafter and the runner need ----------------------------------------
    @property
    def embed_tokens(self) -> nn.Embedding:
        """The token embedding (EAGLE-3 / MTP drafters share its weight)."""
        return self.model.embed_tokens

    def shared_weights(self) -> dict[str, torch.Tensor]:
        """The weights drafters share with their target, by role (`draftinfer.files.checkpoint`)."""
        return {
            "input_embeddings": self.model.embed_tokens.weight,
            "output_embeddings": self.lm_head.weight,
        }

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    # ---- forward (the target interface, `draftinfer.models.target`) -------------------------
    def _check_rows(self, slots: Slots) -> None:
        lo, hi, pmin = torch.stack(
            [slots.rows.min(), slots.rows.max(), slots.cache_pos.min()]
        ).tolist()
        if lo < 0 or hi >= self.max_batch:
            raise ValueError(
                f"cache row {hi if hi >= self.max_batch else lo} out of range "
                f"0..{self.max_batch - 1} (max_batch={self.max_batch})"
            )
        if pmin < -1:
            raise ValueError(f"cache index {pmin} is invalid: >= 0, or -1 for padding")

    def rope_positions(self, cache_pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Text targets: the RoPE position is the cache index (all three axes for an M-RoPE
        rope config). `[B, T]` or `[3, B, T]`; padding slots at 0."""
        pos = cache_pos.clamp(min=0)
        return pos if self.rotary.axes == 1 else pos[None].expand(3, *pos.shape)

    def prefill_plan(
        self,
        ids: torch.Tensor,  # [n, P] prompt ids, padded (left or right)
        cache_pos: torch.Tensor,  # [n, P]: 0..P_b-1 at request b's tokens, -1 at padding
        rows: torch.Tensor,  # [n] cache rows
        mm_inputs: Sequence[dict | None] | None = None,  # per request: family inputs or None
    ) -> PrefillPlan:
        """The prefill seam: what to feed each chunk of a prefill from cache index 0 (the
        engine's chunked prefill, the plain greedy baseline and the reference loop all call
        it). Text targets: the ids, positions from the cache index; a request that carries
        multimodal inputs is a one-line `ValueError`."""
        if mm_inputs is not None and any(m is not None for m in mm_inputs):
            raise ValueError(
                f"{self.config.architecture} is a text target: a request carries "
                "multimodal inputs (images)"
            )
        return PrefillPlan(ids)

    def forward(
        self,
        inputs: TargetInputs | torch.Tensor,
        slots: Slots,
        features: FeatureSpec | None = None,
        *,
        logit_index: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run a padded batch of slots through the target, writing its K/V into the cache.

        Args:
            inputs: token ids `[B, T]` int64 (or `TargetInputs`); ids of padding slots are
                ignored.
            slots: rows `[B]`, `cache_pos [B, T]` (-1 = padding: writes nothing, finite garbage
                out), `rope_pos` (None: `rope_positions(cache_pos)`), `attn_len` (None: max
                cache index + 1 with one host sync that also checks the bounds; pass a fixed or
                bucketed value for a sync-free, static-shape step; the caller then guarantees
                `-1 <= cache_pos < attn_len <= max_seq_len`).
            features: the features to return (layer-input taps, final hidden pre/post norm).
            logit_index: optional `[B, T']` slot indices; logits only for those slots.

        Returns `TargetOutput`: logits `[B, T, V]` fp32 (or `[B, T', V]`), features
        `[B, T, F]` in the model dtype (None without `features`), the RoPE positions used and
        the input embeddings. Why no KV rollback is needed: `draftinfer.models.kv_cache`.
        """
        if self.max_seq_len == 0:
            raise RuntimeError("call setup_caches(max_batch, max_seq_len) before forward")
        c = self.config
        ids = as_inputs(inputs).input_ids
        B, T = ids.shape
        if slots.attn_len is None:  # the synced path (prefill, tests) also checks the rows
            self._check_rows(slots)
        attn_len = resolve_attn_len(slots, self.max_seq_len)
        if features is not None:
            features.check(c.num_layers)
        valid = slots.cache_pos >= 0  # [B, T]
        ids = torch.where(valid, ids, torch.zeros_like(ids))
        write_pos = write_index(slots.cache_pos, self.max_seq_len)
        masks = self.layer_masks(slots.cache_pos, attn_len)
        rope_pos = slots.rope_pos
        if rope_pos is None:
            rope_pos = self.rope_positions(slots.cache_pos, slots.rows)
        cos, sin = self.rotary(rope_pos)  # [B, T, rotary_dim or head_dim] fp32
        x = embeds = self.model.embed_tokens(ids)  # [B, T, H]
        taps: dict[int, torch.Tensor] = {}
        wanted = set(features.layer_inputs) if features is not None else set()
        for j, layer in enumerate(self.model.layers):
            if j in wanted:
                taps[j] = x
            x = layer(x, cos, sin, slots.rows, write_pos, masks[j], attn_len)
        return self.head_output(x, taps, features, logit_index, rope_pos, embeds)

    def layer_masks(self, cache_pos: torch.Tensor, attn_len: int) -> list[torch.Tensor]:
        """The visibility mask `[B, 1, T * g, L]` of each decoder layer: one per distinct
        sliding window (None: full causal) among the layers, shared by the layers of that
        window. Rebuilt from `cache_pos` at every call (convention 7: window bounds never go
        stale between draft steps)."""
        c = self.config
        group = c.num_heads // c.num_kv_heads
        by_window: dict[int | None, torch.Tensor] = {}
        masks = []
        for layer in self.model.layers:
            window = layer.self_attn.window
            if window not in by_window:
                by_window[window] = visibility_mask(cache_pos, attn_len, group, window)
            masks.append(by_window[window])
        return masks

    def head_output(
        self,
        x: torch.Tensor,
        taps: dict[int, torch.Tensor],
        features: FeatureSpec | None,
        logit_index: torch.Tensor | None,
        rope_pos: torch.Tensor,
        embeds: torch.Tensor,
    ) -> TargetOutput:
        """After the last layer: final norm, the requested features (layer-input `taps`, the
        final hidden), logits (at `logit_index` rows if given)."""
        normed = self.model.norm(x)
        feats = None
        if features is not None:
            parts = [taps[j] for j in features.layer_inputs]
            if features.final_hidden is not None:
                parts.append(x if features.final_hidden == "pre_norm" else normed)
            feats = torch.cat(parts, dim=-1) if parts else x.new_zeros(*x.shape[:2], 0)
        if logit_index is not None:
            normed = torch.gather(
                normed, 1, logit_index[..., None].expand(-1, -1, normed.shape[-1])
            )
        logits = self.lm_head(normed).float()
        return TargetOutput(logits, feats, rope_pos, embeds)
