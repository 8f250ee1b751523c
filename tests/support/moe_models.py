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


# YaRN settings of the MLA families' fixed test targets: `MLA_YARN` the parity targets' (DeepSeek-V3's
# factor 40, `mscale` = `mscale_all_dim`), `MLA_YARN_SHORT` the training and MTP targets' (a short
# original context, `mscale` != `mscale_all_dim`: the softmax scale's correction matters).
MLA_YARN = {
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
MLA_YARN_SHORT = {
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}


def _mla_moe_config(
    config_class,
    vocab_size: int = 512,
    layers: int = 3,
    hidden: int = 64,
    heads: int = 4,
    q_lora_rank: int | None = 24,
    kv_lora_rank: int = 16,
    qk_nope_head_dim: int = 8,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 12,
    experts: int = 8,
    n_group: int = 4,
    topk_group: int = 2,
    top_k: int = 2,
    moe_intermediate: int = 16,
    n_shared_experts: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 2.5,
    rope_interleave: bool = True,
    yarn: dict | None = None,
    attention_bias: bool = False,
    max_len: int = 512,
    **extra,
):
    """A config of `config_class` with DeepSeek-V3's MLA (low-rank q, the latent of
    `kv_lora_rank` plus the decoupled RoPE key) and its grouped routing: the fields DeepSeek-V3
    and GLM-4.7-Flash share (`extra`: each one's own). `yarn`: YaRN rope keys (`factor`,
    `mscale`, `mscale_all_dim`, ...) or None for plain RoPE."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn is not None:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, **yarn}
    return config_class(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        n_routed_experts=experts,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        n_shared_experts=n_shared_experts,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=routed_scaling_factor,
        rope_interleave=rope_interleave,
        rope_parameters=rope,
        attention_bias=attention_bias,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )


def deepseek_v3_config(first_k_dense_replace: int = 1, **kw):
    """DeepSeek-V3 (`_mla_moe_config`'s fields): MLA, group-limited sigmoid routing with the
    correction bias, shared experts, the first `first_k_dense_replace` layers dense."""
    from transformers import DeepseekV3Config

    return _mla_moe_config(DeepseekV3Config, first_k_dense_replace=first_k_dense_replace, **kw)


def _random_mla_dims(rng: random.Random) -> dict:
    """MLA's widths (with and without a q LoRA), drawn in one order for every MLA family."""
    return dict(
        hidden=rng.choice([32, 64]),
        heads=rng.choice([1, 2, 4]),
        q_lora_rank=rng.choice([None, 16, 24]),
        kv_lora_rank=rng.choice([8, 16, 32]),
        qk_nope_head_dim=rng.choice([4, 8, 16]),
        qk_rope_head_dim=rng.choice([4, 8]),
        v_head_dim=rng.choice([4, 8, 12]),
    )


def _random_mla_yarn(rng: random.Random, p: float, originals: list[int]) -> dict | None:
    """YaRN with probability `p` (factors up to DeepSeek's 40, `mscale` and `mscale_all_dim`
    equal or not), else None for plain RoPE."""
    if rng.random() >= p:
        return None
    return {
        "factor": rng.choice([2.0, 4.0, 40.0]),
        "original_max_position_embeddings": rng.choice(originals),
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": rng.choice([0.707, 1.0]),
        "mscale_all_dim": rng.choice([0.707, 1.0]),
    }


def random_deepseek_v3_configs(n: int, seed: int = 0) -> list:
    """`n` varied DeepSeek-V3 configs: MLA ranks and head widths (with and without a q
    LoRA), interleaved or NeoX RoPE, plain RoPE or YaRN (factors, `mscale` and
    `mscale_all_dim` equal or not), expert groups (one group, every group kept, one kept),
    top-k, shared experts, dense first layers, `norm_topk_prob`, attention biases."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        layers = rng.choice([2, 3, 4])
        n_group = rng.choice([1, 2, 4])
        experts = n_group * rng.choice([2, 3, 4])
        topk_group = rng.randint(1, n_group)
        yarn = _random_mla_yarn(rng, 0.6, [16, 64, 4096])
        out.append(
            deepseek_v3_config(
                layers=layers,
                **_random_mla_dims(rng),
                experts=experts,
                n_group=n_group,
                topk_group=topk_group,
                top_k=rng.randint(1, min(4, topk_group * (experts // n_group))),
                moe_intermediate=rng.choice([8, 16]),
                n_shared_experts=rng.choice([1, 2]),
                first_k_dense_replace=rng.randint(0, layers - 1),
                norm_topk_prob=rng.choice([True, False]),
                routed_scaling_factor=rng.choice([1.0, 2.5]),
                rope_interleave=rng.random() < 0.75,
                yarn=yarn,
                attention_bias=rng.random() < 0.25,
            )
        )
    return out


def glm4_moe_config(
    vocab_size: int = 512,
    layers: int = 3,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = 16,
    partial_rotary_factor: float = 0.5,
    use_qk_norm: bool = True,
    experts: int = 8,
    n_group: int = 4,
    topk_group: int = 2,
    top_k: int = 2,
    moe_intermediate: int = 16,
    n_shared_experts: int = 1,
    first_k_dense_replace: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 2.5,
    yarn: dict | None = None,
    attention_bias: bool = True,
    max_len: int = 512,
    **extra,
):
    """GLM-4.5/4.6 (`glm4_moe`): GQA with partial rotary (`partial_rotary_factor` of each head
    rotates) and the q/k norm per `use_qk_norm`, q/k/v biases (`attention_bias`), DeepSeek-V3's
    group-limited sigmoid routing with the correction bias, shared experts, the first
    `first_k_dense_replace` layers dense. `head_dim` None: `hidden / heads` (transformers'
    fallback). `yarn`: YaRN rope keys or None for plain RoPE."""
    from transformers import Glm4MoeConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn is not None:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, **yarn}
    rope["partial_rotary_factor"] = partial_rotary_factor
    if head_dim is not None:
        extra["head_dim"] = head_dim
    return Glm4MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        n_routed_experts=experts,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        n_shared_experts=n_shared_experts,
        first_k_dense_replace=first_k_dense_replace,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=routed_scaling_factor,
        use_qk_norm=use_qk_norm,
        rope_parameters=rope,
        attention_bias=attention_bias,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )


def _random_routing(rng: random.Random, layers: int) -> dict:
    """Expert groups (one group, every group kept, one kept), top-k, shared experts, dense
    first layers, `norm_topk_prob`, the scaling factor: the grouped-routing draws the
    DeepSeek-style families' random configs share."""
    n_group = rng.choice([1, 2, 4])
    experts = n_group * rng.choice([2, 3, 4])
    topk_group = rng.randint(1, n_group)
    return dict(
        experts=experts,
        n_group=n_group,
        topk_group=topk_group,
        top_k=rng.randint(1, min(4, topk_group * (experts // n_group))),
        moe_intermediate=rng.choice([8, 16]),
        n_shared_experts=rng.choice([1, 2]),
        norm_topk_prob=rng.choice([True, False]),
        routed_scaling_factor=rng.choice([1.0, 1.8, 2.5]),
    )


def random_glm4_moe_configs(n: int, seed: int = 0) -> list:
    """`n` varied GLM-4.5-style configs: head groups, `head_dim` given or `hidden / heads`,
    partial rotary (a half, a quarter, the whole head), q/k norm on and off, q/k/v biases on and
    off, plain RoPE or YaRN, and the grouped routing of `_random_routing` with 0 to L-1 dense
    first layers."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        layers = rng.choice([2, 3, 4])
        heads = rng.choice([2, 4, 8])
        hidden = rng.choice([32, 64])
        yarn = None
        if rng.random() < 0.4:
            yarn = {
                "factor": rng.choice([2.0, 4.0]),
                "original_max_position_embeddings": rng.choice([16, 64]),
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            }
        out.append(
            glm4_moe_config(
                layers=layers,
                hidden=hidden,
                heads=heads,
                kv_heads=rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
                head_dim=rng.choice([None, 8, 16]),
                # The first two configs pin both q/k-norm settings; the rest draw it.
                partial_rotary_factor=rng.choice([0.5, 0.5, 0.25, 1.0]),
                use_qk_norm=(i == 0) if i < 2 else rng.random() < 0.5,
                attention_bias=rng.random() < 0.5,
                first_k_dense_replace=rng.randint(0, layers - 1),
                yarn=yarn,
                **_random_routing(rng, layers),
            )
        )
    return out


def glm4_moe_lite_config(
    layers: int = 3, dense_layers: int = 1, routed_scaling_factor: float = 1.8, **kw
):
    """GLM-4.7-Flash (`glm4_moe_lite`, `_mla_moe_config`'s fields): DeepSeek-V3's MLA and
    routing; `mlp_layer_types` lists `dense_layers` dense layers, then sparse ones."""
    from transformers import Glm4MoeLiteConfig

    return _mla_moe_config(
        Glm4MoeLiteConfig,
        layers=layers,
        routed_scaling_factor=routed_scaling_factor,
        mlp_layer_types=["dense"] * dense_layers + ["sparse"] * (layers - dense_layers),
        **kw,
    )


def random_glm4_moe_lite_configs(n: int, seed: int = 0) -> list:
    """`n` varied GLM-4.7-Flash-style configs: MLA ranks and head widths (with and without a q
    LoRA), interleaved or NeoX RoPE, plain RoPE or YaRN (`mscale` and `mscale_all_dim` equal or
    not), the grouped routing of `_random_routing`, 0 to L-1 dense layers first in
    `mlp_layer_types`, attention biases."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        layers = rng.choice([2, 3, 4])
        yarn = _random_mla_yarn(rng, 0.5, [16, 64])
        out.append(
            glm4_moe_lite_config(
                layers=layers,
                **_random_mla_dims(rng),
                dense_layers=rng.randint(0, layers - 1),
                rope_interleave=rng.random() < 0.75,
                yarn=yarn,
                attention_bias=rng.random() < 0.25,
                **_random_routing(rng, layers),
            )
        )
    return out
