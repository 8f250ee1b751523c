"""Training on what the runner emits (`SpecDecoder(emit_features=True)` ->
`drafttrain.cache.emitted.write_emitted` -> `data.emitted`): the runner's features of the
sequences it decoded, head input included, equal the live frozen target's over the same
sequences, and training steps on them give the live target's per-step losses, with no target
forward in training.

Tolerance: the runner's native target and the training target (HF) are both fp32 on the CPU
and differ only by their kernels' summation order, so the features agree to 1e-4 and each
step's loss to 1e-4 relative (measured below, printed on failure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.files.paths import resolve_path
from drafttrain.cache.emitted import EmittedSample, write_emitted
from drafttrain.frozen.target import FrozenTarget
from drafttrain.jobs.errors import ConfigError
from drafttrain.jobs.train import train
from tests.support.kind_factories import drafter_for
from tests.support.no_target import forbid_target_forward
from tests.support.presets import compose_preset
from tests.support.prompts import zoo_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

KIND = ["drafter.ttt_steps=2", "drafter.draft_vocab_size=256"]


def cfg_for(out: Path, emitted: Path, *extra: str):
    return compose_preset(
        "eagle3",
        [
            "data.max_samples=24",
            "data.batch_size=4",
            "data.eval_split=null",
            "trainer.max_steps=3",
            "trainer.warmup_steps=1",
            "trainer.progress=false",
            "trainer.save_every=0",
            "trainer.log_every=1",
            "export.enabled=false",
            "eval.walk=false",
            f"data.emitted={emitted}",
            f"output_dir={out}",
            *KIND,
            *extra,
        ],
    )


@torch.no_grad()
def live_features(target: FrozenTarget, tokens: list[int], spec) -> torch.Tensor:
    ids = torch.tensor([tokens])
    slots = Slots(torch.tensor([0]), torch.arange(len(tokens))[None])
    return target.forward(ids, slots, spec).features[0]


def test_training_on_emitted_features_equals_live_target(tmp_path, zoo_target, monkeypatch):
    cfg = cfg_for(tmp_path / "probe", tmp_path / "none")
    name = cfg.target.name_or_path
    runner_drafter = drafter_for("eagle3", resolve_path(name))
    spec = runner_drafter.config.features
    H = zoo_target.info.hidden_size
    prompts = zoo_prompts(8, seed=3)
    eos = tuple(zoo_target.config.eos_token_ids)
    dec = SpecDecoder(
        zoo_target, runner_drafter, 3, max_batch=4, max_model_len=384, emit_features=True
    )
    assert dec.emit_spec == spec.with_head_input() != spec  # eagle3: + the pre-norm head input
    outs, _ = dec.generate([Request(p, max_tokens=24, stop_token_ids=eos) for p in prompts])
    emitted = [EmittedSample.of(p, o) for p, o in zip(prompts, outs)]

    # The same sequences through the live training target, written the same way.
    live = FrozenTarget(cfg.target, torch.device("cpu"))
    assert live.info.hidden_size == H
    worst = 0.0
    ref = []
    for s in emitted:
        f = live_features(live, s.tokens[:-1], spec.with_head_input())
        worst = max(worst, float((f - s.features).abs().max()))
        ref.append(EmittedSample(s.tokens, s.prompt_len, f))
    assert worst < 1e-4, worst
    write_emitted(tmp_path / "runner", emitted, spec, H, name)
    write_emitted(tmp_path / "live", ref, spec, H, name)

    forbid_target_forward(monkeypatch)  # training runs no target forward from here
    a = train(cfg_for(tmp_path / "a", tmp_path / "runner"))
    b = train(cfg_for(tmp_path / "b", tmp_path / "live"))
    assert len(a["losses"]) == 3
    diff = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"], strict=True))
    print(f"feature max |diff| {worst:.3g}; per-step loss rel diff {diff:.3g}; {a['losses']}")
    assert diff < 1e-4, (a["losses"], b["losses"])
    assert a["losses"][-1] != a["losses"][0]  # the drafter did train


def test_emitted_samples_are_checked(tmp_path, zoo_target):
    cfg = cfg_for(tmp_path / "x", tmp_path / "e")
    spec = drafter_for("eagle3", resolve_path(cfg.target.name_or_path)).config.features
    H = zoo_target.info.hidden_size
    bad = EmittedSample([1, 2, 3], 1, torch.zeros(2, spec.width(H)))  # no head input
    with pytest.raises(Exception, match="expected"):
        write_emitted(tmp_path / "e", [bad], spec, H, cfg.target.name_or_path)
    ok = EmittedSample([1, 2, 3], 1, torch.zeros(2, spec.with_head_input().width(H)))
    write_emitted(tmp_path / "e", [ok], spec, H, "some/other-target")
    with pytest.raises(ConfigError, match="was decoded by target"):
        train(cfg)
    with pytest.raises(ConfigError, match="read it with data.emitted"):
        train(
            cfg_for(
                tmp_path / "y", tmp_path / "e", "data.emitted=null", f"data.cache={tmp_path / 'e'}"
            )
        )
