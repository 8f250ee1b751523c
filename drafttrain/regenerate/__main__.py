"""`python -m drafttrain.regenerate [target=...] [data=...] [regenerate.KEY=VALUE ...]`

Thin entry point (STYLE rule 9): compose `conf/drafttrain/regenerate.yaml` (the `target/`
and `data/` groups of training plus a `regenerate:` section) against `RegenConfig`, convert once, call
`regenerate(cfg)`, print the summary. Errors are one line (`error: ...`, exit 2). Hydra's
own flags work (`--cfg job`, `--help`); Hydra writes no files of its own here.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from draftinfer.evaluation.threads import resolve_cli_threads
from draftinfer.files.errors import DraftError, run_or_exit
from draftinfer.files.paths import conf_dir
from drafttrain.regenerate.config import RegenConfig

CONF_DIR = str(conf_dir("drafttrain"))
CONFIG_NAME = "regenerate"


def register_configs() -> None:
    ConfigStore.instance().store(name="regenerate_schema", node=RegenConfig)


def to_regen_config(cfg: DictConfig) -> RegenConfig:
    """The one omegaconf -> dataclass conversion."""
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, RegenConfig):  # composed without the schema: refuse to guess
        raise DraftError("config was not composed against the regenerate_schema")
    return obj


@hydra.main(config_path=CONF_DIR, config_name=CONFIG_NAME, version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from drafttrain.regenerate.job import format_summary, regenerate

    config = to_regen_config(cfg)
    r = config.regenerate
    r.num_threads = resolve_cli_threads(r.num_threads, "regenerate")
    summary = run_or_exit(regenerate, config)
    print(format_summary(summary))


def main() -> None:
    register_configs()
    argv = [a for a in sys.argv[1:] if not a.startswith(("--local_rank", "--local-rank"))]
    sys.argv = [sys.argv[0], *argv]
    _hydra_main()


if __name__ == "__main__":
    main()
