"""The runner as a user meets it: the fast path (compiled, graph-captured round) is the CUDA
default, the report's speedup is measured against the best plain decoding (the plain step
compiled, and graph-replayed, as the round is), and one target serves several drafters with its
serving transforms applied once."""

from __future__ import annotations

import pytest
import torch

from draftinfer.evaluation.config import InferConfig
from draftinfer.evaluation.run import resolve_fast_path, serving_transforms
from draftinfer.files.errors import ConfigError

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    "overrides, device, want",
    [
        ({}, CUDA, (True, True, "compiled")),
        ({}, CPU, (False, False, "eager")),
        ({"compile": False}, CUDA, (False, False, "eager")),  # the escape hatch
        ({"compile": True}, CPU, (True, False, "compiled")),
        ({"cuda_graphs": False}, CUDA, (True, False, "compiled")),
        ({"baseline": "eager"}, CUDA, (True, True, "eager")),  # by name
        ({"compile": False, "baseline": "compiled"}, CUDA, (False, False, "compiled")),
    ],
)
def test_the_fast_path_is_the_cuda_default(overrides, device, want):
    cfg = resolve_fast_path(InferConfig(drafter="d", **overrides), device)
    assert (cfg.compile, cfg.cuda_graphs, cfg.baseline) == want


def test_the_composed_default_leaves_the_fast_path_to_the_device():
    """`python -m draftinfer` with no speed flags: null in the config tree, so the device
    decides (what the test above resolves)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from draftinfer.__main__ import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="infer"))
    assert (cfg.compile, cfg.cuda_graphs, cfg.baseline) == (None, None, "auto")


def test_a_target_serving_two_drafters_is_transformed_once(tiny_llama3_dir, monkeypatch):
    """A sweep over drafters (or K) in one process reuses one transformed target: the
    transforms run on the target the first time only and on each drafter; the target records
    what it was served with, and asking it for other transforms is a one-line error."""
    import draftinfer.models.transforms as transforms
    from draftinfer.files.loading import load_native_target
    from tests.support.eagle3_small import small_drafter

    seen: list[int] = []
    fuse = transforms.fuse_projections
    monkeypatch.setattr(
        transforms, "fuse_projections", lambda m, **kw: (seen.append(id(m)), fuse(m, **kw))
    )
    target = load_native_target(tiny_llama3_dir, "cpu", torch.float32, 2, 32)
    drafters = [small_drafter(seed=0), small_drafter(seed=1)]
    cfg = InferConfig(drafter="d", fuse_projections=True, skinny_gemm=False)
    for d in drafters:
        serving_transforms(cfg, target, d, CPU)
    assert seen.count(id(target)) == 1
    assert [seen.count(id(d)) for d in drafters] == [1, 1]
    assert all(hasattr(layer.self_attn, "qkv_weight") for layer in target.model.layers)
    other = InferConfig(drafter="d", fuse_projections=False, skinny_gemm=False)
    with pytest.raises(ConfigError, match="already served with"):
        serving_transforms(other, target, small_drafter(seed=2), CPU)


def test_with_the_fast_path_the_plain_baseline_runs_the_compiled_step(kind_env, monkeypatch):
    """`compile=true` (the CUDA default; here on the CPU, dynamo tracing through the eager
    backend to keep it quick): the report's plain baseline decodes through `PlainStep`'s
    compiled step at every decode step, not the eager loop; the report names it, gives both
    mean times, and the speculative output is still lossless against it."""
    import draftinfer.decoding.compiled as compiled_mod
    from draftinfer.decoding.baseline import PlainStep
    from draftinfer.evaluation.run import run_eval

    real = torch.compile
    monkeypatch.setattr(
        compiled_mod.torch, "compile", lambda fn, **kw: real(fn, backend="eager", **kw)
    )
    calls, built = [], []
    init, call = PlainStep.__init__, PlainStep.__call__

    def spy_init(self, *a, **kw):
        init(self, *a, **kw)
        built.append(self)

    monkeypatch.setattr(PlainStep, "__init__", spy_init)
    monkeypatch.setattr(PlainStep, "__call__", lambda self, *a: calls.append(a) or call(self, *a))
    export = kind_env("eagle3")["export"]
    common = dict(
        drafter=export, num_prompts=4, max_new_tokens=12, batch_size=2, max_model_len=384,
        progress=False, plot="none", device="cpu",
    )  # fmt: skip
    report = run_eval(InferConfig(compile=True, **common))
    assert report.lossless and report.acceptance_length > 1.1
    assert (report.baseline, report.fast_path) == ("compiled", "compiled")
    [step] = built
    assert step.compile and step._fwd is not compiled_mod.target_forward  # the compiled one
    # Warm-up (one prompt) and the timed run (two groups of two prompts): one call per step.
    assert len(calls) >= 2 * (12 - 1) and all(len(c) == 4 for c in calls)
    assert report.t_plain_step_ms > 0 and report.t_round_ms > 0 and report.warmup_s > 0

    calls.clear()
    built.clear()
    eager = run_eval(InferConfig(compile=False, **common))
    assert (eager.baseline, eager.fast_path) == ("eager", "eager") and not built and not calls
    assert eager.lossless


def test_a_near_tie_is_measured_on_the_plain_side(tiny_llama3_dir):
    """Below fp32 the report forgives a first mismatch only where the plain side's top-2
    margin is under `NEAR_TIE`: the margin is the target's own, for the token after the
    common prefix (teacher-forced here the same way)."""
    from draftinfer.conventions.slots import Slots
    from draftinfer.evaluation.prompts import Prompt
    from draftinfer.evaluation.run import top2_margin
    from draftinfer.files.loading import load_native_target

    target = load_native_target(tiny_llama3_dir, "cpu", torch.float32, 2, 64)
    prompt, tokens = Prompt([5, 9, 11, 40]), [7, 3]
    ids = torch.tensor([prompt.ids + tokens])
    pos = torch.arange(ids.shape[1])[None]
    logits = target(ids, Slots(torch.tensor([1]), pos)).logits[0, -1]
    want = logits.topk(2).values
    assert top2_margin(target, prompt, tokens) == pytest.approx(float(want[0] - want[1]), abs=1e-5)
