"""`draftbench.al_gap`: the runner's rounds replayed from one round at every start position
(the measurement that separates the walk's sampling from a teacher-forced score)."""

from __future__ import annotations

from draftbench.al_gap import measure, per_position, walk


def test_walk_goes_accepted_plus_one_and_ends_by_the_rule():
    # a[s]: drafts the round after token s accepts. 8 tokens: rounds at 0 (2), 3 (0), 4 (2).
    a = [2, 9, 9, 0, 3, 9, 9, 1]
    assert walk(a, 8, stopped=False) == [2, 0, 2]  # at 4: at most 8 - 2 - 4 = 2 (a bonus)
    # Ended by an end-of-sequence token: the last round counts every draft it accepted, past
    # that token too (the runner's and vLLM's count).
    assert walk(a, 8, stopped=True) == [2, 0, 3]
    assert walk([2, 9, 9, 0, 5, 9, 9, 1], 8, stopped=True) == [2, 0, 5]
    assert per_position([2, 0, 3], 3) == [2 / 3, 2 / 3, 1 / 3]


def test_the_walk_replayed_from_every_start_is_the_runners(zoo_run):
    summary = zoo_run("eagle3")
    res = measure(str(summary["export_dir"]), 6, 3, 32, 8)
    assert res["lossless"] and res["walk_replay_equal"]
    # The trained drafter accepts (a walk of rejections would replay trivially).
    assert res["walk"]["al"] > 1.2 and res["every_start"]["starts"] > 50
