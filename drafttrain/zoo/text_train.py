"""The zoo's target model: a tiny Llama-3.1-shaped `LlamaForCausalLM`, its training and eval.

Training objective: next-token cross-entropy on *assistant* tokens only (each assistant
message's content and its closing `<|eot_id|>`), averaged over those tokens in the batch.
System/user/header tokens are context, never targets: that is what a drafter is evaluated on
(the target's answers), and it spends the small capacity on answers.
On the project's trainer (`drafttrain.zoo.target_train`), fp32 on the CPU: AdamW (betas
0.9/0.95, weight decay on matrices only), linear warmup then cosine decay to 10% of the peak,
grad-norm clip 1.0, token-budget length-bucketed batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from drafttrain.zoo.target_train import TokenBudgetBatches, decay_groups, train_target
from drafttrain.zoo.text_data import BOS, EOT, EOT_TEXT, PAD


@dataclass
class TargetShape:
    """Llama-3.1 anatomy at toy scale: 8 layers so the default aux taps (2, 4, 5) differ."""

    hidden_size: int = 256
    intermediate_size: int = 288  # bf16 weights <= 9 MB with the 4096 x 256 tied embedding
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # GQA, 2 query heads per KV head
    head_dim: int = 64
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    # Llama-3.1 "llama3" RoPE scaling: 8 x 256 = 2048 = max_position_embeddings.
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-5


def llama_config(tokenizer, shape: TargetShape | None = None):
    from transformers import LlamaConfig

    s = shape or TargetShape()
    rope = {
        "rope_type": "llama3",
        "rope_theta": s.rope_theta,
        "factor": s.rope_factor,
        "low_freq_factor": s.rope_low_freq_factor,
        "high_freq_factor": s.rope_high_freq_factor,
        "original_max_position_embeddings": s.rope_original_max_position_embeddings,
    }
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        max_position_embeddings=s.max_position_embeddings,
        rms_norm_eps=s.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOT),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
    )


def generation_config(tokenizer):
    from transformers import GenerationConfig

    ids = tokenizer.convert_tokens_to_ids
    return GenerationConfig(
        bos_token_id=ids(BOS),
        eos_token_id=[ids(EOT), ids(EOT_TEXT)],
        pad_token_id=ids(PAD),
        do_sample=False,
        max_new_tokens=128,
    )


@dataclass
class TrainArgs:
    steps: int = 900
    tokens_per_batch: int = 4096  # padded tokens per optimizer step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0


Example = tuple[list[int], list[int]]  # (input ids, assistant mask), same length


def collate(examples: list[Example], idx: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids [B, T]` and next-token `labels [B, T]` (-100 where not trained).

    Right padding needs no attention mask: with a causal mask no real token sees a pad.
    """
    T = max(len(examples[i][0]) for i in idx)
    ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
    labels = torch.full((len(idx), T), -100, dtype=torch.long)
    for r, i in enumerate(idx):
        x, m = examples[i]
        ids[r, : len(x)] = torch.tensor(x)
        tgt = torch.tensor(x[1:] + [pad_id])
        keep = torch.tensor(m[1:] + [0], dtype=torch.bool)  # label at t is token t+1
        labels[r, : len(x)] = torch.where(keep, tgt, torch.full_like(tgt, -100))
    return {"input_ids": ids, "labels": labels}


def train(
    model, examples: list[Example], pad_id: int, args: TrainArgs, aux_loss_coef: float = 0.0
) -> tuple[list[dict], list[float]]:
    """Train in place on the CPU; returns the log (a row per 25 steps and the last) and the
    per-step losses. `aux_loss_coef`: an MoE model's load-balancing weight (`NextTokenLM`)."""
    batches = TokenBudgetBatches(
        examples, args.tokens_per_batch, args.seed, lambda idx: collate(examples, idx, pad_id)
    )
    groups = decay_groups(list(model.named_parameters()), args.weight_decay)
    return train_target(
        model, batches, args, groups, torch.device("cpu"), aux_loss_coef=aux_loss_coef
    )


@torch.no_grad()
def evaluate(model, examples: list[Example], pad_id: int, batch: int = 32) -> dict:
    """Teacher-forced assistant-token loss and greedy (argmax) next-token accuracy."""
    model.eval()
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    tot_loss = tot_ok = tot = 0.0
    for b in range(0, len(order), batch):
        inputs = collate(examples, order[b : b + batch], pad_id)
        labels = inputs.pop("labels")
        logits = model(**inputs, use_cache=False).logits.float()
        mask = labels != -100
        tot_loss += F.cross_entropy(logits[mask], labels[mask], reduction="sum").item()
        tot_ok += (logits[mask].argmax(-1) == labels[mask]).sum().item()
        tot += mask.sum().item()
    return {"loss": tot_loss / tot, "acc": tot_ok / tot, "tokens": int(tot)}


@torch.no_grad()
def generate_answers(
    model,
    tokenizer,
    rows: list[dict],
    max_new_tokens: int = 96,
    stop_ids: list[int] | None = None,
    answer=None,
) -> list[dict]:
    """Greedy answers to the last user turn of each row (batch 1, HF `generate`).

    `stop_ids`: the ids a finished answer ends with (default `<|eot_id|>`, `ends_with_eot`);
    `answer(text)`: the answer in a generation decoded with its special tokens (a format whose
    answer sits among channel or think markers), compared with the reference for `exact`;
    default: the generation decoded without them. With `answer`, `generated` keeps the
    special tokens (what the target wrote)."""
    stops = set(stop_ids or [tokenizer.convert_tokens_to_ids(EOT)])
    out = []
    for r in rows:
        msgs = r["messages"][:-1]
        enc = tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        new = gen[0, enc["input_ids"].shape[1] :].tolist()
        text = tokenizer.decode(new, skip_special_tokens=answer is None)
        said = answer(text) if answer is not None else text
        out.append(
            {
                "prompt": msgs[-1]["content"],
                "reference": r["messages"][-1]["content"],
                "generated": text,
                "ends_with_eot": bool(new) and new[-1] in stops,
                "exact": said.strip() == r["messages"][-1]["content"].strip(),
            }
        )
    return out


def shape_dict(shape: TargetShape | None = None) -> dict:
    return asdict(shape or TargetShape())
