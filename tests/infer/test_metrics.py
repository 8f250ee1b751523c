"""Convention 11: AL = mean over rounds of (accepted + 1); per-position acceptance."""

import math

import pytest

from draftinfer.conventions.metrics import acceptance_length, per_position_acceptance


def test_acceptance_length():
    assert acceptance_length([0, 0, 0]) == 1.0
    assert acceptance_length([3, 1, 2, 0]) == pytest.approx((4 + 2 + 3 + 1) / 4)
    assert math.isnan(acceptance_length([]))


def test_per_position_acceptance_with_capped_rounds():
    # Round 3 proposed only 1 draft (near max_model_len): it counts at position 1 only.
    acc = per_position_acceptance([3, 1, 1, 0], [3, 3, 1, 3], k=3)
    assert acc == pytest.approx([3 / 4, 1 / 3, 1 / 3])
    assert math.isnan(per_position_acceptance([0], [1], k=2)[1])


def test_per_position_acceptance_validates():
    with pytest.raises(ValueError):
        per_position_acceptance([2], [1], k=2)
    with pytest.raises(ValueError):
        per_position_acceptance([1, 0], [1], k=2)
