"""The MoE target families through the runner: every kind that pairs with `gpt_oss` and
`qwen3_moe` (`kinds_for_family`; mtp is refused in one line, `tests/contracts/
test_kind_family_pairs.py`) drafts losslessly on the shipped trained MoE zoo targets, with a
drafter that accepts.

Drafters: the CPU preset of the (family, kind) pair where there is one (`preset_run`, the
golden-checked short recipe of `tests/jobs/test_preset_golden.py`), else the same short recipe
of the text preset of the kind pointed at the family's zoo target (`moe_pair_run` below):
trained once per session and shared with the preset tests (`PAIRS`: every kind on gpt-oss,
eagle3 on Qwen3-MoE). On the native MoE target (sinks,
alternating windows that the prompts cross, routed experts): T1 (greedy speculative output ==
plain greedy output) at K = 1 and 3, batch 1 and 4 with mixed prompt lengths, continuous
batching over more prompts than rows, and an AL floor (drafts were accepted).
"""

from __future__ import annotations

import pytest
import torch

from draftinfer.conventions.metrics import acceptance_length
from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.files.checkpoint import load_drafter
from draftinfer.files.loading import load_native_target
from draftinfer.files.paths import resolve_path
from tests.support.kind_factories import kinds_for_family
from tests.support.presets import cpu_presets
from tests.support.prompts import zoo_prompts

ZOO = {"gpt_oss": "zoo:gpt-oss-tiny", "qwen3_moe": "zoo:qwen3-moe-tiny"}
# Every kind on gpt-oss; on Qwen3-MoE the kind of its preset (eagle3): the other kinds' pairs
# with it are in the kind x family catalogue (`tests/contracts/test_kind_family_pairs.py`),
# and training a drafter for each here took 91 s of CI.
PAIRS = [(f, k) for f in ZOO for k in kinds_for_family(f) if f == "gpt_oss" or k == "eagle3"]
MAX_LEN = 384


def _preset_of(target: str, kind: str) -> str | None:
    for name, cfg in cpu_presets().items():
        if cfg.drafter.kind == kind and cfg.target.name_or_path == target:
            return name
    return None


@pytest.fixture(scope="module")
def targets():
    return {
        f: load_native_target(resolve_path(z), "cpu", torch.float32, 4, MAX_LEN)
        for f, z in ZOO.items()
    }


@pytest.fixture(scope="module")
def moe_pair_run(preset_run, tmp_path_factory):
    """`moe_pair_run(family, kind)` -> the job summary of a drafter of `kind` trained against
    the family's zoo target: its CPU preset's short recipe, or (no such preset) the kind's
    text preset pointed at that target with the same recipe."""
    from functools import partial

    from drafttrain.jobs.job import run_job
    from tests.support.presets import SHORT_RECIPE, compose_preset, text_preset_of
    from tests.support.shared_runs import shared_run

    def build(family: str, kind: str, out) -> dict:
        from draftinfer.evaluation.threads import torch_threads

        preset = text_preset_of(kind) or "eagle3"
        overrides = [f"target.name_or_path={ZOO[family]}", f"output_dir={out}", *SHORT_RECIPE]
        if text_preset_of(kind) is None:
            overrides.insert(0, f"drafter={kind}")
        with torch_threads(1):
            return run_job(compose_preset(preset, overrides))

    def get(family: str, kind: str) -> dict:
        preset = _preset_of(ZOO[family], kind)
        if preset is not None:
            return preset_run(preset)
        return shared_run(tmp_path_factory, f"moe_{family}_{kind}", partial(build, family, kind))

    return get


def test_every_kind_but_mtp_pairs_with_the_moe_families():
    for family in ZOO:
        assert "mtp" not in kinds_for_family(family)
        assert {"eagle3", "ptd", "dflash"} <= set(kinds_for_family(family))


@pytest.mark.slow  # trains a drafter per pair (shared with the preset goldens)
@pytest.mark.parametrize("family, kind", PAIRS)
def test_t1_lossless_greedy_on_the_moe_zoo_target(moe_pair_run, targets, family, kind):
    summary = moe_pair_run(family, kind)
    target = targets[family]
    drafter, _ = load_drafter(summary["export_dir"], target.shared_weights())
    eos = list(target.config.eos_token_ids)
    prompts = zoo_prompts(6, seed=11, target=ZOO[family])
    plain = greedy_generate(target, prompts, 40, eos)
    window = getattr(target.model.layers[0].self_attn, "window", None)
    if window is not None:  # the prompts cross the window layers' window
        assert max(len(p) for p in prompts) > window
    accepted = []
    for k, batch in ((1, 1), (3, 4)):
        dec = SpecDecoder(target, drafter, k, max_batch=batch, max_model_len=MAX_LEN)
        outs, _ = dec.generate(
            [Request(p, max_tokens=40, stop_token_ids=tuple(eos)) for p in prompts]
        )
        assert [o.token_ids for o in outs] == plain, (family, kind, k, batch)
        if k == 3:
            accepted = [a for o in outs for a in o.accepted]
    al = acceptance_length(accepted)
    print(f"{family} {kind}: AL {al:.3f} at K=3")
    assert al > 1.15, (family, kind, al)  # the trained drafter's drafts are accepted
