"""EAGLE-3 drafter module: one definition used by training (`drafttrain`) and the runner.

Vocabulary (used throughout the project):
- *draft step*: one drafter forward that proposes one token per row (chain drafting).
- *aux taps*: target hidden states entering target layers `aux_layer_ids` (DESIGN 3.2),
  concatenated to `[..., 3 * target_hidden]` and projected by `fc` to the drafter width.
- *carried feature*: what a row feeds as `hidden` into the next draft step: `fc(aux)` at
  step 0, the drafter's own *pre-norm* output afterwards (convention 5).
- *draft vocabulary*: the `draft_vocab_size` ids the `lm_head` scores (`draftinfer.conventions.vocab`).

Architecture (vLLM / SGLang `LlamaForCausalLMEagle3` layout): layer 0 normalizes the token
embedding (`input_layernorm`) and the carried feature (`hidden_norm`) and attends over their
concatenation (qkv input width 2H); later layers (P-EAGLE style stacks) are plain Llama
layers. The residual stream starts from the carried feature (or its normed version with
`norm_before_residual`). `norm` gives the logits' input; the stream before it is the
carried feature for the next step. RoPE reads `rope_pos` (`[B, T]` or `[3, B, T]`) only.
"""

from __future__ import annotations

import torch
from torch import nn

from draftinfer.conventions.vocab import draft_to_target_ids, identity_maps
from draftinfer.conventions.window import TokenEmbeds, token_embeddings
from draftinfer.kinds.eagle3.config import Eagle3Config
from draftinfer.models.layers import Attention, AttnFn, RMSNorm, SwiGLU, head_logits
from draftinfer.models.rope import RotaryEmbedding


def _attention(c: Eagle3Config, in_features: int) -> Attention:
    return Attention(
        in_features,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.attention_bias,
    )


class _FirstLayer(nn.Module):
    """Layer 0: attends over `[input_layernorm(embeds), hidden_norm(feature)]` (width 2H)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _attention(c, 2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, embeds, feature, cos, sin, attn_fn: AttnFn, idx: int) -> torch.Tensor:
        e = self.input_layernorm(embeds)
        h = self.hidden_norm(feature)
        residual = h if self.norm_before_residual else feature
        x = residual + self.self_attn(torch.cat([e, h], dim=-1), cos, sin, attn_fn, idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Layer(nn.Module):
    """Layers >= 1: a plain pre-norm Llama decoder layer over the residual stream."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _attention(c, c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, attn_fn: AttnFn, idx: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_fn, idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(nn.Module):
    """`fc` + decoder layer(s) + `norm` + `lm_head` over the draft vocabulary.

    `embed_tokens` is the target's input embedding, frozen and never exported (engines share
    the target's); it is a parameter with `requires_grad=False`.
    """

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            [_FirstLayer(c)] + [_Layer(c) for _ in range(c.num_hidden_layers - 1)]
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        # Draft vocabulary maps (convention 8). Identity until set from data.
        d2t, t2d = identity_maps(c.vocab_size, c.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    # -- pieces the callers compose -------------------------------------------------------
    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (aux taps) `[..., 3 * target_hidden]` -> step-0 carried feature
        `[..., H]`."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        feature: torch.Tensor,
        rope_pos: torch.Tensor,
        attn_fn: AttnFn,
        mm: TokenEmbeds | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over rows.

        input_ids `[B, T]` (token each row consumes), feature `[B, T, H]` (carried feature),
        rope_pos `[B, T]` or `[3, B, T]`, mm: the target's input embeddings of the rows whose
        token is a multimodal placeholder (`draftinfer.conventions.window`) -> (normed `[B, T, H]` for
        `logits`, pre-norm `[B, T, H]` = the next step's carried feature).
        """
        cos, sin = self.rotary(rope_pos)
        embeds = token_embeddings(self.embed_tokens, input_ids, mm).to(feature.dtype)
        x = self.layers[0](embeds, feature, cos, sin, attn_fn, 0)
        for i, layer in enumerate(self.layers[1:], start=1):
            x = layer(x, cos, sin, attn_fn, i)
        return self.norm(x), x

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """`[..., H]` -> draft-vocabulary logits `[..., draft_vocab_size]`."""
        return head_logits(self.lm_head, normed)

    def draft_vocab_ids(self) -> torch.Tensor:
        """Target id of every draft id `[Dd]` (`i + d2t[i]`)."""
        return draft_to_target_ids(self.d2t)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything the drafter owns: all weights except the shared target embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load exactly `trainable_state_dict()`'s tensors (strict: the shared embedding is
        the only tensor not in a drafter checkpoint, and it keeps its current value)."""
        self.load_state_dict({**tensors, "embed_tokens.weight": self.embed_tokens.weight})
