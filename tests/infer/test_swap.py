"""Hot-swapped drafter updates (`draftinfer.decoding.swap`, `SpecDecoder.update_drafter`).

Two drafters of one config and different quality: each kind's zoo export (trained on the zoo
target, *good*) and the same module with its own floating weights replaced by noise (*bad*,
AL about 1). The runner starts on one and swaps to the other between rounds while many
requests are in flight, with the update in the export's own format (`model.safetensors`
tensors under their serving names, `DrafterUpdate.from_export`):

- T = 0: every request's tokens equal plain greedy decoding, with and without pipelining,
  requests in flight at each swap; the AL of each version (from the rounds it drafted) is the
  version's own: the trained export's well above the noise's.
- T = 1: the joint distribution of the first three emitted tokens (the harness of
  `tests/infer/test_lossless_sampling.py`) still matches the target's with a swap between the
  first and the second round of every request.
- A bad update (unknown / missing names, a wrong shape or dtype, NaN, another config, an old
  version) is a one-line error and leaves the running drafter bit-identical.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.sampling import SamplingParams
from draftinfer.decoding.swap import DrafterUpdate, SwapError
from draftinfer.files.checkpoint import load_drafter, serving_tensors
from draftinfer.registry import registered_kinds, spec_of
from tests.support.prompts import zoo_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = registered_kinds()
MAX_LEN = 384


def noisy(drafter: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`drafter` with its own floating weights replaced by small noise, in place: the same
    config, drafts the target rarely accepts. Integer tensors (a draft vocabulary map) kept."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in drafter.trainable_state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.05)
    return drafter


def export_update(export_dir: str, version: int) -> DrafterUpdate:
    return DrafterUpdate.from_export(export_dir, version)


def module_update(drafter: torch.nn.Module, version: int) -> DrafterUpdate:
    """An update holding `drafter`'s weights in the export's format (serving names, bf16)."""
    return DrafterUpdate(version, serving_tensors(drafter, torch.bfloat16))


def own_state(drafter) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in drafter.trainable_state_dict().items()}


def bad_drafter(env):
    d, _ = load_drafter(env["export"], env["target"].shared_weights())
    return noisy(d)


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_swap_under_load_is_lossless_and_al_follows_the_version(kind_env, kind, pipeline):
    env = kind_env(kind)
    target = env["target"]
    bad = bad_drafter(env)
    bad_update = module_update(bad_drafter(env), 2)  # the noise again, as version 2
    good_update = export_update(env["export"], 1)  # the trained export, read from disk
    prompts = zoo_prompts(20, seed=11)
    max_tokens = [24 + 7 * (i % 5) for i in range(len(prompts))]
    reqs = [Request(p, max_tokens=m) for p, m in zip(prompts, max_tokens)]
    k = 3
    dec = SpecDecoder(target, bad, k, max_batch=8, max_model_len=MAX_LEN, pipeline=pipeline)
    iteration = [0]

    def between_rounds(d: SpecDecoder) -> None:
        iteration[0] += 1
        if iteration[0] == 4:  # 8 requests in flight, 12 waiting
            d.update_drafter(good_update)
        if iteration[0] == 55:
            d.update_drafter(bad_update)

    outs, stats = dec.generate(reqs, between_rounds=between_rounds)
    plain = greedy_generate(target, prompts, max(max_tokens))
    for o, g, m in zip(outs, plain, max_tokens):
        assert o.token_ids == g[:m]  # nothing lost or changed across the swaps
    assert [v for _, v in stats["swaps"]] == [1, 2]
    # Requests in flight at each swap: rounds of both versions within one request.
    assert sum(1 for o in outs if {0, 1} <= set(o.versions)) >= 4
    assert any({1, 2} <= set(o.versions) for o in outs)
    by = stats["al_by_version"]
    print(kind, f"pipeline={pipeline}", {v: round(x["al"], 3) for v, x in by.items()}, by)
    assert set(by) == {0, 1, 2}
    # The trained drafter's drafts are accepted (its AL alone on these prompts is about 1.5
    # for eagle3; a request in flight at the swap keeps the drafter KV the noise wrote, so
    # its rounds after the swap accept less), the noise's about never.
    assert by[1]["al"] > 1.2
    assert by[1]["al"] > max(by[0]["al"], by[2]["al"]) + 0.15
    assert dec.drafter_version == 2


@pytest.mark.parametrize("kind", KINDS)
def test_bad_update_is_refused_and_leaves_the_drafter_untouched(kind_env, kind, tmp_path):
    env = kind_env(kind)
    drafter, _ = load_drafter(env["export"], env["target"].shared_weights())
    dec = SpecDecoder(env["target"], drafter, 3, max_batch=2, max_model_len=MAX_LEN)
    good = export_update(env["export"], 1)
    before = own_state(drafter)
    vocab_before = dec.proposer.draft_vocab_ids().clone()
    names = list(good.tensors)
    first_float = next(n for n in names if good.tensors[n].is_floating_point())
    last = names[-1]
    other_cfg = json.loads(json.dumps(good.config))
    other_cfg["max_position_embeddings"] = 2 * int(other_cfg["max_position_embeddings"])
    nan = dict(good.tensors)
    nan[last if good.tensors[last].is_floating_point() else first_float] = torch.full_like(
        good.tensors[last if good.tensors[last].is_floating_point() else first_float],
        float("nan"),
    )
    shape = dict(good.tensors)
    shape[first_float] = good.tensors[first_float][..., :-1]
    dtype = dict(good.tensors)
    dtype[first_float] = good.tensors[first_float].to(torch.int32)
    cases = {
        "unknown name": {**good.tensors, "not.a.weight": torch.zeros(3)},
        "missing name": {n: t for n, t in good.tensors.items() if n != last},
        "shape": shape,
        "dtype": dtype,
        "nan": nan,
    }
    for label, tensors in cases.items():
        with pytest.raises(SwapError) as e:
            dec.update_drafter(DrafterUpdate(1, tensors, good.config))
        msg = str(e.value)
        assert "\n" not in msg, label
        print(f"{kind} {label}: {msg}")
    with pytest.raises(SwapError, match="config"):
        dec.update_drafter(DrafterUpdate(1, good.tensors, other_cfg))
    with pytest.raises(SwapError, match="not above"):
        dec.update_drafter(DrafterUpdate(0, good.tensors, good.config))
    after = own_state(drafter)
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing half-copied
    assert torch.equal(dec.proposer.draft_vocab_ids(), vocab_before)
    assert dec.drafter_version == 0
    # The good update then goes in whole (outside generate: at once), in the runner's dtype.
    dec.update_drafter(good)
    ref, _ = load_drafter(env["export"], env["target"].shared_weights())
    now, want = own_state(drafter), own_state(ref)
    assert all(torch.equal(now[n], want[n]) for n in want)
    assert dec.drafter_version == 1
    assert spec_of(drafter).name == kind


def test_swap_refreshes_the_draft_vocabulary_map(kind_env):
    """eagle3 owns its draft vocabulary (`d2t`): a swap to weights with another map changes
    the proposer's draft-to-target ids in place (the tensor a captured round reads)."""
    env = kind_env("eagle3")
    drafter, _ = load_drafter(env["export"], env["target"].shared_weights())
    dec = SpecDecoder(env["target"], drafter, 3, max_batch=2, max_model_len=MAX_LEN)
    ids = dec.proposer.draft_vocab_ids()
    ptr = ids.data_ptr()
    update = export_update(env["export"], 1)
    d2t = update.tensors["d2t"]
    # Another valid map: the same target ids, two draft slots exchanged (offsets recomputed).
    targets = torch.arange(len(d2t)) + d2t
    targets[[0, 1]] = targets[[1, 0]]
    tensors = {**update.tensors, "d2t": (targets - torch.arange(len(d2t))).to(d2t.dtype)}
    dec.update_drafter(replace(update, tensors=tensors))
    assert dec.proposer.draft_vocab_ids().data_ptr() == ptr
    assert torch.equal(dec.proposer.draft_vocab_ids().cpu(), targets)


@pytest.mark.slow  # 4000 requests of the harness: 4-10 min on a busy 2-core CPU
def test_joint_distribution_across_a_swap(kind_env):
    """T = 1: the harness's three-token joint test on the zoo target (the setting of
    `test_trained_zoo_drafter_joint_distribution`: top-k 6, full-q verification, the held-out
    prompt whose answer starts spread), with a swap after every request's first round: version
    0 is the trained export, version 1 the same weights with the draft head scaled by 1.5, so
    the drafter state the first round wrote stays meaningful (drafts are still accepted) while
    the second round draws its drafts from another, sharper q. Still the target's
    distribution. (Second rounds accept little whatever the weights: a request asks for K + 2
    tokens, so its second round drafts only what the first left of that budget.)"""
    from draftinfer.files.loading import load_native_target
    from draftinfer.files.paths import resolve_path
    from tests.support.sampling_harness import (
        ALPHA,
        HarnessDecoder,
        enumerate_oracle,
        fits,
        power_to_detect,
    )

    kind, k, n = "eagle3", 3, 4000
    setting = SamplingParams(1.0, top_k=6)
    env = kind_env(kind)
    prompt = zoo_prompts(60, seed=0)[26]
    zoo_dir = str(resolve_path("zoo:llama-tiny"))
    oracle = enumerate_oracle(zoo_dir, prompt, setting)
    max_len = len(prompt) + k + 4
    target = load_native_target(zoo_dir, max_batch=n, max_seq_len=max_len)
    drafter, _ = load_drafter(env["export"], target.shared_weights())
    dec = HarnessDecoder(target, drafter, k, max_batch=n, max_model_len=max_len, verify="full")
    update = export_update(env["export"], 1)
    head = update.tensors["lm_head.weight"]
    update = replace(update, tensors={**update.tensors, "lm_head.weight": head * 1.5})
    calls = [0]

    def between_rounds(d):
        calls[0] += 1
        if calls[0] == 2:  # after the first round of every request
            d.update_drafter(update)

    params = [replace(setting, seed=7 * 10**6 + i) for i in range(n)]
    reqs = [Request(list(prompt), p, max_tokens=k + 2) for p in params]
    outs, stats = dec.generate(reqs, between_rounds=between_rounds)
    tokens = torch.tensor([o.token_ids[:3] for o in outs])
    by = stats["al_by_version"]
    print("joint across a swap:", by)
    assert set(by) == {0, 1} and by[1]["rounds"] > 0.2 * n  # second rounds ran on version 1
    assert by[0]["al"] > 1.3 and by[1]["al"] > 1.02  # drafts accepted on both sides of it
    for name, fit in fits(tokens, oracle).items():
        print(f"swap {kind} K={k} {name:9s} {fit}")
        assert fit.pvalue > ALPHA, (name, str(fit))
        if name != "joint_all":  # n = 4000 detects a 5-point shift (the harness: 3 at 11000)
            assert power_to_detect(n, fit.df, shift=0.05) >= 0.9, (name, str(fit))
