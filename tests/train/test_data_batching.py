"""Length-bucketed batch order (determinism per (seed, epoch), coverage, homogeneity) and
padding collation (shapes and every value, padding included)."""

from __future__ import annotations

import random

import pytest
import torch

from drafttrain.data import collate, length_bucketed_batches
from drafttrain.data.batching import MEGA_CHUNK_BATCHES

# 1009 (prime) examples: the last batch of a chunk is short, chunks are uneven.
_RNG = random.Random(0)
LENGTHS = [_RNG.randint(1, 500) for _ in range(1009)]


def flat(batches):
    return [i for b in batches for i in b]


@pytest.mark.parametrize("batch_size", [1, 7, 16])
def test_every_index_exactly_once(batch_size):
    batches = length_bucketed_batches(LENGTHS, batch_size, seed=3, epoch=0)
    assert sorted(flat(batches)) == list(range(len(LENGTHS)))
    assert all(1 <= len(b) <= batch_size for b in batches)
    # Only the last batch of each mega-chunk may be short.
    n_chunks = -(-len(LENGTHS) // (MEGA_CHUNK_BATCHES * batch_size))
    assert sum(len(b) < batch_size for b in batches) <= n_chunks


def test_deterministic_per_seed_and_epoch():
    a = length_bucketed_batches(LENGTHS, 8, seed=1, epoch=2)
    assert a == length_bucketed_batches(LENGTHS, 8, seed=1, epoch=2)
    assert a != length_bucketed_batches(LENGTHS, 8, seed=1, epoch=3)
    assert a != length_bucketed_batches(LENGTHS, 8, seed=2, epoch=2)


def test_batches_are_length_homogeneous():
    batches = length_bucketed_batches(LENGTHS, 8, seed=0, epoch=0)
    # Within a batch the spread is far below the spread of a random batch of 8.
    bucketed = sum(max(LENGTHS[i] for i in b) - min(LENGTHS[i] for i in b) for b in batches)
    rng = random.Random(0)
    order = list(range(len(LENGTHS)))
    rng.shuffle(order)
    random_batches = [order[i : i + 8] for i in range(0, len(order), 8)]
    unbucketed = sum(
        max(LENGTHS[i] for i in b) - min(LENGTHS[i] for i in b) for b in random_batches
    )
    assert bucketed * 10 < unbucketed
    # Inside a batch, indices are sorted by length (sorted mega-chunk cut in order).
    assert all([LENGTHS[i] for i in b] == sorted(LENGTHS[i] for i in b) for b in batches)


def test_batch_order_is_shuffled_across_lengths():
    batches = length_bucketed_batches(LENGTHS, 8, seed=0, epoch=0)
    firsts = [LENGTHS[b[0]] for b in batches]
    assert firsts != sorted(firsts) and firsts != sorted(firsts, reverse=True)


def test_no_shuffle_keeps_chunk_order():
    lengths = [5, 1, 4, 1, 3]
    assert length_bucketed_batches(lengths, 2, seed=0, epoch=0, shuffle=False) == [
        [1, 3],
        [4, 2],
        [0],
    ]
    assert length_bucketed_batches(lengths, 2, seed=0, epoch=9, shuffle=False) == [
        [1, 3],
        [4, 2],
        [0],
    ]


def test_empty_dataset_gives_no_batches():
    assert length_bucketed_batches([], 4, seed=0, epoch=0) == []


def test_collate_pads_right_with_positions():
    examples = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"input_ids": [8], "loss_mask": [1], "length": 1},
        {"input_ids": [9, 10, 11, 12, 13], "loss_mask": [0, 0, 1, 0, 1]},
    ]
    out = collate(examples, pad_id=99)
    assert set(out) == {"input_ids", "attention_mask", "loss_mask", "position_ids"}
    for v in out.values():
        assert v.dtype == torch.long and v.shape == (3, 5)
    assert out["input_ids"].tolist() == [
        [5, 6, 7, 99, 99],
        [8, 99, 99, 99, 99],
        [9, 10, 11, 12, 13],
    ]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert out["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 1, 0, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 0], [0, 0, 0, 0, 0], [0, 1, 2, 3, 4]]


def test_collate_accepts_tensors_and_rejects_mismatched_mask():
    out = collate(
        [{"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([1, 1])}], pad_id=0
    )
    assert out["input_ids"].tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="loss_mask"):
        collate([{"input_ids": [1, 2], "loss_mask": [1]}], pad_id=0)
