"""gpt-oss on the training side: the family loads transformers' `GptOssForCausalLM` with eager
attention whatever the config says, its frozen target's taps are the residual stream entering
each decoder layer (sliding and full layers alike) and equal transformers'
`output_hidden_states[j]`, the default ids have vLLM's semantics (S4, K1 on gpt-oss), and every
drafter kind trains through the family's own target and harmony data.

The family is selected by name here (`train_family("gpt_oss")`); the tests that select it by
architecture, as `python -m drafttrain` does, need the runner's gpt-oss family (another
branch) and skip until it is registered (`tests.support.moe_targets.needs_runner_family`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftinfer.kinds.dflash.taps import default_dflash_ids
from draftinfer.models.target import FeatureSpec
from drafttrain.kinds.eagle3.objective import default_aux_layer_ids
from drafttrain.registry import InitContext, train_family, train_spec
from tests.support.kind_factories import kinds_for_family
from tests.support.moe_targets import (
    family_target,
    hf_hidden_states,
    make_moe_env,
    needs_runner_family,
    padded_batch,
    split_for,
    train_a_few_steps,
)

FAMILY = "gpt_oss"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_moe_env(tmp_path_factory.mktemp("gpt_oss"), FAMILY)


@pytest.fixture(scope="module")
def target(env):
    return family_target(FAMILY, env["target"], attn_implementation="sdpa")


def test_transformers_has_no_sdpa_for_sinks(env):
    """The setting the family works around exists: transformers refuses SDPA for gpt-oss."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel

    assert GptOssPreTrainedModel._supports_sdpa is False
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        AutoModelForCausalLM.from_pretrained(env["target"], attn_implementation="sdpa")


def test_family_loads_eager_whatever_the_config_says(target):
    assert target.model.config._attn_implementation == "eager"
    assert target.info.architecture == "GptOssForCausalLM"
    types = target.model.config.layer_types
    assert types[0] == "sliding_attention" and types[1] == "full_attention"


def _rows(env, n: int = 3) -> list[list[int]]:
    _, split = split_for(FAMILY, env)
    return [split.data[i]["input_ids"] for i in range(n)][::-1]


def test_taps_equal_output_hidden_states_on_every_layer(env, target):
    """Tap j (a forward pre-hook on layer j) == HF `output_hidden_states[j]` for every j, at
    every real token of a right-padded batch whose prompts cross the sliding window."""
    rows = _rows(env)
    assert min(len(r) for r in rows) > 4 * target.model.config.sliding_window
    assert len({len(r) for r in rows}) > 1  # padding in the batch
    ids, mask, slots = padded_batch(rows, 0)
    L = target.info.num_layers
    out = target(ids, slots, FeatureSpec(layer_inputs=tuple(range(L))))
    hidden, n_layers = hf_hidden_states(target.cfg.name_or_path, ids, mask)
    assert n_layers == L and len(hidden) == L + 1
    H = target.info.hidden_size
    real = mask.bool()
    for j in range(L):
        got = out.features[..., j * H : (j + 1) * H]
        torch.testing.assert_close(got[real], hidden[j][real], rtol=0, atol=0)
    assert not torch.equal(out.features[..., 2 * H : 3 * H][real], hidden[3][real])


def test_default_eagle3_taps_are_vllms_inputs_of_layers(env, target):
    """vLLM's `GptOssForCausalLM.get_eagle3_aux_hidden_state_layers()` = (2, L//2, L-3), read
    as the input of layer j: 20b (2, 12, 21), 120b (2, 18, 33) (REFERENCES B2). The drafter
    built for this target consumes those taps, and they are HF's `hidden_states[j]`."""
    assert default_aux_layer_ids(24) == [2, 12, 21]
    assert default_aux_layer_ids(36) == [2, 18, 33]
    _, split = split_for(FAMILY, env)
    spec = train_spec("eagle3")
    ctx = InitContext(target, None, split.data, None)
    feats = spec.features(spec.config_class(draft_vocab_size=64), ctx)
    assert feats.layer_inputs == (2, 4, 5)  # L = 8
    ids, mask, slots = padded_batch(_rows(env, 2), 0)
    out = target(ids, slots, feats)
    hidden, _ = hf_hidden_states(target.cfg.name_or_path, ids, mask)
    expected = torch.cat([hidden[j] for j in (2, 4, 5)], dim=-1)
    torch.testing.assert_close(out.features[mask.bool()], expected[mask.bool()], rtol=0, atol=0)


def test_default_dflash_taps_are_outputs_of_dflash_layer_ids(env, target):
    """DFlash ids t name the output of layer t (convention 13): the block drafter built for
    this target reads HF `hidden_states[t + 1]` for z-lab's default ids."""
    tok, split = split_for(FAMILY, env)
    spec = train_spec("dflash")
    cfg = spec.config_class(num_layers=3, block_size=4, gamma=4.0)
    feats = spec.features(cfg, InitContext(target, tok, split.data, None))
    ids_t = default_dflash_ids(target.info.num_layers, 3)
    assert feats.layer_inputs == tuple(t + 1 for t in ids_t)
    ids, mask, slots = padded_batch(_rows(env, 2), 0)
    out = target(ids, slots, feats)
    hidden, _ = hf_hidden_states(target.cfg.name_or_path, ids, mask)
    expected = torch.cat([hidden[t + 1] for t in ids_t], dim=-1)
    torch.testing.assert_close(out.features[mask.bool()], expected[mask.bool()], rtol=0, atol=0)


def test_training_head_is_the_models_own(env, target):
    """The training output's head (final norm output x untied lm_head) gives the model's own
    logits at every real position."""
    _, split = split_for(FAMILY, env)
    batch = split.collate([0, 1], 0)
    out = target.batch_output(batch, FeatureSpec(layer_inputs=(2,)))
    logits = out.head.head.logits(out.head.hidden).float()
    ref = target.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits.float()
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[real], ref[real], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", kinds_for_family(FAMILY))
def test_every_kind_trains_through_the_family(env, tmp_path, kind):
    """A drafter of each kind, built by its own `init_drafter` against the family's target
    (YaRN rope included), fits one batch of harmony chat: its loss falls (by more than 10% in
    20 steps; deterministic)."""
    losses, arch = train_a_few_steps(FAMILY, env, kind, tmp_path)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.9 * losses[0], losses
    if hasattr(arch, "rope_scaling"):
        assert arch.rope_scaling["rope_type"] == "yarn"  # the target's own rotary


def test_card_notes_state_the_harmony_format_and_the_tap_semantics():
    from draftinfer.registry import drafter_spec

    notes = train_family(FAMILY).card_notes(drafter_spec("eagle3"), None)
    text = " ".join(notes)
    assert "harmony" in text and "2025-08-05" in text and "(2, 18, 33)" in text


@pytest.mark.slow
@needs_runner_family(FAMILY)
def test_train_job_selects_the_family_by_architecture(env, tmp_path):
    """`train(cfg)` on a gpt-oss target picks this family from its `config.json` (eager
    attention although the config says sdpa), trains and exports."""
    from drafttrain.export.directory import export_run
    from drafttrain.jobs.train import train
    from drafttrain.registry import target_family
    from tests.support.presets import compose_preset, small_overrides

    assert target_family(env["target"]).name == FAMILY
    cfg = compose_preset("eagle3", small_overrides(env, tmp_path / "run", steps=8))
    assert cfg.target.attn_implementation == "sdpa"
    summary = train(cfg)
    assert summary["last_loss"] < summary["first_loss"]
    out = Path(export_run(summary["run_dir"]))
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("factor", "original", "truncate"),
    [(32.0, 4096, False), (8.0, 256, False), (4.0, 64, True), (2.0, 16, False)],
)
def test_drafter_rotary_is_transformers_yarn(factor, original, truncate):
    """The rotary a drafter derives from a gpt-oss config (`draftinfer.models.rope`, YaRN with
    the release's `truncate: false` and the attention factor on cos and sin) equals
    transformers' `GptOssRotaryEmbedding` bit for bit, past the original context too."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from draftinfer.models.rope import RotaryEmbedding, rope_from_hf
    from tests.support.moe_models import gpt_oss_config

    cfg = gpt_oss_config(head_dim=64, yarn_factor=factor, original_max=original)
    cfg.max_position_embeddings = int(factor * original)
    cfg.rope_parameters["truncate"] = truncate
    theta, scaling = rope_from_hf(cfg, 64)
    ours = RotaryEmbedding(64, theta, scaling)
    hf = GptOssRotaryEmbedding(cfg)
    assert torch.equal(ours.inv_freq, hf.inv_freq)
    assert ours.attention_factor == hf.attention_scaling > 1
    pos = torch.arange(0, 3 * original)
    cos, sin = hf(torch.zeros(1), pos[None])  # [1, N, D/2]: gpt-oss rotates halves
    ocos, osin = ours(pos)  # [N, D]
    assert torch.equal(ocos[:, :32], cos[0]) and torch.equal(ocos[:, 32:], cos[0])
    assert torch.equal(osin[:, :32], sin[0]) and torch.equal(osin[:, 32:], sin[0])


def test_yarn_keys_are_parsed_strictly():
    from draftinfer.files.errors import ConfigError
    from draftinfer.models.rope import parse_rope

    ok = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}
    assert parse_rope({**ok, "truncate": False, "beta_fast": 32.0}, 64)[1]["truncate"] is False
    with pytest.raises(ConfigError, match="unknown rope key 'low_freq_factor'"):
        parse_rope({**ok, "low_freq_factor": 1.0}, 64)
    with pytest.raises(ConfigError, match="needs 'original_max_position_embeddings'"):
        parse_rope({"rope_type": "yarn", "factor": 8.0}, 64)


def test_a_kind_the_family_does_not_fit_is_refused_in_one_line():
    """The runner builds no MTP block for this family yet (`drafter_block` not provided: its
    layers route tokens to experts, and its own layer is not run as a module's block): refused
    before anything loads."""
    from draftinfer.files.errors import ConfigError
    from draftinfer.registry import drafter_spec

    assert "mtp" not in kinds_for_family(FAMILY)
    with pytest.raises(
        ConfigError, match="cannot run on a 'gpt_oss' target: it needs drafter_block"
    ):
        train_family(FAMILY).check_kind(drafter_spec("mtp"))
