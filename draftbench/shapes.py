"""The shape registry of the benchmarks (STYLE 16): real model dimensions, the tiny shapes of
their CPU smoke runs, and what each benchmark builds from them (a drafter's architecture, a
target's `config.json`, a random-weight native target)."""

from __future__ import annotations

# Real model dimensions (STYLE 16): NativeConfig fields of the targets the benchmarks use.
LLAMA31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
)
TINY = dict(
    LLAMA31_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
DRAFT_VOCAB = {
    "llama3.1-8b": 32000,
    "tiny": 256,
    "qwen3-vl-8b": 32000,
    "tiny-vl": 256,
    "gpt-oss-20b": 32000,
    "qwen3-30b-a3b": 32000,
    "tiny-gpt-oss": 256,
    "tiny-qwen3-moe": 256,
    "glm-4.7-flash": 32000,
    "tiny-glm-4.7-flash": 256,
}

# Qwen3-VL-8B-Instruct (text: a Qwen3-8B decoder with interleaved M-RoPE [24, 20, 20], rope
# theta 5e6, untied head; vision: 27 blocks of width 1152, patch 16, merge 2, DeepStack after
# blocks 8/16/24), as `Qwen3VLConfig` keyword arguments.
QWEN3_VL_8B = dict(
    text_config=dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    ),
    vision_config=dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=4096,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
    ),
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    tie_word_embeddings=False,
)
TINY_VL = dict(
    text_config=dict(
        QWEN3_VL_8B["text_config"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters=dict(
            QWEN3_VL_8B["text_config"]["rope_parameters"], mrope_section=[4, 2, 2]
        ),
    ),
    vision_config=dict(
        QWEN3_VL_8B["vision_config"],
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        out_hidden_size=64,
        patch_size=4,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0, 1, 2],
    ),
    image_token_id=500,
    video_token_id=501,
    vision_start_token_id=502,
    vision_end_token_id=503,
)


# MoE targets (REFERENCES part D): transformers config classes and their keyword arguments, the
# MLP width of the drafters the benchmarks build for them (the published recipes':
# SpecForge's gpt-oss-20B EAGLE-3 17280, its Qwen3-30B-A3B EAGLE-3 6144), and the sizes of
# gpt-fast's `mixtral-moe/model.py` peer at the same widths (its `ModelArgs` fixes head_dim
# = dim // n_head and a query width of dim: the heads are chosen to keep the target's head_dim,
# so the peer's attention is narrower than the target's; its experts, head and layer count
# are the target's).
GPT_OSS_20B = dict(
    config_class="GptOssConfig",
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    tie_word_embeddings=False,
    drafter_mlp=17280,
    peer=dict(n_head=45, n_local_heads=9),
)
QWEN3_30B_A3B = dict(
    config_class="Qwen3MoeConfig",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
    tie_word_embeddings=False,
    drafter_mlp=6144,
    peer=dict(n_head=16, n_local_heads=4),
)
TINY_GPT_OSS = dict(
    GPT_OSS_20B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2,
    max_position_embeddings=4096,
    drafter_mlp=128,
    peer=dict(n_head=4, n_local_heads=2),
)
TINY_QWEN3_MOE = dict(
    QWEN3_30B_A3B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    drafter_mlp=128,
    peer=dict(n_head=4, n_local_heads=2),
)
# GLM-4.7-Flash (`glm4_moe_lite`, REFERENCES part D, D; its released config.json): MLA over a
# latent cache (20 heads, q rank 768, latent 512 + rope 64 = 576 values per token per layer,
# nope 192, v 256), 47 layers of which the first is a dense SwiGLU of 10240, then 64 routed
# experts of 1536 top-4 (sigmoid routing, one group, scaling 1.8) plus one shared expert; one
# MTP layer (`num_nextn_predict_layers`, served as released: `drafter=native`). bf16 ~60 GB:
# one H200. No gpt-fast peer: its `mixtral-moe/model.py` has no latent attention (DESIGN
# section 7: MLA targets are measured against the copy bandwidth).
GLM_4_7_FLASH = dict(
    config_class="Glm4MoeLiteConfig",
    vocab_size=154880,
    hidden_size=2048,
    intermediate_size=10240,
    moe_intermediate_size=1536,
    num_hidden_layers=47,
    num_attention_heads=20,
    num_key_value_heads=20,
    q_lora_rank=768,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    rope_interleave=True,
    n_routed_experts=64,
    n_shared_experts=1,
    num_experts_per_tok=4,
    routed_scaling_factor=1.8,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    mlp_layer_types=["dense"] + ["sparse"] * 46,
    max_position_embeddings=202752,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
    drafter_mlp=10240,
)
TINY_GLM_4_7_FLASH = dict(
    GLM_4_7_FLASH,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    mlp_layer_types=["dense"] + ["sparse"] * 3,
    max_position_embeddings=4096,
    drafter_mlp=128,
)
BENCH_ONLY = ("config_class", "drafter_mlp", "peer")


def hf_config(shape: dict):
    """The transformers config object of a registry entry holding `config_class`."""
    import transformers

    kwargs = {k: v for k, v in shape.items() if k not in BENCH_ONLY}
    return getattr(transformers, shape["config_class"])(**kwargs)


def native_shape(cfg, drafter_mlp: int | None = None) -> dict:
    """The NativeConfig fields `drafter_arch` reads, from a native target's config, with the
    drafter's MLP width in `intermediate_size` (an MoE target's is its expert's)."""
    shape = {f: getattr(cfg, f) for f in LLAMA31_8B}
    if drafter_mlp is not None:
        shape["intermediate_size"] = drafter_mlp
    return shape


def moe_peer_shape(shape: dict) -> dict:
    """gpt-fast `mixtral-moe` `ModelArgs` for a MoE registry entry (block_size set by the
    caller): the target's width, layers, vocabulary, experts, top-k and expert width."""
    experts = shape.get("num_local_experts", shape.get("num_experts"))
    inter = shape.get("moe_intermediate_size", shape["intermediate_size"])
    return dict(
        vocab_size=shape["vocab_size"],
        n_layer=shape["num_hidden_layers"],
        dim=shape["hidden_size"],
        intermediate_size=inter,
        num_experts=experts,
        num_activated_experts=shape["num_experts_per_tok"],
        rope_base=shape["rope_parameters"]["rope_theta"],
        norm_eps=shape["rms_norm_eps"],
        **shape["peer"],
    )


def vl_native_shape(hf_kwargs: dict) -> dict:
    """The text decoder of a `Qwen3VLConfig` as the NativeConfig fields `drafter_arch` reads."""
    t = hf_kwargs["text_config"]
    rope = dict(t["rope_parameters"])
    return dict(
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"],
        num_layers=t["num_hidden_layers"],
        num_heads=t["num_attention_heads"],
        num_kv_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"],
        rms_norm_eps=t["rms_norm_eps"],
        rope_theta=rope.pop("rope_theta"),
        rope_scaling=rope,
        max_position_embeddings=t["max_position_embeddings"],
    )


def hf_config_dict(target: dict) -> dict:
    """The target shape as a Llama `config.json` (what an MTP drafter's config embeds)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": target["vocab_size"],
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_hidden_layers": target["num_layers"],
        "num_attention_heads": target["num_heads"],
        "num_key_value_heads": target["num_kv_heads"],
        "head_dim": target["head_dim"],
        "rms_norm_eps": target["rms_norm_eps"],
        "max_position_embeddings": target["max_position_embeddings"],
        "rope_theta": target["rope_theta"],
        "rope_scaling": target["rope_scaling"],
        "attention_bias": False,
        "mlp_bias": False,
    }


def drafter_arch(target: dict, draft_vocab: int) -> dict:
    """EAGLE-family drafter config fields sized for a target shape: the target's width, heads,
    RoPE and context, EAGLE-3's default taps (2, L//2, L-3), a draft vocabulary."""
    return dict(
        hidden_size=target["hidden_size"],
        intermediate_size=target["intermediate_size"],
        num_attention_heads=target["num_heads"],
        num_key_value_heads=target["num_kv_heads"],
        head_dim=target["head_dim"],
        vocab_size=target["vocab_size"],
        draft_vocab_size=draft_vocab,
        target_hidden_size=target["hidden_size"],
        aux_layer_ids=[2, target["num_layers"] // 2, target["num_layers"] - 3],
        rope_theta=target["rope_theta"],
        rope_scaling=target["rope_scaling"],
        max_position_embeddings=target["max_position_embeddings"],
    )


def bench_drafter_arch(kind: str, target: dict, draft_vocab: int, k_max: int) -> dict:
    """The config fields of the drafter each benchmark builds for `kind` at a target shape:
    EAGLE-3 one layer; ptd two layers drafting up to `k_max`; mtp N = 3 modules over the
    target's own layer shape and vocabulary; dflash the published 8B recipe's shape (5 target-
    sized layers, the default 5 taps) with a block of `k_max + 1` slots."""
    if kind == "mtp":
        return {"n_predict": 3, "target_config": hf_config_dict(target)}
    if kind == "dflash":
        from draftinfer.kinds.dflash.taps import default_dflash_ids, tap_of_dflash_id

        L = target["num_layers"]
        return dict(
            {k: v for k, v in drafter_arch(target, draft_vocab).items() if k in _DFLASH_FIELDS},
            vocab_size=target["vocab_size"],
            num_target_layers=L,
            tap_layer_ids=[tap_of_dflash_id(t) for t in default_dflash_ids(L, min(5, L - 3))],
            num_hidden_layers=5,
            block_size=k_max + 1,
            mask_token_id=0,
        )
    arch = drafter_arch(target, draft_vocab)
    if kind == "ptd":
        arch.update(num_hidden_layers=2, mask_token_id=0, parallel_k=k_max)
    return arch


_DFLASH_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
)


def random_llama_target(shape: dict, device, dtype, max_batch: int, max_len: int):
    """A native Llama-shaped target of `shape` (NativeConfig fields) with random weights
    (`random_init`) and caches for `max_batch` x `max_len`."""
    from draftinfer.families.causal_lm.models import LlamaForCausalLM
    from draftinfer.models.decoder import NativeConfig

    cfg = NativeConfig(architecture="LlamaForCausalLM", **shape)
    return random_init(LlamaForCausalLM, cfg, device, dtype, max_batch, max_len)


def random_native_target(hf, device, dtype, max_batch: int, max_len: int):
    """The native target of any registered family for a transformers config object `hf`
    (the class by `architectures`, else `model_type`), random weights (`random_init`)."""
    from draftinfer.registry import FAMILIES

    cls = FAMILIES.native_class(hf.to_dict())
    return random_init(cls, cls.config_from_hf(hf, []), device, dtype, max_batch, max_len)


def random_init(cls, cfg, device, dtype, max_batch: int, max_len: int):
    """`cls(cfg)` built on the meta device and materialised on `device` in `dtype`: vectors
    1 (norms, sinks) or 0 (biases), the rest N(0, 0.02), seed 0 (time does not depend on
    training); caches for `max_batch` x `max_len`."""
    import torch

    with torch.device("meta"):
        model = cls(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.init_rope(device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.zero_() if name.endswith("bias") else p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.requires_grad_(False).eval()
    model.setup_caches(max_batch, max_len)
    return model
