"""Composing the training config tree the way `python -m drafttrain` does, for tests; the CPU
presets and the shortened recipes their golden values pin."""

from __future__ import annotations

import functools
from pathlib import Path

from hydra import compose, initialize_config_dir

from drafttrain.__main__ import CONF_DIR, register_configs, to_train_config
from drafttrain.jobs.config import TrainConfig


def compose_preset(name: str, overrides: list[str] | None = None) -> TrainConfig:
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_train_config(compose(config_name=name, overrides=overrides or []))


def small_overrides(env: dict[str, str], out: Path, steps: int = 30) -> list[str]:
    return [
        f"target.name_or_path={env['target']}",
        f"data.path={env['data']}",
        f"output_dir={out}",
        f"trainer.max_steps={steps}",
        "trainer.save_every=4",
        "trainer.log_every=2",
        "trainer.warmup_steps=3",
        "trainer.lr=3e-3",
        "trainer.progress=false",
        "data.batch_size=4",
        "drafter.draft_vocab_size=64",
        "drafter.ttt_steps=3",
        "export.verify=false",
    ]


@functools.lru_cache(maxsize=1)
def cpu_presets() -> dict[str, TrainConfig]:
    """Every documented preset that trains offline on this CPU machine (its target is a zoo
    target), composed: {name: config}."""
    import yaml

    out = {}
    for path in sorted(Path(CONF_DIR).glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        if "preset" not in raw:  # base.yaml, regenerate.yaml
            continue
        if (raw.get("online") or {}).get("drift"):  # online_drift: not a train -> export job
            continue
        cfg = compose_preset(path.stem)
        # A second-stage preset (`trainer.init_from`: OPD after SFT) starts from another
        # preset's output; its tests chain it after that stage (tests/train/test_opd.py).
        if cfg.trainer.init_from is not None:
            continue
        if cfg.target.name_or_path.startswith("zoo:"):
            out[path.stem] = cfg
    return out


def text_preset_of(kind: str) -> str | None:
    """The CPU preset training `kind` against the text zoo target (its zoo recipe is that
    preset, shortened), or None."""
    for name, cfg in cpu_presets().items():
        if cfg.drafter.kind == kind and cfg.target.name_or_path == "zoo:llama-tiny":
            return name
    return None


# The shortened, deterministic recipe of a CPU preset that no kind's zoo recipe covers (the
# Qwen3-VL ones): the preset's own config with 120 steps (warm-up 10), its held-out evaluation
# and runner check on fewer prompts. A full preset is 600 to 1500 steps (5 to 20 min on two
# idle cores); its measured numbers are in docs/training.md.
SHORT_RECIPE = [
    "trainer.max_steps=120",  # `short_recipe(name)`: fewer for the presets in SHORT_STEPS
    "trainer.warmup_steps=10",
    "trainer.progress=false",
    "trainer.save_every=0",
    "trainer.log_every=10",
    "data.eval_batches=4",
    "export.verify_prompts=16",
    "export.verify_max_new_tokens=32",
]

# Presets whose shortened recipe stops earlier: the MoE zoo targets' steps cost two to three
# times a dense one on the CPU (their 120-step recipes took 68-143 s of CI's 27 min, with AL
# 1.9-3.0, far above the goldens' floor of 1.3), so 60 steps pin them.
SHORT_STEPS = {
    "eagle3_gpt_oss": 60,
    "ptd_gpt_oss": 60,
    "dflash_gpt_oss": 60,
    "eagle3_qwen3_moe": 60,
    "eagle3_deepseek": 60,
    "mtp_deepseek": 60,
    "mtp_glm4_moe": 60,
}


def short_recipe(name: str) -> list[str]:
    """`SHORT_RECIPE` for preset `name`, its step count from `SHORT_STEPS` where listed."""
    steps = SHORT_STEPS.get(name)
    if steps is None:
        return list(SHORT_RECIPE)
    return [f"trainer.max_steps={steps}", *SHORT_RECIPE[1:]]
