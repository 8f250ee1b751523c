"""`SpecDecoder(emit_features=True)`: the runner hands back the target features it computed for
every committed token (the prefill's for the prompt, each round's verify forward's for the
tokens it committed), what an online trainer consumes without a second target pass. They equal
a fresh prefill of the target over the whole committed sequence, row for row (f_i pairs with
token i + 1, convention 1), with and without pipelining, across a drafter swap, for requests
that stop on EOS and on max_tokens; with it off nothing is copied. Their columns are the
drafter's features plus the head input (`FeatureSpec.with_head_input`), what training needs
(`tests/train/test_emitted.py` trains on them)."""

from __future__ import annotations

import pytest
import torch

from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.swap import DrafterUpdate
from tests.support.native_parity import prefill_features
from tests.support.prompts import zoo_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("pipeline", [False, True])
def test_emitted_features_equal_a_fresh_prefill(kind_env, pipeline):
    env = kind_env("eagle3")
    target, drafter = env["target"], env["drafter"]
    eos = tuple(target.config.eos_token_ids)
    prompts = zoo_prompts(10, seed=4)
    reqs = [
        Request(p, max_tokens=12 + 5 * (i % 4), stop_token_ids=eos) for i, p in enumerate(prompts)
    ]
    dec = SpecDecoder(
        target, drafter, 3, max_batch=4, max_model_len=384, pipeline=pipeline, emit_features=True
    )
    update = DrafterUpdate.from_export(env["export"], 1)  # the same weights, as version 1
    n = [0]

    def between_rounds(d):
        n[0] += 1
        if n[0] == 3:
            d.update_drafter(update)

    outs, stats = dec.generate(reqs, between_rounds=between_rounds)
    assert sum(a for o in outs for a in o.accepted) > 20  # rounds committed accepted drafts
    for p, o in zip(prompts, outs):
        seq = p + o.token_ids
        # The drafter's features plus the head input (eagle3: the pre-norm final hidden).
        assert dec.emit_spec == drafter.config.features.with_head_input()
        assert o.features.shape == (len(seq) - 1, dec.emit_spec.width(target.info.hidden_size))
        want = prefill_features(target, seq[:-1], dec.emit_spec)
        torch.testing.assert_close(o.features, want, rtol=1e-4, atol=1e-3)


def test_no_features_unless_asked(kind_env):
    env = kind_env("eagle3")
    dec = SpecDecoder(env["target"], env["drafter"], 3, max_batch=2, max_model_len=384)
    outs, _ = dec.generate([Request(zoo_prompts(1, seed=1)[0], max_tokens=8)])
    assert outs[0].features is None
