"""The `config.json` fields of the real MoE targets the hub presets name (REFERENCES part D: C1,
D; the released files' keys and values), for tests that check a real-size preset against its
target without downloading it: a test writes one into a temporary directory and reads it as
the target (`write_config`). Weights are never needed: the checks read shapes, layer counts
and the MTP layers' indices only."""

from __future__ import annotations

import json
from pathlib import Path

# deepseek-ai/DeepSeek-V3: 61 layers (3 dense), MLA, 256 experts top-8 in 8 groups, one MTP
# layer at model.layers.61; the released weights are FP8 (e4m3, 128 x 128 blocks).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

# zai-org/GLM-4.5-Air: 46 layers (the first dense), GQA 96 / 8 heads of 128 with half-width
# RoPE and q/k/v biases, 128 experts top-8 plus one shared, one MTP layer at model.layers.46.
GLM4_5_AIR = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 46,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": False,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "eos_token_id": [151329, 151336, 151338],
    "pad_token_id": 151329,
}

# zai-org/GLM-4.7-Flash (`glm4_moe_lite`): 47 layers (the first dense), MLA with 20 heads
# (q rank 768, latent 512 + 64, nope 192, v 256), 64 experts top-4 plus one shared, one MTP
# layer at model.layers.47.
GLM4_7_FLASH = {
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "model_type": "glm4_moe_lite",
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "rope_interleave": True,
    "partial_rotary_factor": 1.0,
    "n_shared_experts": 1,
    "n_routed_experts": 64,
    "num_experts_per_tok": 4,
    "routed_scaling_factor": 1.8,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
}

# hub id -> its config.json (the presets' `target.name_or_path`).
REAL_CONFIGS = {
    "deepseek-ai/DeepSeek-V3": DEEPSEEK_V3,
    "zai-org/GLM-4.5-Air": GLM4_5_AIR,
    "zai-org/GLM-4.7-Flash": GLM4_7_FLASH,
}


def write_config(directory: Path, config: dict, **changes) -> Path:
    """`directory/config.json` holding `config` with `changes` (a value None drops the key)."""
    data = {k: v for k, v in {**config, **changes}.items() if not (k in changes and v is None)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(data, indent=2))
    return directory
