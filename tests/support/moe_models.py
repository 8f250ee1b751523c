"""Tiny random MoE targets from scaled-down configs of the real architectures (transformers'
`GptOssConfig`, `Qwen3MoeConfig`), for the MoE families' parity, training and runner tests.
Saved with `save_pretrained` (`tests.support.tiny_models.save_tiny_target`), so the files on
disk are in the layout the released checkpoints use (gpt-oss: fused `[E, H, 2I]` experts with
biases and per-head `sinks`; Qwen3-MoE: one tensor per expert, `mlp.experts.{e}.*_proj`)."""

from __future__ import annotations

import random


def gpt_oss_config(
    vocab_size: int = 512,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    experts: int = 4,
    top_k: int = 2,
    intermediate: int = 32,
    window: int = 8,
    max_len: int = 512,
    yarn_factor: float = 4.0,
    original_max: int = 64,
    **extra,
):
    """gpt-oss: sinks, sliding windows of `window` keys on the even layers, YaRN RoPE
    (`truncate: false`), biases on q/k/v/o and on the experts, top-k-then-softmax routing."""
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=window,
        max_position_embeddings=max_len,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": yarn_factor,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": original_max,
            "truncate": False,
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )


def qwen3_moe_config(
    vocab_size: int = 512,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    experts: int = 4,
    top_k: int = 2,
    moe_intermediate: int = 32,
    norm_topk_prob: bool = True,
    mlp_only_layers: list[int] | None = None,
    max_len: int = 512,
    **extra,
):
    """Qwen3-MoE: qk-norm, softmax-then-top-k routing renormalised with `norm_topk_prob`, no
    shared expert; `mlp_only_layers` are dense SwiGLU layers of `intermediate_size`."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * moe_intermediate,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers or []),
        max_position_embeddings=max_len,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )


def random_gpt_oss_configs(n: int, seed: int = 0) -> list:
    """`n` varied gpt-oss configs: layer counts, head groups, experts and top-k, windows from
    2 keys up, YaRN factors, with and without a tied head."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        heads = rng.choice([2, 4, 8])
        out.append(
            gpt_oss_config(
                layers=rng.choice([2, 3, 4, 5]),
                heads=heads,
                kv_heads=rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
                head_dim=rng.choice([8, 16]),
                experts=rng.choice([2, 4, 8]),
                top_k=rng.choice([1, 2]),
                intermediate=rng.choice([16, 32, 48]),
                window=rng.choice([2, 3, 5, 8, 16]),
                yarn_factor=rng.choice([2.0, 4.0, 32.0]),
                original_max=rng.choice([16, 64, 4096]),
            )
        )
    return out


def random_qwen3_moe_configs(n: int, seed: int = 0) -> list:
    """`n` varied Qwen3-MoE configs: experts and top-k, with and without `norm_topk_prob`,
    some layers dense (`mlp_only_layers`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        layers = rng.choice([2, 3, 4])
        heads = rng.choice([2, 4, 8])
        experts = rng.choice([2, 4, 8])
        out.append(
            qwen3_moe_config(
                layers=layers,
                heads=heads,
                kv_heads=rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
                head_dim=rng.choice([8, 16]),
                experts=experts,
                top_k=rng.choice([k for k in (1, 2, 3) if k <= experts]),
                moe_intermediate=rng.choice([16, 32]),
                norm_topk_prob=rng.choice([True, False]),
                mlp_only_layers=rng.sample(range(layers), rng.choice([0, 1])),
            )
        )
    return out
