"""The runner's real AL during training (`eval.every_n_steps`, `drafttrain.jobs.runner_eval`):
the in-memory snapshot is the export (tensor for tensor, every kind); the hook logs runner AL
beside the simulated AL without changing training; its AL equals the runner's on the exported
files; the simulated AL at K is DraftLoss's; bad settings fail before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftinfer.files.checkpoint import load_drafter, snapshot_drafter, write_drafter
from draftinfer.files.paths import resolve_path
from draftinfer.registry import registered_kinds
from drafttrain.jobs.errors import ConfigError
from drafttrain.jobs.job import run_job
from drafttrain.jobs.runner_eval import read_runner_eval, simulated_acceptance
from drafttrain.jobs.train import train
from drafttrain.objectives.losses import DraftLoss
from drafttrain.trainer.loggers import read_metrics
from tests.support.presets import compose_preset
from tests.support.tiny_models import tiny_recipe, untrained_drafter


@pytest.mark.parametrize("kind", registered_kinds())
def test_snapshot_is_the_export_loaded_back(kind, zoo_target, tmp_path):
    """`snapshot_drafter` (no files) == `write_drafter` + `load_drafter` (files), exactly."""
    d = untrained_drafter(kind, resolve_path("zoo:llama-tiny"), zoo_target)
    with torch.no_grad():  # random non-zero everywhere (an init may leave zeros or ones)
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    meta = {"target": "zoo:llama-tiny", "serving_k": 3}
    write_drafter(tmp_path, d, meta, torch.bfloat16)
    shared = zoo_target.shared_weights()
    disk, _ = load_drafter(tmp_path, shared)
    mem = snapshot_drafter(d, meta, shared, "cpu", torch.float32, torch.bfloat16)
    a, b = disk.state_dict(), mem.state_dict()
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert type(disk) is type(mem) and disk.config == mem.config
    # The export's rounding happened (bf16), so this is not the training module itself.
    assert any(not torch.equal(p, d.state_dict()[n]) for n, p in b.items() if n in d.state_dict())


def test_simulated_al_at_k_is_draftloss_sim_al():
    loss = DraftLoss(torch.device("cpu"))
    hits = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]]  # per position: 3/4, 2/4, 1/4
    for k, h in enumerate(hits):
        h = torch.tensor(h, dtype=torch.bool)
        loss.add(k, torch.ones(4, requires_grad=True), h, torch.ones(4, dtype=torch.bool), 1.0)
    _, m = loss.result(torch.ones(4))
    accs = [float(m[f"acc_{k}"]) for k in range(3)]
    al, pos = simulated_acceptance(accs, 3)
    assert al == pytest.approx(float(m["sim_al"]))
    assert pos == pytest.approx([0.75, 0.75 * 0.5, 0.75 * 0.5 * 0.25])
    assert simulated_acceptance(accs, 1)[0] == pytest.approx(1.75)  # cut at the runner's K


def _hooked_job(train_env, out: Path, *extra: str) -> dict:
    args = [a for a in tiny_recipe("eagle3", train_env, out, 8, *extra)]
    cfg = compose_preset("eagle3", args)
    cfg.trainer.num_threads = 1  # deterministic CPU reductions for the comparison
    return run_job(cfg)


def test_runner_al_is_logged_and_training_is_unchanged(train_env, tmp_path):
    """Runner AL every 3 steps (and at the last) next to the simulated AL, in metrics.jsonl
    (and so in wandb: the same `log` call) and the summary; the card states the final gap and
    the time share; the losses equal a run without the hook."""
    extra = ["trainer.log_every=2", "eval.every_n_steps=3", "eval.num_prompts=4"]
    extra += ["eval.max_new_tokens=12", "eval.k=2", "eval.batch_size=4"]
    with_hook = _hooked_job(train_env, tmp_path / "a", *extra)
    without = _hooked_job(train_env, tmp_path / "b", "trainer.log_every=2")
    assert with_hook["losses"] == without["losses"]  # the hook draws no training randomness
    rows = [r for r in read_metrics(tmp_path / "a") if "runner_al" in r]
    assert [r["step"] for r in rows] == [3, 6, 8]
    for r in rows:
        assert 1.0 <= r["runner_al"] <= 3.0 and r["runner_lossless"] == 1.0
        assert {"runner_al_macro", "runner_pos_1", "runner_pos_2", "runner_sim_al"} <= set(r)
        assert r["runner_al_gap"] == pytest.approx(r["runner_sim_al"] - r["runner_al"])
        assert r["runner_seconds"] > 0
    # (No acceptance floor here: on this random tiny target the runner's AL stays 1.0 while
    # the simulated one climbs, in memory and on the exported files alike; the zoo test below
    # asserts acceptance and equality with the export.)
    ev = with_hook["runner_eval"]
    assert ev == read_runner_eval(tmp_path / "a")
    assert ev["calls"] == 3 and ev["k"] == 2 and ev["prompts"] == 4
    assert 0 < ev["share"] < 1 and ev["seconds"] < ev["loop_seconds"]
    assert ev["last"]["runner_al"] == rows[-1]["runner_al"]
    assert ev["sim_source"] == "last training window"  # the tiny recipe has no eval split
    assert ev["sim_al"] == rows[-1]["runner_sim_al"]
    assert ev["gap"] == pytest.approx(ev["sim_al"] - ev["last"]["runner_al"])
    card = (Path(with_hook["export_dir"]) / "README.md").read_text()
    assert f"was {ev['sim_al']:.3f}; the runner during training" in card
    assert f"{ev['gap']:+.3f} apart" in card and f"{100 * ev['share']:.1f}%" in card
    assert "runner during training" not in (Path(without["export_dir"]) / "README.md").read_text()


def test_bad_runner_eval_settings_fail_before_anything_is_written(train_env, tmp_path):
    for bad, needle in (
        ("eval.suite=nope", "unknown suite 'nope'"),
        ("eval.num_prompts=0", "eval.num_prompts"),
    ):
        out = tmp_path / bad.split("=")[0]
        cfg = compose_preset(
            "eagle3", tiny_recipe("eagle3", train_env, out, 4, "eval.every_n_steps=2", bad)
        )
        with pytest.raises(ConfigError) as e:
            train(cfg)
        assert needle in str(e.value) and "\n" not in str(e.value)
        assert not out.exists()


@pytest.mark.slow
def test_runner_al_in_training_equals_the_runner_on_the_export(zoo_run):
    """On the zoo recipe's EAGLE-3 run: the hook, given the last checkpoint's own state (what
    the training loop hands it), measures exactly the AL `python -m draftinfer` measured on
    the exported files (same prompts, K and tokens), and the drafter clearly accepts drafts."""
    from draftinfer.registry import drafter_spec
    from drafttrain.jobs.config import load_train_config
    from drafttrain.jobs.runner_eval import RunnerEval
    from drafttrain.trainer.checkpoint import latest_checkpoint, load_checkpoint

    summary = zoo_run("eagle3")
    run = Path(summary["run_dir"])
    cfg = load_train_config(run / "training_args.yaml")
    e = cfg.export
    cfg.eval.num_prompts, cfg.eval.max_new_tokens = e.verify_prompts, e.verify_max_new_tokens
    cfg.eval.k, cfg.eval.batch_size, cfg.eval.every_n_steps = e.verify_k, e.verify_batch_size, 1
    ck = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    kind = ck["state"]["drafter_kind"]
    arch = drafter_spec(kind).config_class(**ck["state"]["drafter_config"])
    hook = RunnerEval(cfg, torch.device("cpu"))
    m = hook(ck["state"]["step"], kind, arch, ck["drafter"], {})
    rep = summary["runner"]
    assert rep.lossless and m["runner_lossless"] == 1.0
    assert m["runner_al"] == rep.acceptance_length
    assert [m[f"runner_pos_{j}"] for j in (1, 2, 3)] == rep.per_position_acceptance
    assert rep.acceptance_length > 1.3
