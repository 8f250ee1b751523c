"""The zoo's MoE targets (`build_moe` is the CLI): what each is, apart from the steps every
zoo build shares (`target_build`, `text_train`, `target_train`).

- **`gpt-oss-tiny`** (`GptOssForCausalLM`): sinks, sliding windows of `SLIDING_WINDOW` keys on
  the even layers (prompts cross them: the harmony system message alone is ~50 tokens), YaRN
  scaled down from the release (factor 32 over 4,096 -> 8 over 256, `truncate: false`, theta
  150,000), biased attention and experts, top-k-then-softmax routing; chat in the harmony
  format (`drafttrain.families.gpt_oss.harmony`, the date pinned) over `chat_harmony/`: the
  zoo's chat with an analysis message (`thinking`) on each conversation's last answer, so the
  target writes both channels as gpt-oss does.
- **`qwen3-moe-tiny`** (`Qwen3MoeForCausalLM`): qk-norm, softmax-then-top-k routing with
  `norm_topk_prob`, no shared expert, plain RoPE (theta 1e6) as Qwen3-30B-A3B; chat in Qwen3's
  format (ChatML with the `<think>` block the last answer carries, empty here), so the target
  writes `<think>\\n\\n</think>\\n\\n` before each answer as Qwen3 does in thinking mode.

- **`deepseek-tiny`** (`DeepseekV3ForCausalLM`): MLA, grouped sigmoid routing with the
  correction bias, a shared expert, a dense first layer and its own MTP layer trained jointly;
  `deepseek_target` says what it is.
- **`glm-tiny`** (`Glm4MoeForCausalLM`): GQA with partial rotary and the q/k norm, the same
  grouped sigmoid routing with the correction bias, a shared expert, a dense first layer and
  its own MTP layer, trained as `deepseek-tiny` is; `glm_target` says what it is.

gpt-oss and Qwen3-MoE: 8 decoder layers (the default aux taps (2, 4, 5) are distinct), hidden 256, 4 query heads
of head_dim 64 over 1 KV head, 8 experts of width 32 with top-2 routing, untied embeddings (as
both releases), a byte-level BPE of 4,096 ids trained on the chat rendered in the target's own
format (`text_data.train_tokenizer`: the Llama-3 pre-tokenizer, that format's specials), and
the routers' load-balancing loss (transformers' `load_balancing_loss_func`) added with weight
0.01 (Switch Transformer's), so the experts stay in use.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from drafttrain.families.gpt_oss import harmony
from drafttrain.zoo import deepseek_target, glm_target

SLIDING_WINDOW = 32
# The routers' load-balancing weight the builds train with (Switch Transformer's), written into
# `router_aux_loss_coef` (the releases: gpt-oss 0.9, Qwen3-30B-A3B 0.001).
GPT_OSS_AUX_LOSS = QWEN3_AUX_LOSS = 0.01


@dataclass
class MoEShape:
    """The anatomy both MoE targets share (module docstring); bf16 weights ~10 MB."""

    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 64
    num_experts: int = 8
    num_experts_per_tok: int = 2
    expert_intermediate_size: int = 32
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5


# --------------------------------------------------------------------------- gpt-oss

# The gpt-oss zoo's system message names a short identity: the release's line would add ~16
# tokens to every conversation of a CPU-trained toy; the rest of the system message is the
# release's, date pinned (`harmony.harmony_template`).
GPT_OSS_IDENTITY = "You are a tiny zoo model."

# (pattern on the user question, the analysis the target writes before answering it): a plan
# keyed on the kind of question, as a reasoning model's short analysis is; checked in order.
_ANALYSES: tuple[tuple[str, str], ...] = (
    (r"default value", "The user asks for a default value. Read it from the signature."),
    (r"parameters", "The user asks for the parameters. List each one with its default."),
    (r"signature", "The user asks for the signature. Quote it in backticks."),
    (r"Which module defines", "The user asks where a name is defined. Name the module."),
    (r"inherit|base class", "The user asks for the base classes. Name them."),
    (r"methods", "The user asks for the methods. List the public ones."),
    (r"List the public", "The user asks for a listing. List the public names of the module."),
    (r"How do I create", "The user wants to build an object. Show the constructor call."),
    (r"how to call|example call", "The user wants an example call. Write a python block."),
    (r"module( for)?\b", "The user asks about a module. Say what it is for."),
    (r"Explain|Describe|What does|What is", "The user asks what it does. Summarise its docstring."),
)
_DEFAULT_ANALYSIS = "The user asks about the standard library. Answer briefly."


def analysis_of(question: str) -> str:
    """The analysis message the gpt-oss zoo target writes before answering `question`."""
    for pattern, analysis in _ANALYSES:
        if re.search(pattern, question, flags=re.IGNORECASE):
            return analysis
    return _DEFAULT_ANALYSIS


def with_analysis(rows: list[dict]) -> list[dict]:
    """The zoo's chat rows with a `thinking` field on each conversation's last answer (the only
    one the harmony template renders it for), derived from the question it answers."""
    out = []
    for row in rows:
        msgs = [dict(m) for m in row["messages"]]
        last = msgs[-1]
        if last["role"] == "assistant" and len(msgs) >= 2 and msgs[-2]["role"] == "user":
            last["thinking"] = analysis_of(msgs[-2]["content"])
        out.append({**row, "messages": msgs})
    return out


def gpt_oss_config(tok, s: MoEShape):
    from transformers import GptOssConfig

    ids = tok.convert_tokens_to_ids
    return GptOssConfig(
        vocab_size=len(tok),
        hidden_size=s.hidden_size,
        intermediate_size=s.expert_intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        num_local_experts=s.num_experts,
        num_experts_per_tok=s.num_experts_per_tok,
        sliding_window=SLIDING_WINDOW,
        # The release: even layers sliding, odd layers full.
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(s.num_hidden_layers)
        ],
        max_position_embeddings=s.max_position_embeddings,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,  # 8 x 256 = 2048 = max_position_embeddings
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 256,
            "truncate": False,
        },
        rms_norm_eps=s.rms_norm_eps,
        attention_bias=True,
        tie_word_embeddings=False,
        router_aux_loss_coef=GPT_OSS_AUX_LOSS,
        initializer_range=0.02,
        bos_token_id=ids("<|startoftext|>"),
        eos_token_id=ids("<|return|>"),
        pad_token_id=ids("<|endoftext|>"),
    )


def harmony_answer(generated: str) -> str:
    """The final channel's text of a generation decoded with its special tokens."""
    final = generated.rsplit("<|channel|>final<|message|>", 1)
    text = final[1] if len(final) == 2 else generated
    for stop in harmony.STOP_TOKENS + ("<|end|>",):
        text = text.split(stop, 1)[0]
    return text


# --------------------------------------------------------------------------- Qwen3-MoE

QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

# Qwen3's chat format, written out for the zoo: ChatML; an assistant turn after the last user
# message renders a think block when it is the conversation's last message or carries
# reasoning (`reasoning_content`, else `thinking`), empty when it has none; the generation
# prompt is `<|im_start|>assistant\n` (the model writes the think block), plus an empty block
# with `enable_thinking=false`.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}"
    "{%- set reasoning = m.reasoning_content -%}"
    "{%- elif m.thinking is defined and m.thinking is not none -%}"
    "{%- set reasoning = m.thinking -%}"
    "{%- else -%}{%- set reasoning = '' -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + m.content.lstrip('\\n') + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)


def qwen3_moe_config(tok, s: MoEShape):
    from transformers import Qwen3MoeConfig

    ids = tok.convert_tokens_to_ids
    return Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=s.hidden_size,
        intermediate_size=4 * s.expert_intermediate_size,  # dense layers: none here
        moe_intermediate_size=s.expert_intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        num_experts=s.num_experts,
        num_experts_per_tok=s.num_experts_per_tok,
        norm_topk_prob=True,  # Qwen3-30B-A3B
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=s.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=s.rms_norm_eps,
        tie_word_embeddings=False,
        router_aux_loss_coef=QWEN3_AUX_LOSS,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )


def qwen3_answer(generated: str) -> str:
    """The answer of a generation decoded with its special tokens (think block dropped)."""
    text = generated.rsplit("</think>", 1)[-1]
    return text.split("<|im_end|>", 1)[0].split("<|endoftext|>", 1)[0].strip()


# --------------------------------------------------------------------------- the specs


@dataclass(frozen=True)
class ZooMoE:
    """One MoE zoo target: its files, chat format, config and what its build measures."""

    family: str  # the target family (drafttrain.families / draftinfer.families)
    model_dir: str  # under the zoo: `zoo:<model_dir>`
    data_dir: str  # the chat it trains on, under the zoo (written by the build if `rows`)
    chat_template: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    stop_tokens: tuple[str, ...]  # generation_config.eos_token_id
    config: Callable[[Any, MoEShape], Any]
    answer: Callable[[str], str]  # the answer text of a generation decoded with specials
    attn_implementation: str
    aux_loss_coef: float
    rows: Callable[[list[dict]], list[dict]] | None = None  # the zoo chat -> this target's chat
    # MoEShape, or the family's own (DeepSeekShape, GlmShape)
    shape: Any = field(default_factory=MoEShape)
    # MTP layers trained with the target and shipped in its files (DeepSeek-V3's joint
    # objective, `deepseek_target.train_with_mtp`); 0: plain next-token training.
    mtp_layers: int = 0
    # `expert_load(model, examples, pad_id, top_k)` for a model whose routers transformers does
    # not record (default: `build_moe.expert_load`, from `output_router_logits`).
    expert_load: Callable | None = None
    # `build_moe.train_args` fields this target trains with unless the command line names them.
    train_defaults: dict = field(default_factory=dict)

    def shape_dict(self) -> dict:
        return {**asdict(self.shape), "family": self.family}


GPT_OSS = ZooMoE(
    family="gpt_oss",
    model_dir="gpt-oss-tiny",
    data_dir="chat_harmony",
    chat_template=harmony.harmony_template(model_identity=GPT_OSS_IDENTITY),
    specials=harmony.SPECIAL_TOKENS,
    bos=None,  # as o200k_harmony: `tokenizer(text)` adds nothing
    eos="<|return|>",
    pad="<|endoftext|>",
    stop_tokens=harmony.STOP_TOKENS,
    config=gpt_oss_config,
    answer=harmony_answer,
    # transformers has no SDPA path for sinks (drafttrain.families.gpt_oss).
    attn_implementation="eager",
    aux_loss_coef=GPT_OSS_AUX_LOSS,
    rows=with_analysis,
)
QWEN3_MOE = ZooMoE(
    family="qwen3_moe",
    model_dir="qwen3-moe-tiny",
    data_dir="chat",
    chat_template=QWEN3_TEMPLATE,
    specials=QWEN3_SPECIALS,
    bos=None,  # Qwen's tokenizers add no BOS
    eos="<|im_end|>",
    pad="<|endoftext|>",
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    config=qwen3_moe_config,
    answer=qwen3_answer,
    attn_implementation="sdpa",
    aux_loss_coef=QWEN3_AUX_LOSS,
)
DEEPSEEK_V3 = ZooMoE(
    family="deepseek_v3",
    model_dir="deepseek-tiny",
    data_dir="chat",
    chat_template=deepseek_target.TEMPLATE,
    specials=deepseek_target.SPECIALS,
    bos=None,  # the template writes <｜begin▁of▁sentence｜> itself
    eos=deepseek_target.EOS,
    pad=deepseek_target.PAD,
    stop_tokens=(deepseek_target.EOS,),
    config=deepseek_target.deepseek_v3_config,
    answer=deepseek_target.deepseek_answer,
    attn_implementation="eager",
    aux_loss_coef=0.0,  # auxiliary-loss-free: the correction bias balances (deepseek_target)
    shape=deepseek_target.DeepSeekShape(),
    mtp_layers=1,
    expert_load=deepseek_target.expert_load,
    # Sized to ~10 min on 2 shared cores: the joint objective's step at 2,048 tokens takes
    # 2-4 s there (the main and the MTP head over a 4,096-id vocabulary, both backward).
    train_defaults={"steps": 200, "tokens_per_batch": 2048, "warmup": 20},
)
GLM4_MOE = ZooMoE(
    family="glm4_moe",
    model_dir="glm-tiny",
    data_dir="chat",
    chat_template=glm_target.TEMPLATE,
    specials=glm_target.SPECIALS,
    bos=None,  # the template writes [gMASK]<sop> itself
    eos=glm_target.EOS,
    pad=glm_target.EOS,  # GLM-4.5's tokenizer pads with its EOS
    stop_tokens=glm_target.STOP_TOKENS,
    config=glm_target.glm4_moe_config,
    answer=glm_target.glm_answer,
    attn_implementation="eager",
    aux_loss_coef=0.0,  # auxiliary-loss-free, as deepseek-tiny
    shape=glm_target.GlmShape(),
    mtp_layers=1,
    expert_load=deepseek_target.expert_load,  # the same router class (correction bias)
    train_defaults=DEEPSEEK_V3.train_defaults,  # the same budget as deepseek-tiny
)
TARGETS = {t.family: t for t in (GPT_OSS, QWEN3_MOE, DEEPSEEK_V3, GLM4_MOE)}
