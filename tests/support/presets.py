"""Composing the training config tree the way `python -m drafttrain` does, for tests."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from drafttrain.__main__ import CONF_DIR, register_configs, to_train_config
from drafttrain.config import TrainConfig


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
