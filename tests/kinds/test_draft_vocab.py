"""S5: the draft vocabulary (d2t offsets, t2d mask): selection rule, identity round trip,
never outside [0, V), logits mapping with -inf elsewhere, and the safetensors cache."""

from __future__ import annotations

import datasets
import pytest
import torch
from safetensors import safe_open

from drafttrain.data import (
    build_draft_vocab,
    draft_to_target_ids,
    load_or_build_draft_vocab,
    map_draft_logits_to_target,
)
from drafttrain.jobs.errors import DataError

V = 53  # prime, so nothing lines up by accident


def random_rows(n_rows=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(n_rows):
        length = int(torch.randint(1, 30, (1,), generator=g))
        # Skewed distribution so frequencies differ: low ids are common.
        row = (torch.rand(length, generator=g) ** 3 * V).long().clamp(max=V - 1)
        ids.append(row.tolist())
        masks.append((torch.rand(length, generator=g) < 0.6).long().tolist())
    return ids, masks


def check_invariants(d2t, t2d, draft_vocab_size):
    assert d2t.dtype == torch.long and d2t.shape == (draft_vocab_size,)
    assert t2d.dtype == torch.bool and t2d.shape == (V,)
    target = draft_to_target_ids(d2t)
    assert target.min() >= 0 and target.max() < V
    assert torch.all(target[1:] > target[:-1])  # ascending, hence distinct
    assert t2d[target].all() and int(t2d.sum()) == draft_vocab_size  # identity round trip
    # And back: every draft id is recovered from its target id through t2d's cumulative count.
    draft_of_target = torch.cumsum(t2d.long(), 0) - 1
    assert torch.equal(draft_of_target[target], torch.arange(draft_vocab_size))


@pytest.mark.parametrize("draft_vocab_size", [1, 7, 20, V])
def test_round_trip_invariants(draft_vocab_size):
    ids, masks = random_rows()
    d2t, t2d = build_draft_vocab(ids, masks, V, draft_vocab_size)
    check_invariants(d2t, t2d, draft_vocab_size)


def test_top_k_by_masked_frequency_ties_to_smaller_id():
    # Masked counts: 7 -> 3, 2 -> 2, 9 -> 2, 4 -> 1. Token 1 is everywhere but never masked.
    ids = [[1, 7, 1, 7, 2, 1], [9, 1, 7, 9, 2, 4, 1, 1]]
    masks = [[0, 1, 0, 1, 1, 0], [1, 0, 1, 1, 1, 1, 0, 0]]
    d2t, t2d = build_draft_vocab(ids, masks, V, 3)
    # Top 3: 7, then 2 and 9 (tied, both fit); returned in ascending target id order.
    assert draft_to_target_ids(d2t).tolist() == [2, 7, 9]
    assert d2t.tolist() == [2 - 0, 7 - 1, 9 - 2]
    assert not t2d[1]  # frequent only at unmasked positions: not chosen
    d2t, _ = build_draft_vocab(ids, masks, V, 2)
    assert draft_to_target_ids(d2t).tolist() == [2, 7]  # tie 2 vs 9 -> smaller id


def test_fill_with_smallest_unused_ids():
    ids, masks = [[40, 40, 13, 1]], [[1, 1, 1, 0]]
    d2t, t2d = build_draft_vocab(ids, masks, V, 5)
    # Seen: 40, 13. Fill with the smallest unused: 0, 1, 2 (1 was only unmasked).
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 13, 40]
    check_invariants(d2t, t2d, 5)


def test_size_and_range_errors():
    with pytest.raises(DataError, match="exceeds the target vocab") as err:
        build_draft_vocab([[1]], [[1]], V, V + 1)
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="outside the target vocab"):
        build_draft_vocab([[V]], [[1]], V, 4)


def test_map_draft_logits_to_target():
    d2t, _ = build_draft_vocab([[3, 3, 11, 50]], [[1, 1, 1, 1]], V, 4)
    target = draft_to_target_ids(d2t)
    assert target.tolist() == [0, 3, 11, 50]
    logits = torch.randn(2, 5, 4)  # [B, T, Dd]
    full = map_draft_logits_to_target(logits, d2t, V)  # [B, T, V]
    assert full.shape == (2, 5, V)
    assert torch.equal(full[..., target], logits)
    others = torch.ones(V, dtype=torch.bool)
    others[target] = False
    assert torch.all(full[..., others] == float("-inf"))
    # argmax round trip: the draft argmax, mapped through d2t, is the full-vocab argmax.
    assert torch.equal(full.argmax(-1), target[logits.argmax(-1)])
    # Softmax over the full vocab gives exactly zero where the drafter cannot propose.
    assert torch.all(full.softmax(-1)[..., others] == 0)


def test_cache_is_safetensors_and_reloads_equal(tmp_path):
    ids, masks = random_rows()
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})
    d2t, t2d = load_or_build_draft_vocab(ds, V, 16, str(tmp_path))
    ref = build_draft_vocab(ids, masks, V, 16)
    assert torch.equal(d2t, ref[0]) and torch.equal(t2d, ref[1])

    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    with safe_open(str(files[0]), framework="pt") as f:  # a real safetensors file
        assert set(f.keys()) == {"d2t", "t2d"}
        assert f.get_tensor("t2d").dtype == torch.bool
    mtime = files[0].stat().st_mtime_ns

    again = load_or_build_draft_vocab(ds, V, 16, str(tmp_path))
    assert torch.equal(again[0], d2t) and torch.equal(again[1], t2d)
    assert files[0].stat().st_mtime_ns == mtime  # read, not rebuilt

    # Another size is another key: a second file, not a stale hit.
    other = load_or_build_draft_vocab(ds, V, 8, str(tmp_path))
    assert other[0].shape == (8,)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


def test_cache_file_path_with_stale_key_is_rebuilt(tmp_path):
    ids, masks = random_rows()
    path = str(tmp_path / "vocab.safetensors")
    ds_a = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})
    ds_b = datasets.Dataset.from_dict({"input_ids": ids[:5], "loss_mask": masks[:5]})
    load_or_build_draft_vocab(ds_a, V, 10, path)
    d2t_b, _ = load_or_build_draft_vocab(ds_b, V, 10, path)
    assert torch.equal(d2t_b, build_draft_vocab(ids[:5], masks[:5], V, 10)[0])


def test_dataset_after_filter_counts_only_kept_rows():
    # Arrow reading must respect the indices mapping that filter/select leave behind.
    ids = [[5, 5, 5], [6], [7, 7]]
    masks = [[1, 1, 1], [1], [1, 1]]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).select([2, 1])
    d2t, _ = load_or_build_draft_vocab(ds, V, 2, None)
    assert draft_to_target_ids(d2t).tolist() == [6, 7]
