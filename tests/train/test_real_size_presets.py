"""The real-size MoE presets (DeepSeek-V3, GLM-4.5-Air, GLM-4.7-Flash) against their targets'
`config.json`, written here with the released fields (`tests.support.real_configs`; nothing is
downloaded): each composes to its hub id, its drafter's architecture derives from that config
as training derives it (taps in range, MTP modules of the family's own layer), and `drafter.
init=native` finds the released MTP layer where the family says it is (`model.layers.{L}`).
DeepSeek-V3's released FP8 files are refused in one line; a bf16 copy of the same config is
not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftinfer.files.checkpoint import released_drafter_config
from draftinfer.files.errors import CheckpointError, ConfigError
from draftinfer.kinds.mtp.layouts import layout_of
from draftinfer.models.target import TargetInfo
from draftinfer.registry import FAMILIES
from drafttrain.frozen.target import load_target_config
from drafttrain.jobs.config import check_train_config
from drafttrain.kinds.eagle3.objective import drafter_config_from_target
from drafttrain.kinds.mtp import MTPTrainSpec
from drafttrain.registry import InitContext
from tests.support.presets import compose_preset
from tests.support.real_configs import DEEPSEEK_V3, REAL_CONFIGS, write_config

# preset -> (hub id, family, decoder layers, the released MTP layer's prefix)
MTP_PRESETS = {
    "mtp_deepseek_v3": ("deepseek-ai/DeepSeek-V3", "deepseek_v3", 61, "model.layers.61"),
    "mtp_glm4_5_air": ("zai-org/GLM-4.5-Air", "glm4_moe", 46, "model.layers.46"),
    "mtp_glm4_7_flash": ("zai-org/GLM-4.7-Flash", "glm4_moe_lite", 47, "model.layers.47"),
}
FP8_REFUSAL = (
    "the target's own MTP layers: DeepseekV3ForCausalLM: quantization 'fp8' is not supported "
    "(dequantize the checkpoint to bf16 first)"
)


def as_target(directory):
    """What the training kinds read of a frozen target (`info`, `config`, `cfg`), from its
    config.json alone."""
    tc = load_target_config(str(directory))
    arch = tc.architectures[0]
    info = TargetInfo(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        num_layers=tc.num_hidden_layers,
        max_position_embeddings=tc.max_position_embeddings,
        architecture=arch,
        family=FAMILIES.for_architectures([arch]).name,
    )
    return SimpleNamespace(info=info, config=tc, cfg=SimpleNamespace(name_or_path=str(directory)))


def real_dir(tmp_path, hub: str, **changes):
    return write_config(tmp_path / hub.replace("/", "--"), REAL_CONFIGS[hub], **changes)


@pytest.mark.parametrize("preset", [*MTP_PRESETS, "eagle3_deepseek_v3"])
def test_real_size_presets_compose_to_hub_ids(preset):
    cfg = check_train_config(compose_preset(preset))
    hub = MTP_PRESETS.get(preset, ("deepseek-ai/DeepSeek-V3",))[0]
    assert cfg.target.name_or_path == hub
    assert cfg.data.path == "HuggingFaceH4/ultrachat_200k"


@pytest.mark.parametrize("preset", MTP_PRESETS)
def test_mtp_preset_modules_fit_the_real_config(preset, tmp_path):
    """N = 3 modules of the family's own layer at the target's shapes, module 0 from the one
    released layer at `model.layers.{L}` (a bf16 copy of DeepSeek-V3's config)."""
    hub, family, L, prefix = MTP_PRESETS[preset]
    cfg = compose_preset(preset)
    d = real_dir(tmp_path, hub, quantization_config=None)
    target = as_target(d)
    assert target.info.num_layers == L and target.info.family == family
    ctx = InitContext(target=target, tokenizer=None, data=None, cache_dir=tmp_path)
    arch = MTPTrainSpec().arch(cfg.drafter, ctx)
    assert arch.n_predict == cfg.drafter.n_predict == 3 and cfg.drafter.init == "native"
    assert arch.block == "native" and arch.own_layer and arch.layout == "deepseek"
    assert arch.target_num_layers == L and arch.hidden_size == REAL_CONFIGS[hub]["hidden_size"]
    assert [layout_of(arch).module_prefix(arch, k) for k in range(3)] == [
        f"model.layers.{L + k}" for k in range(3)
    ]
    spec, released, _ = released_drafter_config(d)
    assert spec.name == "mtp" and released.n_predict == 1
    assert layout_of(released).module_prefix(released, 0) == prefix


def test_deepseek_v3_released_fp8_is_refused_in_one_line(tmp_path):
    """The released DeepSeek-V3 files are FP8 (`quantization_config`): `drafter=native`, training's
    `init=native` and the MTP modules' native layer all stop at the same one-line refusal."""
    d = real_dir(tmp_path, "deepseek-ai/DeepSeek-V3")
    assert DEEPSEEK_V3["quantization_config"]["quant_method"] == "fp8"
    with pytest.raises(CheckpointError) as e:
        released_drafter_config(d)
    assert str(e.value) == FP8_REFUSAL
    ctx = InitContext(target=as_target(d), tokenizer=None, data=None, cache_dir=tmp_path)
    with pytest.raises(ConfigError) as e:
        MTPTrainSpec().arch(compose_preset("mtp_deepseek_v3").drafter, ctx)
    msg = str(e.value)
    assert "\n" not in msg and "quantization 'fp8' is not supported" in msg


def test_eagle3_deepseek_v3_taps_and_shapes_fit_the_real_config(tmp_path):
    cfg = compose_preset("eagle3_deepseek_v3")
    target = as_target(real_dir(tmp_path, "deepseek-ai/DeepSeek-V3"))
    arch = drafter_config_from_target(cfg.drafter, target)
    assert arch.aux_layer_ids == [2, 30, 58]  # (2, L//2, L-3) at 61 layers
    assert arch.hidden_size == 7168 and arch.vocab_size == 129280
    assert arch.draft_vocab_size == 32000 and arch.num_hidden_layers == 1
    assert arch.max_position_embeddings == 163840
    # Plain attention over the target's heads, each as wide as its RoPE slice (HF's head_dim).
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (128, 128, 64)
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_scaling["factor"] == 40
