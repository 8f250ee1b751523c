"""The zoo's DeepSeek-V3 target, `deepseek-tiny` (`DeepseekV3ForCausalLM`; `build_moe` is the
CLI, `moe_targets.DEEPSEEK_V3` its spec): what it is and how it trains, apart from the steps
every zoo build shares.

- **Anatomy** (`DeepSeekShape`): MLA with a low-rank query (`q_lora_rank`) and the compressed KV
  (`kv_lora_rank` plus the decoupled RoPE key), interleaved RoPE with YaRN scaled down from the
  release (factor 40 over 4,096 -> 8 over 256, `mscale = mscale_all_dim = 1`); sigmoid routing
  over 8 experts in 4 groups (top-2 groups, top-2 experts) with the selection-only correction
  bias, renormalised weights times `routed_scaling_factor` 2.5, one shared expert, the first
  layer dense (`first_k_dense_replace = 1`), untied embeddings, and one MTP layer
  (`num_nextn_predict_layers = 1`) at `model.layers.{L}.*`, as DeepSeek-V3 ships it.
- **Training** (`train_with_mtp`): DeepSeek-V3's joint objective (`mtp_joint.NextTokenWithMTP`:
  the main next-token loss plus 0.3 x the MTP layer's loss, its gradient reaching the main
  model) and its auxiliary-loss-free balancing (`BiasBalancer`): after every optimizer step
  each MoE layer's `e_score_correction_bias` moves by `rate` against the sign of its experts'
  load imbalance over the step's tokens (the technical report, section 2.1.2: bias update speed
  0.001); no load-balancing loss term.
- **Chat**: DeepSeek-V3's format, written out for the zoo: `<｜begin▁of▁sentence｜>` and the
  system prompt, `<｜User｜>` before each question, `<｜Assistant｜>` before each answer and
  `<｜end▁of▁sentence｜>` after it (the EOS the target stops at).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from drafttrain.trainer.loop import LoopHook

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIALS = (BOS, EOS, PAD, USER, ASSISTANT)

TEMPLATE = (
    "{{- '" + BOS + "' -}}"
    "{%- for m in messages -%}{%- if m.role == 'system' -%}{{- m.content -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '" + USER + "' + m.content -}}"
    "{%- elif m.role == 'assistant' -%}{{- '" + ASSISTANT + "' + m.content + '" + EOS + "' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT + "' -}}{%- endif -%}"
)

MTP_WEIGHT = 0.3  # DeepSeek-V3's lambda for the first 10T tokens
BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed


@dataclass
class DeepSeekShape:
    """DeepSeek-V3's anatomy at toy scale (module docstring); bf16 weights ~3 MB. 8 decoder
    layers, so the default aux taps (2, 4, 5) are distinct."""

    hidden_size: int = 128
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 256  # the dense first layer
    num_experts: int = 8
    n_group: int = 4
    topk_group: int = 2
    num_experts_per_tok: int = 2
    expert_intermediate_size: int = 32
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6


def deepseek_v3_config(tok, s: DeepSeekShape):
    from transformers import DeepseekV3Config

    ids = tok.convert_tokens_to_ids
    return DeepseekV3Config(
        vocab_size=len(tok),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        moe_intermediate_size=s.expert_intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_attention_heads,
        q_lora_rank=s.q_lora_rank,
        kv_lora_rank=s.kv_lora_rank,
        qk_nope_head_dim=s.qk_nope_head_dim,
        qk_rope_head_dim=s.qk_rope_head_dim,
        v_head_dim=s.v_head_dim,
        n_routed_experts=s.num_experts,
        num_experts_per_tok=s.num_experts_per_tok,
        n_group=s.n_group,
        topk_group=s.topk_group,
        n_shared_experts=s.n_shared_experts,
        first_k_dense_replace=s.first_k_dense_replace,
        routed_scaling_factor=s.routed_scaling_factor,
        norm_topk_prob=True,
        rope_interleave=True,
        max_position_embeddings=s.max_position_embeddings,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,  # 8 x 256 = 2048 = max_position_embeddings
            "original_max_position_embeddings": 256,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=s.rms_norm_eps,
        attention_bias=False,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=ids(BOS),
        eos_token_id=ids(EOS),
        pad_token_id=ids(PAD),
    )


def deepseek_answer(generated: str) -> str:
    """The answer of a generation decoded with its special tokens."""
    return generated.split(EOS, 1)[0].split(PAD, 1)[0].strip()


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE layers' routers (modules holding `e_score_correction_bias`), in layer order."""
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]


class ExpertCounts:
    """Forward hooks on every router counting its top-k selections (transformers' router
    returns `(logits, weights, indices)`): `counts [L_moe, E]` since the last `reset`."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        E = self.routers[0].e_score_correction_bias.numel()
        self.counts = torch.zeros(len(self.routers), E)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(module, args, out):
            idx = out[2].detach().flatten()
            self.counts[i] += torch.bincount(idx, minlength=self.counts.shape[1]).float()

        return hook

    def reset(self) -> None:
        self.counts.zero_()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class BiasBalancer(LoopHook):
    """DeepSeek-V3's auxiliary-loss-free balancing, after every optimizer step: bias_e +=
    rate * sign(mean load - load_e) per MoE layer over the step's routed tokens."""

    every_n_steps = 1

    def __init__(self, counts: ExpertCounts, rate: float = BIAS_RATE):
        self.c, self.rate = counts, rate

    @torch.no_grad()
    def __call__(self, step: int, last_log: dict[str, float]) -> dict[str, float]:
        load = self.c.counts  # [L_moe, E]
        step_sign = torch.sign(load.mean(-1, keepdim=True) - load)
        for r, s in zip(self.c.routers, step_sign):
            r.e_score_correction_bias += self.rate * s.to(r.e_score_correction_bias)
        share = load / load.sum(-1, keepdim=True).clamp(min=1)
        self.c.reset()
        return {"max_expert_share": float(share.max())}


def train_with_mtp(model, examples, pad_id: int, args, n_mtp: int, weight: float = MTP_WEIGHT):
    """Train `model` in place with `n_mtp` MTP layers of transformers' own making
    (`MtpModel`), jointly (module docstring). Returns `(log rows, per-step losses, mtp)`."""
    from transformers.modeling_layers import MtpModel

    from drafttrain.zoo.mtp_joint import NextTokenWithMTP
    from drafttrain.zoo.target_train import TokenBudgetBatches, decay_groups, train_target
    from drafttrain.zoo.text_train import collate

    mtp = MtpModel(model, n_mtp)
    mtp.apply(model._init_weights)  # transformers leaves some MtpModel tensors uninitialised
    objective = NextTokenWithMTP(model, mtp, weight)
    counts = ExpertCounts(model)
    batches = TokenBudgetBatches(
        examples, args.tokens_per_batch, args.seed, lambda idx: collate(examples, idx, pad_id)
    )
    groups = decay_groups(list(objective.named_parameters()), args.weight_decay)
    try:
        log, losses = train_target(
            model,
            batches,
            args,
            groups,
            torch.device("cpu"),
            hooks=[BiasBalancer(counts)],
            objective=objective,
        )
    finally:
        counts.remove()
    return log, losses, mtp


@torch.no_grad()
def expert_load(model, examples, pad_id: int, top_k: int, batch: int = 32) -> dict:
    """`build_moe.expert_load` for DeepSeek-V3 (its routers' own selections, bias included):
    the share of the top-k slots each expert takes, per MoE layer, over the examples' tokens
    (pads included: right padding, a small share)."""
    from drafttrain.zoo.text_train import collate

    counts = ExpertCounts(model)
    try:
        for b in range(0, len(examples), batch):
            inputs = collate(examples, list(range(b, min(b + batch, len(examples)))), pad_id)
            model(input_ids=inputs["input_ids"], use_cache=False)
        shares = counts.counts / counts.counts.sum(-1, keepdim=True)
    finally:
        counts.remove()
    return {
        "per_layer": [[round(x, 4) for x in row] for row in shares.tolist()],
        "min": round(float(shares.min()), 4),
        "max": round(float(shares.max()), 4),
    }
