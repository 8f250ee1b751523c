"""The training target behind the target interface, against HF transformers: S4 (layer-input
taps equal HF's `output_hidden_states[j]` on text targets), the final hidden state pre- and
post-norm, the RoPE positions it used and the input embeddings; one-line loading errors."""

from __future__ import annotations

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.models.target import FeatureSpec
from drafttrain.frozen.target import FrozenTarget
from drafttrain.jobs.config import TargetConfig
from drafttrain.jobs.errors import ConfigError, TargetError
from drafttrain.kinds.eagle3.objective import default_aux_layer_ids


def _batch():
    torch.manual_seed(0)
    ids = torch.randint(3, 500, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right-padded rows
    mask[2, 4:] = 0
    pos = torch.arange(11).expand(3, 11)
    return ids, mask, Slots(torch.arange(3), torch.where(mask.bool(), pos, -1))


@pytest.mark.parametrize("which", ["tiny_llama3_dir", "tiny_qwen3_dir"])
def test_features_equal_hf(which, request):
    path = request.getfixturevalue(which)
    target = FrozenTarget(
        TargetConfig(name_or_path=str(path), attn_implementation="eager"), torch.device("cpu")
    )
    ids, mask, slots = _batch()
    ref = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    H, L = target.info.hidden_size, target.info.num_layers
    # Layer-input taps, in the requested order (repeats allowed), then the final hidden.
    for final in (None, "pre_norm", "post_norm"):
        spec = FeatureSpec(layer_inputs=(5, 0, 3, 1), final_hidden=final)
        out = target(ids, slots, spec)
        assert out.features.shape == (3, 11, spec.count * H)
        real = mask.bool()  # padding slots are garbage by contract
        for i, j in enumerate((5, 0, 3, 1)):
            got = out.features[..., i * H : (i + 1) * H]
            assert torch.equal(got[real], ref.hidden_states[j][real]), j
        assert torch.equal(out.logits[real], ref.logits.float()[real])
        assert torch.equal(out.inputs_embeds, ref.hidden_states[0])
        assert torch.equal(out.rope_pos, slots.cache_pos.clamp(min=0))
        if final is not None:
            last = out.features[..., 4 * H :][real]
            # HF's last hidden_states entry is the post-norm output; pre-norm = the last
            # layer's output, which the final norm maps onto it.
            norm = target.model.get_decoder().norm
            post = ref.hidden_states[L][real]
            if final == "pre_norm":
                assert torch.equal(norm(last), post)
                assert not torch.allclose(last, post)
            else:
                assert torch.equal(last, post)


def test_default_taps_and_range_error(tiny_llama3_dir):
    assert default_aux_layer_ids(32) == [2, 16, 29]
    t = FrozenTarget(TargetConfig(name_or_path=str(tiny_llama3_dir)), torch.device("cpu"))
    ids, _, slots = _batch()
    with pytest.raises(ConfigError, match=r"feature taps \[6\] out of range.*6 decoder layers"):
        t(ids, slots, FeatureSpec(layer_inputs=(1, 6)))


def test_target_is_frozen_fp32_on_cpu(tiny_qwen3_dir):
    t = FrozenTarget(TargetConfig(name_or_path=str(tiny_qwen3_dir)), torch.device("cpu"))
    assert not t.model.training
    assert all(not p.requires_grad for p in t.model.parameters())
    assert next(t.model.parameters()).dtype == torch.float32
    assert t.info.num_layers == 6 and t.info.rope_axes == 1


@pytest.mark.parametrize("path", ["/nonexistent/target", "./missing-dir", "a/b/c"])
def test_missing_target_path_is_one_line_error(path):
    with pytest.raises(TargetError) as e:
        FrozenTarget(TargetConfig(name_or_path=path), torch.device("cpu"))
    msg = str(e.value)
    assert "target not found" in msg and path in msg and "\n" not in msg
