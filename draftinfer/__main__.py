"""`python -m draftinfer drafter=DIR [target=...] [prompts=...] [k=3] [temperature=0]
[batch_size=8] [report=FILE.json] [eval=greedy|sampling] ...`
`python -m draftinfer drafter=DIR eval=<suite>|standard [eval.path=LOCAL] [temperatures=[0,1]]`

`prompts` is chat data in the `messages` format (or a .txt file); for a target with a
processor (Qwen3-VL) its messages may hold image parts (`draftinfer.evaluation.prompts`).

Thin entry point: compose `conf/draftinfer/infer.yaml` (package data; + the `eval/` group)
against `draftinfer.evaluation.config.InferConfig`, convert once, run `run_eval` (the held-out prompts) or
`run_suites` (acceptance suites, `draftinfer.evaluation.suite_run`), print the table.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from draftinfer.evaluation.config import InferConfig
from draftinfer.files.errors import ConfigError, run_or_exit
from draftinfer.files.paths import conf_dir

CONF_DIR = str(conf_dir("draftinfer"))


def register_configs() -> None:
    ConfigStore.instance().store(name="infer_schema", node=InferConfig)


@hydra.main(config_path=CONF_DIR, config_name="infer", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    icfg: InferConfig = OmegaConf.to_object(cfg)
    if icfg.eval.suites:  # acceptance suites (eval=<suite>|standard)
        from draftinfer.evaluation.suite_report import format_suites_table
        from draftinfer.evaluation.suite_run import run_suites

        suites = run_or_exit(run_suites, icfg)
        print(format_suites_table(suites))
        if not suites.lossless:
            sys.exit(3)
        return
    from draftinfer.evaluation.run import format_report, run_eval

    if icfg.temperatures is not None:
        run_or_exit(
            _refuse,
            "temperatures=[...] is for acceptance suites (eval=<suite>); "
            "the held-out run takes temperature=",
        )
    report = run_or_exit(run_eval, icfg)
    from draftinfer.evaluation.ranks import is_writer, leave_ranks

    if is_writer():  # tp > 1: rank 0 prints, as it writes the report
        print(format_report(report))
    leave_ranks()
    if not report.lossless:
        sys.exit(3)


def _refuse(message: str) -> None:
    raise ConfigError(message)


def main() -> None:
    register_configs()
    argv = [a for a in sys.argv[1:] if not a.startswith(("--local_rank", "--local-rank"))]
    sys.argv = [sys.argv[0], *argv]
    _hydra_main()


if __name__ == "__main__":
    main()
