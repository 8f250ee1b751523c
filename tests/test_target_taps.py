"""S4: aux taps are the hidden state entering each tapped layer, equal to HF's
`output_hidden_states[j]` on text targets; target loading errors are one line."""

from __future__ import annotations

import pytest
import torch

from drafttrain.config import TargetConfig
from drafttrain.errors import TargetError
from drafttrain.target import FrozenTarget, default_aux_layer_ids


@pytest.mark.parametrize("which", ["tiny_llama3_dir", "tiny_qwen3_dir"])
def test_aux_taps_equal_hf_hidden_states(which, request):
    path = request.getfixturevalue(which)
    target = FrozenTarget(
        TargetConfig(name_or_path=str(path), attn_implementation="eager"),
        torch.device("cpu"),
        [0, 1, 3, 5],
    )
    torch.manual_seed(0)
    ids = torch.randint(3, 500, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # a right-padded row
    mask[2, 4:] = 0
    taps, logits = target.capture(ids, mask)
    ref = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    for j in [0, 1, 3, 5]:
        assert torch.equal(taps[j], ref.hidden_states[j]), j
    assert torch.equal(logits, ref.logits.float())
    out = target(ids, mask)
    H = target.hidden_size
    assert out.aux.shape == (3, 11, 4 * H)
    assert torch.equal(out.aux[..., 2 * H : 3 * H], ref.hidden_states[3])


def test_default_taps_and_range_error(tiny_llama3_dir):
    assert default_aux_layer_ids(32) == [2, 16, 29]
    t = FrozenTarget(TargetConfig(name_or_path=str(tiny_llama3_dir)), torch.device("cpu"), None)
    assert t.aux_layer_ids == [2, 3, 3]
    with pytest.raises(TargetError, match=r"aux_layer_ids \[6\] out of range.*6 decoder layers"):
        FrozenTarget(TargetConfig(name_or_path=str(tiny_llama3_dir)), torch.device("cpu"), [1, 6])


def test_target_is_frozen_fp32_on_cpu(tiny_qwen3_dir):
    t = FrozenTarget(TargetConfig(name_or_path=str(tiny_qwen3_dir)), torch.device("cpu"), None)
    assert not t.model.training
    assert all(not p.requires_grad for p in t.model.parameters())
    assert next(t.model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("path", ["/nonexistent/target", "./missing-dir", "a/b/c"])
def test_missing_target_path_is_one_line_error(path):
    with pytest.raises(TargetError) as e:
        FrozenTarget(TargetConfig(name_or_path=path), torch.device("cpu"), None)
    msg = str(e.value)
    assert "target not found" in msg and path in msg and "\n" not in msg
