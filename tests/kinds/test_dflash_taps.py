"""K1: the layers a `dflash` export names are the layers it was trained on (convention 13).

- The mapping: DFlash's `target_layer_ids` entry t ("output of layer t") is our tap t + 1 (the
  input of layer t + 1): the features the training target hands the drafter for those taps
  equal HF `output_hidden_states[t + 1]` (the oracle: transformers' own model, not our mapping).
- An export read the way vLLM and SGLang read it (REFERENCES A3, `tests/dflash_support.py`,
  json + safetensors only, no `draftinfer` loader) feeds the drafter exactly the layers it
  was trained on: its block logits equal our runner's; vLLM's pre-#40727 reading (ids as
  capture slots) does not (the test can fail).
- z-lab's default ids and the range rule (the last layer is never a tap).
"""

from __future__ import annotations

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.files.checkpoint import load_drafter, write_drafter
from draftinfer.files.errors import ConfigError
from draftinfer.kinds.dflash import DFlashConfig, DFlashDrafter
from draftinfer.kinds.dflash.taps import (
    check_dflash_ids,
    default_dflash_ids,
    dflash_id_of_tap,
    tap_of_dflash_id,
)
from draftinfer.models.target import FeatureSpec
from tests.support.dflash import (
    read_export,
    runner_logits,
    sglang_capture_slots,
    vllm_before_40727_slots,
    vllm_capture_slots,
)
from tests.support.kind_factories import _frozen, drafter_for


def _hf_hidden_states(target_dir, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("target", ["tiny_llama3_dir", "tiny_qwen3_dir"])
def test_dflash_id_t_is_hf_hidden_states_t_plus_1(target, request):
    target_dir = request.getfixturevalue(target)
    frozen = _frozen(str(target_dir))
    L = frozen.info.num_layers
    ids = torch.randint(
        0, frozen.info.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0)
    )
    hs = _hf_hidden_states(target_dir, ids)
    assert len(hs) == L + 1  # embeddings, then the output of every layer
    for t in range(L - 1):  # every id a DFlash checkpoint may name
        taps = (tap_of_dflash_id(t),)
        out = frozen(ids, Slots(torch.arange(2), torch.arange(11).expand(2, 11)), FeatureSpec(taps))
        torch.testing.assert_close(out.features, hs[t + 1], rtol=0, atol=0)
        assert dflash_id_of_tap(taps[0]) == t


def test_export_read_by_engine_rules_feeds_the_trained_layers(tiny_llama3_dir, tmp_path):
    """Train-side drafter -> export on disk -> the engines' reading of the files -> HF hidden
    states at those capture slots -> the same block logits as our runner's."""
    d = drafter_for("dflash", str(tiny_llama3_dir), num_layers=2, target_layer_ids=[0, 2, 4])
    assert d.config.tap_layer_ids == [1, 3, 5]
    frozen = _frozen(str(tiny_llama3_dir))
    write_drafter(tmp_path, d, {"target": str(tiny_llama3_dir)}, dtype=torch.float32)
    config, tensors = read_export(tmp_path)
    assert config["dflash_config"]["target_layer_ids"] == [0, 2, 4]
    slots = vllm_capture_slots(config)
    assert slots == sglang_capture_slots(config) == [1, 3, 5]

    g = torch.Generator().manual_seed(1)
    T, anchor, k = 14, 6, 5
    ids = torch.randint(0, frozen.info.vocab_size, (1, T), generator=g)
    hs = _hf_hidden_states(tiny_llama3_dir, ids)
    pos = torch.arange(T)[None]

    def engine_drafter(capture, read=None):
        """The drafter built from the raw files with the engine's taps `capture` (the tensors
        by name), and the hidden states the engine captures at slots `read` (default
        `capture`) to feed it."""
        arch = DFlashConfig(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            vocab_size=config["vocab_size"],
            num_target_layers=config["num_target_layers"],
            tap_layer_ids=[int(x) for x in capture],
            num_hidden_layers=config["num_hidden_layers"],
            block_size=config["dflash_config"]["block_size"],
            mask_token_id=config["dflash_config"]["mask_token_id"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=config["rope_theta"],
            rope_scaling=config["rope_scaling"],
            max_position_embeddings=config["max_position_embeddings"],
        )
        m = DFlashDrafter(arch)
        shared = frozen.shared_weights()
        m.load_state_dict(
            {
                **tensors,
                "embed_tokens.weight": shared["input_embeddings"],
                "lm_head.weight": shared["output_embeddings"],
            }
        )
        feats = torch.cat([hs[j] for j in (read or capture)], dim=-1)  # what it captures
        return m.eval(), feats

    ours, _ = load_drafter(tmp_path, frozen.shared_weights())
    our_feats = frozen(ids, Slots(torch.tensor([0]), torch.arange(T)[None]), ours.config.features)
    want = runner_logits(ours, ids, our_feats.features, pos, anchor, k)
    for rule in (vllm_capture_slots, sglang_capture_slots):
        m, feats = engine_drafter(rule(config))
        torch.testing.assert_close(runner_logits(m, ids, feats, pos, anchor, k), want)
    # The pre-#40727 reading (ids as capture slots) feeds the layer before: other logits.
    m, feats = engine_drafter(vllm_capture_slots(config), vllm_before_40727_slots(config))
    assert (runner_logits(m, ids, feats, pos, anchor, k) - want).abs().max() > 1e-2


def test_z_lab_default_ids():
    assert default_dflash_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B / 4B (z-lab configs)
    assert default_dflash_ids(32, 5) == [1, 8, 15, 22, 29]  # Llama-3.1-8B
    assert default_dflash_ids(36, 1) == [18]
    assert default_dflash_ids(8, 5) == [1, 2, 3, 4, 5]  # the zoo target


def test_the_last_layer_is_never_a_tap():
    check_dflash_ids([0, 6], 8)
    for bad in ([7], [-1], [2, 2], []):
        with pytest.raises(ConfigError) as e:
            check_dflash_ids(bad, 8)
        assert "\n" not in str(e.value)
