"""Native Llama-family targets (Llama 2/3, Qwen2, Qwen3) with a static KV cache, gpt-fast style.

One single-device, uncompiled `nn.Module` the runner owns end to end: the decode loop calls
`forward` on a padded batch, `torch.compile` / CUDA graphs are applied from outside (STYLE
rule 3). Module names equal Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...), so
an HF safetensors checkpoint loads by name with no renaming table.

Vocabulary used below:
- *slot* `(b, t)`: one query token of the padded batch `[B, T]`; it sits at target position
  `positions[b, t]`; `-1` marks a *padding slot* (no KV write, garbage outputs).
- *cache row*: the request's row of the preallocated KV cache, `cache_rows[b]`.

The cache never needs an explicit rollback (see `NativeCausalLM.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftinfer.drafters.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rope,
    rope_inv_freq,
    rope_params_from_hf,
)
from draftinfer.errors import ConfigError


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

    @property
    def num_hidden_layers(self) -> int:  # HF spelling, for callers that use it
        return self.num_layers


class CachedAttention(nn.Module):
    """GQA attention that writes its K/V into a static cache and reads the cache prefix.

    Cache buffers `k_cache`, `v_cache`: `[max_batch, max_seq_len + 1, n_kv, head_dim]`. The
    extra last column is a scratch slot that padding slots write into, so a padded batch needs
    no boolean indexing (no host sync); no query ever reads it (reads stop at `max_seq_len`).
    """

    def __init__(self, cfg: NativeConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.k_cache: torch.Tensor | None
        self.v_cache: torch.Tensor | None
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, T, head_dim] fp32
        sin: torch.Tensor,  # [B, T, head_dim] fp32
        write_rows: torch.Tensor,  # [B, T] cache row of each slot
        write_pos: torch.Tensor,  # [B, T] cache index of each slot (scratch column for padding)
        cache_rows: torch.Tensor,  # [B]
        mask: torch.Tensor,  # [B, 1, T * group, L] bool, True = may attend
        attn_len: int,  # L: number of cache indices read
    ) -> torch.Tensor:
        B, T, _ = x.shape
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        q = self.q_proj(x).view(B, T, nh, d)
        k = self.k_proj(x).view(B, T, nkv, d)
        v = self.v_proj(x).view(B, T, nkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # Write first, then read: a slot sees its own K/V and those of earlier slots of the
        # same forward (causal prefill chunk) through the same cache path.
        self.k_cache.index_put_((write_rows, write_pos), k)
        self.v_cache.index_put_((write_rows, write_pos), v)
        kc = self.k_cache[cache_rows, :attn_len].transpose(1, 2)  # [B, n_kv, L, d]
        vc = self.v_cache[cache_rows, :attn_len].transpose(1, 2)

        # GQA without copying K/V per query head: head h uses kv head h // group (HF's
        # repeat_kv order), so fold the group into the query-length axis: [B, n_kv, T*g, d].
        g = nh // nkv
        qf = q.view(B, T, nkv, g, d).permute(0, 2, 1, 3, 4).reshape(B, nkv, T * g, d)
        o = F.scaled_dot_product_attention(qf, kc, vc, attn_mask=mask)  # [B, n_kv, T*g, d]
        o = o.view(B, nkv, T, g, d).permute(0, 2, 1, 3, 4).reshape(B, T, nh * d)
        return self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: NativeConfig):
        super().__init__()
        self.self_attn = CachedAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """HF's `model.*` submodule: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: NativeConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class NativeCausalLM(nn.Module):
    """A Llama-shaped causal LM with a preallocated static KV cache (base of the family).

    Subclasses only say how an HF config maps onto `NativeConfig` (`config_from_hf`).
    Call `setup_caches` before `forward`.
    """

    hf_model_types: tuple[str, ...] = ()

    def __init__(self, config: NativeConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.max_batch = 0
        self.max_seq_len = 0
        self.tie_weights()

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def config_from_hf(cls, hf: Any, eos_token_ids: list[int]) -> NativeConfig:
        """Map an HF config to `NativeConfig`; a one-line `ConfigError` on what we lack."""
        arch = cls.__name__
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{arch}: hidden_act {act!r} is not supported (only silu)")
        layer_types = getattr(hf, "layer_types", None) or []
        if getattr(hf, "use_sliding_window", False) or "sliding_attention" in layer_types:
            raise ConfigError(f"{arch}: sliding-window attention layers are not supported")
        theta, scaling = rope_params_from_hf(hf)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        try:
            rope_inv_freq(head_dim, theta, scaling)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"{arch}: {e}") from None
        bias = bool(getattr(hf, "attention_bias", False))
        return NativeConfig(
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
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            eos_token_ids=list(eos_token_ids),
        )

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, device: torch.device | str) -> None:
        """(Re)compute the fp32 RoPE table, e.g. after building on the meta device."""
        c = self.config
        self.rotary.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(device)

    def setup_caches(self, max_batch: int, max_seq_len: int) -> None:
        """Allocate per-layer K/V caches `[max_batch, max_seq_len + 1, n_kv, head_dim]` (the
        `+ 1` is the padding scratch column) on the model's device, in the model's dtype."""
        if max_batch < 1 or max_seq_len < 1:
            raise ValueError(
                f"max_batch and max_seq_len must be >= 1, got {max_batch}, {max_seq_len}"
            )
        w = self.model.embed_tokens.weight
        c = self.config
        shape = (max_batch, max_seq_len + 1, c.num_kv_heads, c.head_dim)
        for layer in self.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=w.dtype, device=w.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len

    # ---- access the drafter and the runner need ----------------------------------------
    @property
    def embed_tokens(self) -> nn.Embedding:
        """The token embedding (EAGLE-3 / MTP drafters share its weight)."""
        return self.model.embed_tokens

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    # ---- forward ------------------------------------------------------------------------
    def _check_bounds(self, positions: torch.Tensor, cache_rows: torch.Tensor) -> int:
        """One host sync: validates positions and rows, returns the largest position."""
        if self.max_seq_len == 0:
            raise RuntimeError("call setup_caches(max_batch, max_seq_len) before forward")
        if positions.numel() == 0:
            return -1
        pmax, pmin, rmax, rmin = torch.stack(
            [positions.max(), positions.min(), cache_rows.max(), cache_rows.min()]
        ).tolist()
        if pmax >= self.max_seq_len:
            raise ValueError(
                f"position {pmax} is out of range: the KV cache holds max_seq_len="
                f"{self.max_seq_len} positions (0..{self.max_seq_len - 1}); positions never wrap"
            )
        if pmin < -1:
            raise ValueError(f"position {pmin} is invalid: positions are >= 0, or -1 for padding")
        if rmin < 0 or rmax >= self.max_batch:
            raise ValueError(
                f"cache row {rmax if rmax >= self.max_batch else rmin} out of range "
                f"0..{self.max_batch - 1} (max_batch={self.max_batch})"
            )
        return pmax

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache_rows: torch.Tensor,
        aux_layer_ids: list[int] | None = None,
        *,
        attn_len: int | None = None,
        logit_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run a padded batch through the target, writing its K/V into the cache.

        Args:
            input_ids: `[B, T]` int64. Ids of padding slots are ignored.
            positions: `[B, T]` int64. Slot `(b, t)` sits at `positions[b, t]` and writes its
                K/V at cache index `positions[b, t]` of row `cache_rows[b]`; `-1` = padding
                (writes nothing, its outputs are garbage but finite).
            cache_rows: `[B]` int64, the cache row of each batch row (any order, distinct).
            aux_layer_ids: layers `j` whose *input* hidden state (pre-norm residual stream,
                0 = embeddings; equals HF `output_hidden_states[j]`) to return, in this order.
            attn_len: keys read per row (cache indices `0..attn_len-1`). None (default): the
                largest position in the batch + 1, found with one host sync that also checks
                `positions < max_seq_len`. Pass a fixed value (e.g. `max_seq_len`) for a
                sync-free, static-shape step (CUDA graphs); then the caller guarantees
                `-1 <= positions < attn_len <= max_seq_len`.
            logit_index: optional `[B, T']` slot indices; logits are computed only for those
                slots (e.g. the last prompt token of a prefill), giving `[B, T', V]`.

        Returns:
            logits `[B, T, V]` fp32 (or `[B, T', V]`), and aux `[B, T, len(aux_layer_ids) * H]`
            in the model dtype, or None.

        Masking and why no KV rollback is needed: a query at position `p` attends exactly to
        cache indices `0..p` of its row (the mask is built from `positions`, not from a stored
        length). After a verification round commits length `n`, cache indices `>= n` may still
        hold K/V of rejected drafts, but the next forward over that row starts at position `n`
        and writes indices `n, n+1, ...` before any layer reads them (each layer writes, then
        reads), and a query at position `p` never looks past `p`. So a stale entry is always
        either overwritten before it is read or never read at all.
        """
        c = self.config
        B, T = input_ids.shape
        if attn_len is None:
            attn_len = self._check_bounds(positions, cache_rows) + 1
            attn_len = max(attn_len, 1)
        elif not 1 <= attn_len <= self.max_seq_len:
            raise ValueError(f"attn_len={attn_len} must be in 1..max_seq_len={self.max_seq_len}")
        if aux_layer_ids is not None:
            bad = [j for j in aux_layer_ids if not 0 <= j < c.num_layers]
            if bad:
                raise ValueError(
                    f"aux_layer_ids {bad} out of range: the target has {c.num_layers} decoder "
                    f"layers (taps 0..{c.num_layers - 1})"
                )

        valid = positions >= 0  # [B, T]
        pos = positions.clamp(min=0)  # padding computes at position 0 (finite garbage)
        ids = torch.where(valid, input_ids, torch.zeros_like(input_ids))
        write_rows = cache_rows[:, None].expand(B, T)
        write_pos = torch.where(valid, positions, torch.full_like(positions, self.max_seq_len))

        # [B, 1, T * group, L]: slot (b, t) may read cache index j of its row iff j <= pos;
        # padding slots read index 0 only, so no softmax row is empty (no NaN).
        g = c.num_heads // c.num_kv_heads
        keys = torch.arange(attn_len, device=positions.device)
        mask = keys <= pos[..., None]  # [B, T, L]
        mask = mask[:, None, :, None, :].expand(B, 1, T, g, attn_len).reshape(B, 1, T * g, -1)

        cos, sin = self.rotary(pos)  # [B, T, head_dim] fp32
        x = self.model.embed_tokens(ids)  # [B, T, H]
        taps: dict[int, torch.Tensor] = {}
        wanted = set(aux_layer_ids or ())
        for j, layer in enumerate(self.model.layers):
            if j in wanted:
                taps[j] = x
            x = layer(x, cos, sin, write_rows, write_pos, cache_rows, mask, attn_len)
        if logit_index is not None:
            x = torch.gather(x, 1, logit_index[..., None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self.model.norm(x)).float()
        aux = None
        if aux_layer_ids is not None:
            aux = torch.cat([taps[j] for j in aux_layer_ids] or [x.new_zeros(B, T, 0)], dim=-1)
        return logits, aux


class LlamaForCausalLM(NativeCausalLM):
    """Llama 2 / 3 / 3.1 (llama3 RoPE scaling), untied or tied head, optional biases."""

    hf_model_types = ("llama",)


class Qwen2ForCausalLM(NativeCausalLM):
    """Qwen2 / Qwen2.5: bias on q/k/v (always), none on o_proj or the MLP."""

    hf_model_types = ("qwen2",)

    @classmethod
    def config_from_hf(cls, hf: Any, eos_token_ids: list[int]) -> NativeConfig:
        cfg = super().config_from_hf(hf, eos_token_ids)
        cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias = True, False, False
        return cfg


class Qwen3ForCausalLM(NativeCausalLM):
    """Qwen3 (dense): per-head RMSNorm on q and k before RoPE; `attention_bias` on all four
    projections when set; usually a tied head."""

    hf_model_types = ("qwen3",)

    @classmethod
    def config_from_hf(cls, hf: Any, eos_token_ids: list[int]) -> NativeConfig:
        cfg = super().config_from_hf(hf, eos_token_ids)
        cfg.qk_norm, cfg.mlp_bias = True, False
        return cfg
