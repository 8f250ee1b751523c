"""The zoo's GLM-4.5 target, `glm-tiny` (`Glm4MoeForCausalLM`; `build_moe` is the CLI,
`moe_targets.GLM4_MOE` its spec): what it is, apart from the steps every zoo build shares and
the training it shares with `deepseek-tiny`.

- **Anatomy** (`GlmShape`): GQA (4 query heads over 2 KV heads of `head_dim` 32) with
  **partial rotary** (`partial_rotary_factor` 0.5: RoPE on the first half of each head, plain
  RoPE at theta 1e6, no scaling, as GLM-4.5), q/k/v biases (`attention_bias`; `o_proj` has
  none) and the per-head q/k RMSNorm (`use_qk_norm`, GLM-4.5's config sets it; -Air's does not);
  DeepSeek-V3's sigmoid router with the selection-only `e_score_correction_bias`, renormalised
  weights times `routed_scaling_factor` 2.5 over 8 experts, top-2, in `n_group` =
  `topk_group` = 1 (GLM-4.5's: the group limit selects every group), one shared expert, the
  first layer dense (`first_k_dense_replace` = 1), untied embeddings, and one MTP layer
  (`num_nextn_predict_layers` = 1) at `model.layers.{L}.*`, as GLM-4.5 ships it.
- **Training**: DeepSeek-V3's, which GLM-4.5 follows (its report: sigmoid gates, loss-free
  balance routing, an MTP layer): `deepseek_target.train_with_mtp` (the main next-token loss
  plus 0.3 x the MTP layer's loss, the correction bias moved after every step, no balancing
  loss).
- **Chat**: GLM-4.5's format written out for the zoo: `[gMASK]<sop>`, `<|system|>\\n{system}`,
  `<|user|>\\n{question}`, `<|assistant|>\\n<think></think>\\n{answer}` (the empty think block
  GLM-4.5 writes for a turn without reasoning; the generation prompt is `<|assistant|>`, so the
  target writes the block). GLM's template closes no turn: the release stops at the next
  role token (`generation_config.eos_token_id`: `<|endoftext|>`, `<|user|>`,
  `<|observation|>`). Here an earlier answer is closed by the next `<|user|>` (as released),
  and the last message by `<|endoftext|>` (the one addition, so the target learns to stop after
  the last answer too: the training side's loss mask takes `<|endoftext|>` as the last turn's
  end and `<|user|>` as an earlier turn's, `drafttrain.data.chat.end_of_turn_markers`). The pad
  is `<|endoftext|>`, as GLM-4.5's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

MASK, GMASK, SOP = "[MASK]", "[gMASK]", "<sop>"
SYSTEM, USER, ASSISTANT, OBSERVATION = "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"
EOS = "<|endoftext|>"
THINK, END_THINK = "<think>", "</think>"
# In GLM-4.5's order (151329...): `[MASK]`, never in the chat, is the reserved id a block
# drafter's mask slots take (`drafter.mask_token_id`: the pad is the EOS here).
SPECIALS = (EOS, MASK, GMASK, SOP, SYSTEM, USER, ASSISTANT, OBSERVATION, THINK, END_THINK)
STOP_TOKENS = (EOS, USER, OBSERVATION)  # GLM-4.5's generation_config.eos_token_id

TEMPLATE = (
    "{{- '" + GMASK + SOP + "' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- '" + SYSTEM + "\\n' + m.content -}}"
    "{%- elif m.role == 'user' -%}{{- '" + USER + "\\n' + m.content -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '" + ASSISTANT + "\\n" + THINK + END_THINK + "\\n' + m.content.strip() -}}"
    "{%- if loop.last -%}{{- '" + EOS + "' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT + "' -}}{%- endif -%}"
)


@dataclass
class GlmShape:
    """GLM-4.5's anatomy at toy scale (module docstring); bf16 weights ~5 MB. 8 decoder layers,
    so the default aux taps (2, 4, 5) are distinct."""

    hidden_size: int = 128
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = True
    attention_bias: bool = True
    intermediate_size: int = 256  # the dense first layer
    num_experts: int = 8
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 2
    expert_intermediate_size: int = 32
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5


def glm4_moe_config(tok, s: GlmShape):
    from transformers import Glm4MoeConfig

    ids = tok.convert_tokens_to_ids
    return Glm4MoeConfig(
        vocab_size=len(tok),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        moe_intermediate_size=s.expert_intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        partial_rotary_factor=s.partial_rotary_factor,
        use_qk_norm=s.use_qk_norm,
        attention_bias=s.attention_bias,
        n_routed_experts=s.num_experts,
        num_experts_per_tok=s.num_experts_per_tok,
        n_group=s.n_group,
        topk_group=s.topk_group,
        n_shared_experts=s.n_shared_experts,
        first_k_dense_replace=s.first_k_dense_replace,
        routed_scaling_factor=s.routed_scaling_factor,
        norm_topk_prob=True,
        num_mtp_layers=s.num_nextn_predict_layers,
        max_position_embeddings=s.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "partial_rotary_factor": s.partial_rotary_factor,
        },
        rms_norm_eps=s.rms_norm_eps,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=[ids(t) for t in STOP_TOKENS],
        pad_token_id=ids(EOS),
    )


def glm_answer(generated: str) -> str:
    """The answer of a generation decoded with its special tokens (think block dropped)."""
    text = generated.rsplit(END_THINK, 1)[-1]
    for stop in STOP_TOKENS:
        text = text.split(stop, 1)[0]
    return text.strip()
