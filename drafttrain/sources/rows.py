"""`python -m drafttrain.sources.rows conf=<preset> [overrides]`: the rows an engine must extract
hidden states for, as the producer reads them.

Training from an engine's hidden states (`data.hidden_states.path`, `drafttrain.sources.engine`)
reads `hs_<i>.safetensors` for row `i` of *its own* tokenized training split (the chat template,
loss masks and `data.max_length` of this config), and refuses a file whose `token_ids` are not
that row's tokens. So the producer must send exactly these rows: this writes them to
`data.hidden_states.rows` (default `<output_dir>/engine_rows`) as a `datasets` directory in the
layout speculators' preprocessed data has (`input_ids`, `loss_mask`, `seq_len`; torch format, so
`speculators generate-offline-data --preprocessed-data DIR` sends `input_ids` of row i and names
the file `hs_<i>.safetensors`: `speculators/cli/generate_offline_data.py`, 0.9.0).
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from draftinfer.files.errors import run_or_exit
from drafttrain.__main__ import (
    CONF_DIR,
    DEFAULT_PRESET,
    cli,
    to_train_config,
)


def rows_dir(cfg) -> Path:
    r = cfg.data.hidden_states.rows
    return Path(r) if r else Path(cfg.output_dir) / "engine_rows"


def write_rows(cfg) -> dict:
    """Tokenize `cfg`'s training split as training does and save it for the producer."""
    from datasets import Dataset

    from drafttrain.jobs.setup import check_feature_cache, prepare_data, setup_target

    ts = setup_target(cfg.target)
    check_feature_cache(ts.family, cfg.target.name_or_path)
    data = prepare_data(cfg, ts.family.data(cfg.target.name_or_path, ts.tokenizer)).data
    ids = [list(r) for r in data["input_ids"]]
    out = Dataset.from_dict(
        {
            "input_ids": ids,
            "loss_mask": [list(m) for m in data["loss_mask"]],
            "seq_len": [len(r) for r in ids],
        }
    ).with_format("torch")
    root = rows_dir(cfg)
    out.save_to_disk(str(root))
    return {"dir": str(root), "rows": len(ids), "tokens": sum(len(r) for r in ids)}


@hydra.main(config_path=CONF_DIR, config_name=DEFAULT_PRESET, version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    s = run_or_exit(write_rows, to_train_config(cfg))
    print(f"engine rows: {s['dir']} ({s['rows']} rows, {s['tokens']} tokens)")


def main() -> None:
    cli(_hydra_main)


if __name__ == "__main__":
    main()
