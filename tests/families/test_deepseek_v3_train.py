"""DeepSeek-V3 on the training side: the family's frozen target (transformers'
`DeepseekV3ForCausalLM`) gives the same features as the runner's native target (layer-input taps
of the dense and the MoE layers, the post-norm final hidden) and the same logits on a padded
batch, so a drafter trains on what it is served with; the family is selected by architecture;
every kind that fits trains through it, `mtp` with the family's own layer as each module's
block."""

from __future__ import annotations

import pytest
import torch

from drafttrain.registry import target_family
from tests.support.kind_factories import kinds_for_family
from tests.support.moe_checkpoints import save_moe_target
from tests.support.moe_models import MLA_YARN_SHORT, deepseek_v3_config
from tests.support.moe_targets import (
    assert_frozen_equals_native,
    train_a_few_steps,
    write_chat,
)
from tests.support.tiny_models import save_tiny_target
from tests.support.tiny_tokenizers import make_llama3_tokenizer

FAMILY = "deepseek_v3"
YARN = MLA_YARN_SHORT

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny random DeepSeek-V3 (8 layers: the default taps (2, 4, 5) are distinct; 2 dense)
    with a chat tokenizer saved beside it and patterned chat data."""
    root = tmp_path_factory.mktemp("dsv3_train")
    tok = make_llama3_tokenizer(root / "tok")
    cfg = deepseek_v3_config(
        vocab_size=len(tok), layers=8, hidden=32, heads=2, first_k_dense_replace=2, yarn=YARN
    )
    cfg.initializer_range = 0.2
    cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    target = save_tiny_target(cfg, root / "target")
    tok.save_pretrained(str(target))
    return {"target": str(target), "data": str(write_chat(root / "chat.jsonl"))}


def test_frozen_target_features_equal_the_native_targets(tmp_path):
    """Padded batch of three rows, taps at every layer plus the post-norm final hidden: the
    training side's frozen target (HF, SDPA) and the runner's native target agree."""
    cfg = deepseek_v3_config(layers=4, first_k_dense_replace=1, yarn=YARN, rope_interleave=True)
    path = save_moe_target(cfg, tmp_path / "t", seed=3)
    assert_frozen_equals_native(FAMILY, path)


def test_family_is_selected_by_architecture(env):
    assert target_family(env["target"]).name == FAMILY


@pytest.mark.parametrize("kind", kinds_for_family(FAMILY))
def test_every_kind_trains_through_the_family(env, tmp_path, kind):
    losses, _ = train_a_few_steps(FAMILY, env, kind, tmp_path)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.9 * losses[0], losses


def test_mtp_trains_with_the_familys_own_layer_as_block(env, tmp_path):
    """MTP modules on this family are built with the runner's block for it (`block: native`,
    the family's own native layer: MLA with a latent cache, routed experts), the one
    definition the runner serves (`tests/families/test_deepseek_v3_mtp.py`)."""
    from draftinfer.models.mla import LatentAttention

    assert "mtp" in kinds_for_family(FAMILY)
    losses, arch = train_a_few_steps(FAMILY, env, "mtp", tmp_path, steps=6)
    assert arch.block == "native" and arch.own_layer
    assert losses[-1] < losses[0], losses
    from draftinfer.registry import drafter_spec

    d = drafter_spec("mtp").build(arch)
    assert all(isinstance(layer.block.self_attn, LatentAttention) for layer in d.layers)
