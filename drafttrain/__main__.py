"""`python -m drafttrain conf=<preset> key=value ...`

A thin entry point (STYLE rule 9): rewrite argv (`conf=X` -> Hydra's `--config-name X`, drop
a launcher's `--local_rank`), compose the config tree `conf/drafttrain/` (package data) against
the dataclass schema of `drafttrain.jobs.config` (each registered kind's config under
`drafter/<kind>_schema`), convert once, and call `run_job(cfg)` (train -> export -> verify).
Hydra's own flags work: `--cfg job` prints the resolved config, `--help` lists the groups.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from draftinfer.evaluation.threads import resolve_cli_threads
from draftinfer.files.errors import DraftError, run_or_exit
from draftinfer.files.paths import conf_dir
from drafttrain.jobs.config import TrainConfig, check_train_config
from drafttrain.registry import load_train_kinds

CONF_DIR = str(conf_dir("drafttrain"))
DEFAULT_PRESET = "ptd_eagle3"


def rewrite_argv(argv: list[str]) -> list[str]:
    """`conf=X` -> `--config-name=X`; drop `--local_rank N` / `--local_rank=N` (launchers)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.startswith("conf="):
            out.append("--config-name=" + a[len("conf=") :])
        elif a in ("--local_rank", "--local-rank"):
            skip = True
        elif a.startswith(("--local_rank=", "--local-rank=")):
            continue
        else:
            out.append(a)
    return out


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for kind, spec in load_train_kinds().items():
        cs.store(group="drafter", name=f"{kind}_schema", node=spec.config_class)


def presets() -> list[str]:
    """The training presets: the top-level files of `conf/drafttrain/` that build on `base`."""
    import yaml

    names = []
    for path in sorted(Path(CONF_DIR).glob("*.yaml")):
        defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults") or []
        if "base" in defaults:
            names.append(path.stem)
    return names


def check_preset(name: str) -> None:
    """A one-line error naming the presets there are, for a `conf=` that names none (Hydra's
    own error lists its search path instead)."""
    if name not in presets() and not Path(CONF_DIR, f"{name}.yaml").is_file():
        raise DraftError(f"unknown preset conf={name!r} (presets: {', '.join(presets())})")


def precheck(argv: list[str]) -> None:
    """The preset and every value of the composed config checked before Hydra runs the job:
    Hydra writes `.hydra/` into `output_dir` before the job starts, so a value a run cannot use
    is refused here, with nothing written. Hydra's own flags (`--cfg`, `--help`, `-m`, ...) and
    composition errors (a misspelled key) are left to Hydra, which reports them itself."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    name, overrides = DEFAULT_PRESET, []
    for a in argv:
        if a.startswith("--config-name="):
            name = a.split("=", 1)[1]
        elif a.startswith("-"):
            return
        elif not a.lstrip("+~").startswith("hydra."):
            overrides.append(a)
    check_preset(name)
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            composed = compose(config_name=name, overrides=overrides)
    except (HydraException, OmegaConfBaseException):
        return
    cfg = check_train_config(to_train_config(composed))
    if cfg.trainer.init_from is not None and not cfg.resume:
        from drafttrain.trainer.checkpoint import init_checkpoint

        init_checkpoint(cfg.trainer.init_from)  # e.g. conf=eagle3_opd before conf=eagle3


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The one omegaconf -> dataclass conversion."""
    obj = OmegaConf.to_object(cfg)
    if isinstance(obj, dict):  # composed without the schema: refuse rather than guess
        raise DraftError("config was not composed against the train_schema")
    return obj


@hydra.main(config_path=CONF_DIR, config_name=DEFAULT_PRESET, version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from drafttrain.jobs.job import run_job

    config = to_train_config(cfg)
    config.trainer.num_threads = resolve_cli_threads(config.trainer.num_threads, "trainer")
    summary = run_or_exit(run_job, config)
    if summary.get("main_process", True):
        print(summary.get("export_dir") or summary["run_dir"])


def cli(hydra_main) -> None:
    """Run a Hydra entry point over the training config tree (this one, `drafttrain.cache`,
    `drafttrain.sources.rows`): the schema registered, argv rewritten, the composed config
    checked (`precheck`: a bad value is one line, nothing written), then Hydra."""
    register_configs()
    argv = rewrite_argv(sys.argv[1:])
    run_or_exit(precheck, argv)
    sys.argv = [sys.argv[0], *argv]
    hydra_main()


def main() -> None:
    cli(_hydra_main)


if __name__ == "__main__":
    main()
