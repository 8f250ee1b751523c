"""`python -m draftinfer drafter=DIR [target=...] [prompts=...] [k=3] [temperature=0]
[batch_size=8] [report=FILE.json] [eval=greedy|sampling] ...`

`prompts` is chat data in the `messages` format (or a .txt file); for a target with a
processor (Qwen3-VL) its messages may hold image parts (`draftinfer.prompts`).

Thin entry point: compose `draftinfer/conf/infer.yaml` (package data; + the `eval/` group)
against `draftinfer.config.InferConfig`, convert once, run `run_eval`, print the table.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from draftinfer.config import InferConfig
from draftinfer.errors import run_or_exit
from draftinfer.paths import package_dir

CONF_DIR = str(package_dir("draftinfer", "conf"))


def register_configs() -> None:
    ConfigStore.instance().store(name="infer_schema", node=InferConfig)


@hydra.main(config_path=CONF_DIR, config_name="infer", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from draftinfer.run import format_report, run_eval

    report = run_or_exit(run_eval, OmegaConf.to_object(cfg))
    print(format_report(report))
    if not report.lossless:
        sys.exit(3)


def main() -> None:
    register_configs()
    argv = [a for a in sys.argv[1:] if not a.startswith(("--local_rank", "--local-rank"))]
    sys.argv = [sys.argv[0], *argv]
    _hydra_main()


if __name__ == "__main__":
    main()
