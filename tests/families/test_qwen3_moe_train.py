"""Qwen3-MoE on the training side: the family's frozen target (transformers'
`Qwen3MoeForCausalLM`, SDPA) taps the residual stream entering each decoder layer, MoE and
dense (`mlp_only_layers`) alike, equal to transformers' `output_hidden_states[j]`; the default
ids have vLLM's semantics (S4, K1 on Qwen3-MoE); every drafter kind trains through the family's
own target and Qwen3 chat (its `<think>` block in the loss mask).

The family is selected by name; the test that selects it by architecture needs the runner's
Qwen3-MoE family (another branch) and skips until it is registered.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftinfer.kinds.dflash.taps import default_dflash_ids
from draftinfer.models.target import FeatureSpec
from drafttrain.registry import InitContext, train_family, train_spec
from tests.support.kind_factories import kinds_for_family
from tests.support.moe_models import qwen3_moe_config
from tests.support.moe_targets import (
    family_target,
    hf_hidden_states,
    make_moe_env,
    needs_runner_family,
    padded_batch,
    split_for,
    train_a_few_steps,
)
from tests.support.tiny_models import save_tiny_target

FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_moe_env(tmp_path_factory.mktemp("qwen3_moe"), FAMILY)


@pytest.fixture(scope="module")
def target(env):
    return family_target(FAMILY, env["target"])


def _rows(env, n: int = 3) -> list[list[int]]:
    _, split = split_for(FAMILY, env)
    return [split.data[i]["input_ids"] for i in range(n)][::-1]


def test_family_keeps_the_configured_attention(target):
    assert target.model.config._attn_implementation == "sdpa"
    assert target.info.architecture == "Qwen3MoeForCausalLM"


def _check_taps(target, rows, layers) -> None:
    ids, mask, slots = padded_batch(rows, 0)
    out = target(ids, slots, FeatureSpec(layer_inputs=tuple(layers)))
    hidden, _ = hf_hidden_states(target.cfg.name_or_path, ids, mask, attn="sdpa")
    expected = torch.cat([hidden[j] for j in layers], dim=-1)
    real = mask.bool()
    torch.testing.assert_close(out.features[real], expected[real], rtol=0, atol=0)


def test_taps_equal_output_hidden_states_on_every_layer(env, target):
    rows = _rows(env)
    assert len({len(r) for r in rows}) > 1  # padding in the batch
    _check_taps(target, rows, range(target.info.num_layers))


def test_taps_of_dense_and_moe_layers(env, tmp_path):
    """With `mlp_only_layers` (dense SwiGLU layers among the MoE ones) the taps still equal
    HF `output_hidden_states[j]`: the capture is of the residual stream, whatever the MLP."""
    tok, _ = split_for(FAMILY, env)
    cfg = qwen3_moe_config(vocab_size=len(tok), layers=6, mlp_only_layers=[0, 3])
    cfg.initializer_range = 0.2
    path = save_tiny_target(cfg, tmp_path / "mixed")
    target = family_target(FAMILY, str(path))
    assert type(target.layers[3].mlp).__name__ == "Qwen3MoeMLP"
    assert type(target.layers[2].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    _check_taps(target, _rows(env), range(6))


def test_default_taps_eagle3_and_dflash(env, target):
    """eagle3 reads (2, L//2, L-3) as layer inputs; dflash z-lab's ids t as layer outputs
    (taps t + 1): both equal HF `hidden_states` at those indices."""
    tok, split = split_for(FAMILY, env)
    ctx = InitContext(target, tok, split.data, None)
    eagle = train_spec("eagle3")
    feats = eagle.features(eagle.config_class(draft_vocab_size=64), ctx)
    assert feats.layer_inputs == (2, 4, 5)
    dflash = train_spec("dflash")
    dfeats = dflash.features(dflash.config_class(num_layers=3, block_size=4, gamma=4.0), ctx)
    assert dfeats.layer_inputs == tuple(t + 1 for t in default_dflash_ids(8, 3))
    _check_taps(target, _rows(env, 2), feats.layer_inputs)
    _check_taps(target, _rows(env, 2), dfeats.layer_inputs)


def test_think_block_is_in_the_loss_mask(env):
    tok, split = split_for(FAMILY, env)
    row = split.data[0]
    generated = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert generated.startswith("<think>\n\n</think>\n\n") and generated.endswith("<|im_end|>")


@pytest.mark.parametrize("kind", kinds_for_family(FAMILY))
def test_every_kind_trains_through_the_family(env, tmp_path, kind):
    losses, _ = train_a_few_steps(FAMILY, env, kind, tmp_path)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.slow
@needs_runner_family(FAMILY)
def test_train_job_selects_the_family_by_architecture(env, tmp_path):
    from drafttrain.export.directory import export_run
    from drafttrain.jobs.train import train
    from drafttrain.registry import target_family
    from tests.support.presets import compose_preset, small_overrides

    assert target_family(env["target"]).name == FAMILY
    cfg = compose_preset("eagle3", small_overrides(env, tmp_path / "run", steps=8))
    summary = train(cfg)
    assert summary["last_loss"] < summary["first_loss"]
    out = Path(export_run(summary["run_dir"]))
    assert (out / "model.safetensors").is_file()


def test_a_kind_the_family_does_not_fit_is_refused_in_one_line():
    """The runner builds no MTP block for this family yet (`drafter_block` not provided: its
    layers route tokens to experts, and its own layer is not run as a module's block): refused
    before anything loads."""
    from draftinfer.files.errors import ConfigError
    from draftinfer.registry import drafter_spec

    assert "mtp" not in kinds_for_family(FAMILY)
    with pytest.raises(
        ConfigError, match="cannot run on a 'qwen3_moe' target: it needs drafter_block"
    ):
        train_family(FAMILY).check_kind(drafter_spec("mtp"))
