"""GLM-4.7-Flash on the training side: the family's frozen target (transformers'
`Glm4MoeLiteForCausalLM`) gives the same features as the runner's native target (layer-input
taps of the dense and the MoE layers, the post-norm final hidden) and the same logits on a
padded batch, so a drafter trains on what it is served with; the family is selected by
architecture; every kind that fits trains through it; `mtp` is refused in one line."""

from __future__ import annotations

import pytest
import torch

from drafttrain.registry import target_family, train_family
from tests.support.kind_factories import kinds_for_family
from tests.support.moe_checkpoints import save_moe_target
from tests.support.moe_models import MLA_YARN_SHORT, glm4_moe_lite_config
from tests.support.moe_targets import (
    assert_frozen_equals_native,
    train_a_few_steps,
    write_chat,
)
from tests.support.tiny_models import save_tiny_target
from tests.support.tiny_tokenizers import make_llama3_tokenizer

FAMILY = "glm4_moe_lite"
YARN = MLA_YARN_SHORT

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny random GLM-4.7-Flash (8 layers: the default taps (2, 4, 5) are distinct; 2 dense)
    with a chat tokenizer saved beside it and patterned chat data."""
    root = tmp_path_factory.mktemp("glm4_moe_lite_train")
    tok = make_llama3_tokenizer(root / "tok")
    cfg = glm4_moe_lite_config(
        vocab_size=len(tok), layers=8, hidden=32, heads=2, dense_layers=2, yarn=YARN
    )
    cfg.initializer_range = 0.5  # peaked next-token distributions (entropy ~3 nats of 6.1)
    cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    target = save_tiny_target(cfg, root / "target")
    tok.save_pretrained(str(target))
    return {"target": str(target), "data": str(write_chat(root / "chat.jsonl"))}


def test_frozen_target_features_equal_the_native_targets(tmp_path):
    """Padded batch of three rows, taps at every layer plus the post-norm final hidden: the
    training side's frozen target (HF, SDPA) and the runner's native target agree."""
    cfg = glm4_moe_lite_config(layers=4, dense_layers=1, yarn=YARN, rope_interleave=True)
    path = save_moe_target(cfg, tmp_path / "t", seed=3)
    assert_frozen_equals_native(FAMILY, path)


def test_family_is_selected_by_architecture(env):
    assert target_family(env["target"]).name == FAMILY


@pytest.mark.parametrize("kind", kinds_for_family(FAMILY))
def test_every_kind_trains_through_the_family(env, tmp_path, kind):
    losses, _ = train_a_few_steps(FAMILY, env, kind, tmp_path)
    print(kind, [round(x, 2) for x in losses[::5]])
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.9 * losses[0], losses


def test_mtp_is_refused_in_one_line():
    """MTP modules are dense Llama blocks here; this family's layers are MLA + routed experts
    (`dense_decoder_layer` not provided): refused before anything loads."""
    from draftinfer.files.errors import ConfigError
    from draftinfer.registry import drafter_spec

    assert "mtp" not in kinds_for_family(FAMILY)
    with pytest.raises(ConfigError, match="cannot run on a 'glm4_moe_lite' target") as e:
        train_family(FAMILY).check_kind(drafter_spec("mtp"))
    assert "\n" not in str(e.value)
