"""`python -m drafttrain.cache conf=<preset> key=value ...`: write the offline feature cache
of a training config (the same presets and overrides as `python -m drafttrain`) into
`cache.dir` (default `<output_dir>/feature_cache`), then print where it is and its bytes per
token: the exact per-token size of the stored tensors, and the measured shard bytes / tokens.
Train from it with `python -m drafttrain conf=<preset> ... data.cache=<dir>`.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftinfer.evaluation.threads import resolve_cli_threads
from draftinfer.files.errors import run_or_exit
from drafttrain.__main__ import (
    CONF_DIR,
    DEFAULT_PRESET,
    cli,
    to_train_config,
)


def format_summary(summary: dict) -> str:
    lay, bpt = summary["layout"], summary["bytes_per_token"]
    lines = [
        f"feature cache: {summary['dir']}",
        f"  segments ({lay['dtype']}, H={lay['hidden_size']}): {', '.join(lay['segments'])}",
        "  bytes/token (stored tensors): "
        + ", ".join(f"{k} {v}" for k, v in bpt.items() if k != "total")
        + f" = {bpt['total']}",
    ]
    for split, s in summary["splits"].items():
        per = s["bytes"] / max(s["tokens"], 1)
        lines.append(
            f"  {split}: {s['samples']} samples, {s['tokens']} tokens, {s['shards']} shards, "
            f"{s['bytes']} bytes = {per:.1f} bytes/token measured"
        )
    return "\n".join(lines)


@hydra.main(config_path=CONF_DIR, config_name=DEFAULT_PRESET, version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from drafttrain.cache.writer import write_cache

    config = to_train_config(cfg)
    config.trainer.num_threads = resolve_cli_threads(config.trainer.num_threads, "trainer")
    summary = run_or_exit(write_cache, config)
    print(format_summary(summary))


def main() -> None:
    cli(_hydra_main)


if __name__ == "__main__":
    main()
