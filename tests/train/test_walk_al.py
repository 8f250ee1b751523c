"""The training-time walk AL (`drafttrain.jobs.walk_al`): the walk's rule
(`draftinfer.conventions.metrics.walk_rounds`, the runner's own counting at a continuation's
end) on hand-made cases, and the replay of the runner's rounds with the trainer's forward on
a randomized drafter that the runner then serves: the same rounds, draft for draft. The
trained drafters' gaps are checked by the zoo and preset jobs (`tests/jobs/test_zoo_e2e.py`,
`tests/jobs/test_preset_golden.py`)."""

from __future__ import annotations

import pytest
import torch

from draftinfer.conventions.metrics import walk_rounds

pytestmark = pytest.mark.usefixtures("one_thread")


def test_walk_rule_stops_and_caps_as_the_runner_counts():
    a = [2, 0, 0, 3, 1, 0, 0, 0, 5]
    # 9 tokens, ended by end-of-sequence: start 0 accepts 2 -> start 3 accepts 3 -> start 7
    # accepts 0 -> done (start 8 is the last token); drafts past the end count
    assert walk_rounds(lambda s: a[s], 9, stopped=True) == [2, 3, 0]
    # the same, cut by the budget: the round at 3 may keep 9 - 2 - 3 = 4 >= 3, at 7 none left
    assert walk_rounds(lambda s: a[s], 9, stopped=False) == [2, 3, 0]
    b = [5, 0, 0, 0, 0, 0]
    assert walk_rounds(lambda s: b[s], 6, stopped=True) == [5]  # past the end-of-sequence
    assert walk_rounds(lambda s: b[s], 6, stopped=False) == [4]  # capped by the budget
    assert walk_rounds(lambda s: 0, 1, stopped=True) == []  # one token: no round


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "ptd", "dflash", "mtp"])
def test_walk_replays_the_runners_rounds(kind_env, kind):
    """The kind's trained zoo drafter (it accepts: asserted) walked by the trainer's forward
    (`walk_al`, the objective's `anchor_logits` over the frozen target's features) and served
    by the runner over the same prompts and greedy continuations: the same number of rounds
    and the same AL."""
    from draftinfer.decoding.baseline import greedy_generate
    from draftinfer.decoding.engine import Request, SpecDecoder
    from draftinfer.files.loading import load_native_target
    from draftinfer.files.paths import resolve_path
    from drafttrain.jobs.walk_al import walk_al
    from drafttrain.registry import train_spec
    from tests.support.kind_factories import frozen_target
    from tests.support.prompts import zoo_prompts

    zoo = str(resolve_path("zoo:llama-tiny"))
    drafter = kind_env(kind)["drafter"]
    spec = train_spec(kind)
    objective = spec.objective(drafter, spec.config_class(), "eager")
    target = load_native_target(zoo, "cpu", torch.float32, 4, 256)
    k, new = 3, 24
    prompts = zoo_prompts(4, seed=2)
    dec = SpecDecoder(target, drafter, k, max_batch=4, max_model_len=256)
    outs, _ = dec.generate([Request(p, max_tokens=new) for p in prompts])
    runner_rounds = [a for o in outs for a in o.accepted]
    assert sum(runner_rounds) > 0  # the drafter accepts
    full = greedy_generate(target, prompts, new + k + 1)  # past the budget: no stop token
    seqs = [{"prompt": p, "tokens": t, "n": new, "stopped": False} for p, t in zip(prompts, full)]
    got = walk_al(objective, frozen_target(zoo), seqs, k, torch.device("cpu"))
    assert got["sim_walk_rounds"] == len(runner_rounds)
    assert got["sim_walk_al"] == pytest.approx(1 + sum(runner_rounds) / len(runner_rounds))


@pytest.mark.parametrize("kind", ["eagle3", "ptd", "dflash", "mtp"])
@pytest.mark.parametrize("k", [1, 3])
def test_many_anchors_in_one_forward_equal_one_at_a_time(kind, k):
    """`anchors_logits` (every start of a sequence in one forward of the training layout)
    gives each anchor what `anchor_logits` of that anchor alone gives (S9's contract), k = 1
    (no mask slots) included: anchors do not see each other."""
    from drafttrain.registry import train_spec
    from tests.support.kind_factories import small_drafter

    d = small_drafter(kind)
    spec = train_spec(kind)
    obj = spec.objective(d, spec.config_class(), "eager")
    T = 15
    torch.manual_seed(4)
    V = d.embed_tokens.weight.shape[0]
    ids = torch.randint(0, V, (1, T))
    feats = torch.randn(1, T, d.config.features.width(d.embed_tokens.weight.shape[1]))
    pos = torch.arange(T)[None]
    anchors = [0, 3, 4, 8, 10]  # distinct, as the walk's starts are; adjacent ones too
    with torch.no_grad():
        many = obj.anchors_logits(ids, feats, pos, anchors, k)
        one = torch.stack([obj.anchor_logits(ids, feats, pos, a, k) for a in anchors])
    assert many.shape == one.shape and many.shape[:2] == (len(anchors), k)
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5)
