"""Every field of the export contract (DESIGN section 4), checked against the target the
export was trained for (the zoo recipe of each registered kind)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from safetensors import safe_open

from draftinfer.files.checkpoint import FORMAT_VERSION, SPECULATORS_DIR, read_drafter_config
from draftinfer.files.paths import resolve_path
from draftinfer.models.rope import rope_from_hf
from draftinfer.registry import registered_kinds

pytestmark = pytest.mark.slow


def _target_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_path("zoo:llama-tiny"))


@pytest.mark.parametrize("kind", registered_kinds())
def test_export_contract_against_its_target(zoo_run, zoo_target, kind):
    export = Path(zoo_run(kind)["export_dir"])
    tc, info = _target_config(), zoo_target.info
    cfg = json.loads((export / "config.json").read_text())
    spec, arch, meta = read_drafter_config(export)
    spec.check_fit(arch, info)  # vocabulary, hidden size, taps, max_position_embeddings

    # Files: safetensors only, tokenizer, resolved config, model card with front matter.
    names = {p.name for p in export.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "training_args.yaml"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth", ".pkl")) for n in names)
    front = yaml.safe_load((export / "README.md").read_text().split("---")[1])
    assert front["base_model"] == "zoo:llama-tiny" and front["library_name"] == "vllm"
    assert front["pipeline_tag"] == "text-generation"
    assert {"speculative-decoding", kind, "drafttrain"} <= set(front["tags"])
    args = yaml.safe_load((export / "training_args.yaml").read_text())
    assert args["drafter"]["kind"] == kind

    # Our fields under one key, the conventions this code implements.
    ours = cfg["drafttrain"]
    assert ours["format_version"] == FORMAT_VERSION and ours["drafter_kind"] == kind
    for key, value in spec.conventions(arch).items():
        assert ours[key] == value, key
    assert ours["target"] == "zoo:llama-tiny" and ours["trained_steps"] > 0
    assert ours["serving_k"] >= 1

    # Engine-facing fields against the target.
    assert cfg["max_position_embeddings"] >= tc.max_position_embeddings
    assert cfg["vocab_size"] == info.vocab_size and cfg["hidden_size"] == info.hidden_size
    # The same RoPE as the target's, however the config spells it (rope_theta + rope_scaling,
    # or transformers 5's rope_parameters).
    assert rope_from_hf(SimpleNamespace(**cfg), tc.head_dim) == rope_from_hf(tc)
    assert cfg["torch_dtype"] == "bfloat16"

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert not any(k.startswith("embed_tokens") for k in shapes)  # shared with the target
    H, V, L = info.hidden_size, info.vocab_size, info.num_layers
    if "num_nextn_predict_layers" in cfg:  # MTP: the target family's config + N modules
        N = cfg["num_nextn_predict_layers"]
        assert N == ours["n_predict"] == ours["serving_k"] == 3
        assert cfg["architectures"] == tc.architectures and cfg["num_hidden_layers"] == L
        for key in ("mtp_chain", "mtp_carry", "mtp_feature_tap"):
            assert key in ours
        assert all(k.startswith("model.layers.") for k in shapes)
        for k in range(N):
            p = f"model.layers.{L + k}."
            assert shapes[p + "eh_proj.weight"] == (H, 2 * H)
            assert shapes[p + "enorm.weight"] == shapes[p + "hnorm.weight"] == (H,)
            assert shapes[p + "shared_head.norm.weight"] == (H,)
            assert shapes[p + "shared_head.head.weight"] == (V, H)
            assert p + "self_attn.q_proj.weight" in shapes and p + "mlp.down_proj.weight" in shapes
        assert shapes[f"model.layers.{L}.embed_tokens.weight"] == (V, H)
        assert not (export / SPECULATORS_DIR).exists()  # speculators has no such MTP layout
    if cfg["architectures"] in (["DFlashDraftModel"], ["DFlash2DraftModel"]):
        # z-lab layout (vLLM `method: dflash`, SGLang `DFLASH`); tests/kinds/test_dflash_export.py
        # checks every field and tensor name of each option.
        dc = cfg["dflash_config"]
        assert cfg["model_type"] == "qwen3" and cfg["num_target_layers"] == L
        assert dc["target_layer_ids"] == [j - 1 for j in arch.tap_layer_ids]  # convention 13
        assert all(0 <= t <= L - 2 for t in dc["target_layer_ids"])
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [t + 1 for t in dc["target_layer_ids"]]
        assert cfg["block_size"] == dc["block_size"] == ours["serving_k"] + 1
        assert 0 <= dc["mask_token_id"] < V
        assert not any(k.startswith(("model.", "lm_head", "mask_hidden")) for k in shapes)
        assert shapes["fc.weight"] == (H, len(dc["target_layer_ids"]) * H)
        spec_cfg = json.loads((export / SPECULATORS_DIR / "config.json").read_text())
        assert spec_cfg["speculators_model_type"] == "dflash"
        assert spec_cfg["aux_hidden_state_layer_ids"] == cfg["eagle_aux_hidden_state_layer_ids"]
        # A zoo target has no hub id: the verifier is the target directory's absolute path.
        zoo_dir = str(Path(resolve_path("zoo:llama-tiny")).resolve())
        assert spec_cfg["speculators_config"]["verifier"]["name_or_path"] == zoo_dir
        assert not (export / SPECULATORS_DIR / "verifier").exists()
        with safe_open(str(export / SPECULATORS_DIR / "model.safetensors"), "pt") as f:
            spec_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert spec_shapes["embed_tokens.weight"] == spec_shapes["lm_head.weight"] == (V, H)
    if cfg["architectures"] == ["LlamaForCausalLMEagle3"]:
        assert cfg["hidden_size"] == cfg["target_hidden_size"]
        Dd = cfg["draft_vocab_size"]
        aux = cfg["eagle_aux_hidden_state_layer_ids"]
        assert aux == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert len(aux) == 3 and all(0 <= j < info.num_layers for j in aux)
        assert cfg["model_type"] == "llama" and "norm_before_residual" in cfg
        assert shapes["fc.weight"] == (H, 3 * H)
        assert shapes["lm_head.weight"] == (Dd, H) and shapes["norm.weight"] == (H,)
        assert shapes["d2t"] == (Dd,) and shapes["t2d"] == (V,)
        layer = "midlayer." if cfg["num_hidden_layers"] == 1 else "layers.0."
        assert shapes[layer + "self_attn.q_proj.weight"][1] == 2 * H
        assert shapes[layer + "hidden_norm.weight"] == (H,)
        # The same drafter in vllm-project/speculators' layout (tests/jobs/test_third_party_loaders.py
        # loads it with speculators itself).
        spec_cfg = json.loads((export / SPECULATORS_DIR / "config.json").read_text())
        verifier = spec_cfg["speculators_config"]["verifier"]
        # A zoo target has no hub id: the verifier is the target directory's absolute path
        # (drafttrain.export.directory.speculators_verifier), and nothing of it is in the export.
        zoo_dir = str(Path(resolve_path("zoo:llama-tiny")).resolve())
        assert verifier == {"name_or_path": zoo_dir, "architectures": tc.architectures}
        assert not (export / SPECULATORS_DIR / "verifier").exists()
        assert spec_cfg["transformer_layer_config"]["vocab_size"] == V
        assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == aux
        with safe_open(str(export / SPECULATORS_DIR / "model.safetensors"), "pt") as f:
            spec_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert not any(k.startswith("midlayer.") for k in spec_shapes)
        assert spec_shapes["embed_tokens.weight"] == (V, H)
        assert (
            spec_shapes["layers.0.self_attn.q_proj.weight"]
            == shapes[layer + "self_attn.q_proj.weight"]
        )
        assert ("d2t" in spec_shapes) == (Dd < V)
        if cfg.get("parallel_drafting"):
            assert shapes["mask_hidden"] == (1, 1, 3 * H)
            assert cfg["ptd_token_id"] == cfg["pard_token"] == cfg["mask_token_id"]
            assert 0 <= cfg["mask_token_id"] < V
            assert cfg["parallel_k"] == ours["parallel_k"] == ours["serving_k"]
            assert spec_cfg["speculators_model_type"] == "peagle"
            assert spec_cfg["mask_token_id"] == cfg["mask_token_id"]
            assert spec_shapes["mask_hidden"] == (1, 1, 3 * H)
        else:
            assert "mask_hidden" not in shapes and "parallel_drafting" not in cfg
            assert spec_cfg["speculators_model_type"] == "eagle3"
