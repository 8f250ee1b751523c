"""Export a training run as a drafter checkpoint directory (DESIGN section 4).

    python -m drafttrain.export RUN_DIR [--out DIR] [--checkpoint step_000200] [--dtype bfloat16]
        [--push-to-hub ORG/NAME [--private] [--base-model ORG/NAME] [--dry-run [DIR]]]

Writes `config.json` (the kind's serving layout, e.g. vLLM/SGLang `LlamaForCausalLMEagle3`;
our conventions under `"drafttrain"`; the target family's top-level fields, e.g.
`target_model_type` for Qwen3-VL), `model.safetensors`, `speculators/` (the same drafter in
vllm-project/speculators' layout, when the kind has one), the target's tokenizer files,
`training_args.yaml` and a `README.md` model card. The run's config is read back through the
typed schema and the tensors come from the run's checkpoint on disk, so the export is exactly
what training saved. `--push-to-hub` uploads it afterwards (`drafttrain.hub`); every check of
the upload (repository id, the card's `base_model`, the token) runs before anything is written. Nothing here names a drafter kind (`draftinfer.registry`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from draftinfer.checkfields import require
from draftinfer.checkpoint import (
    atomic_write_text,
    write_drafter,
    write_speculators,
)
from draftinfer.registry import drafter_spec
from drafttrain.card import write_model_card
from drafttrain.checkpoint import latest_checkpoint, load_checkpoint
from drafttrain.config import load_train_config
from drafttrain.errors import CheckpointError, DraftError
from drafttrain.families import family_for
from drafttrain.target import (
    load_target_config,
    load_tokenizer,
    read_input_embedding,
    read_output_embedding,
)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_run(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    checkpoint: str | None = None,
    dtype: str | None = None,
    card: bool = True,
) -> Path:
    """Write the export of `run_dir`'s checkpoint (default: the latest). `card=False` leaves
    the model card to the caller (the job writes it once, after verification)."""
    run = Path(run_dir)
    cfg = load_train_config(run / "training_args.yaml")
    ckpt = (
        (run / "checkpoints" / checkpoint) if checkpoint else latest_checkpoint(run / "checkpoints")
    )
    if ckpt is None or not ckpt.is_dir():
        raise CheckpointError(f"no checkpoint to export under {run / 'checkpoints'}")
    dtype_name = dtype or cfg.export.dtype
    if dtype_name not in _DTYPES:
        raise DraftError(f"export dtype must be one of {sorted(_DTYPES)}, got {dtype_name!r}")
    ck = load_checkpoint(ckpt)
    state = ck["state"]
    where = str(ckpt / "state.json")
    spec = drafter_spec(require(state, "drafter_kind", where))
    arch = spec.config_class(**require(state, "drafter_config", where))
    drafter = spec.build(arch)
    drafter.load_own_state(ck["drafter"])
    objective_meta = require(state, "objective", where)
    serving_k = int(require(objective_meta, "serving_k", where))

    out = Path(out_dir) if out_dir else run / "export"
    out.mkdir(parents=True, exist_ok=True)
    target_name = cfg.target.name_or_path
    meta = {
        "target": target_name,
        "trained_steps": state["step"],
        "preset": cfg.preset,
        **objective_meta,
    }
    write_drafter(out, drafter, meta, _DTYPES[dtype_name])
    target_config = load_target_config(target_name)
    archs = list(getattr(target_config, "architectures", None) or [])
    extra = family_for(archs).export_fields(target_config)
    if extra:  # the target family's top-level fields (e.g. `target_model_type` for Qwen3-VL)
        path = out / "config.json"
        written = json.loads(path.read_text())
        atomic_write_text(path, json.dumps({**written, **extra}, indent=2, sort_keys=True) + "\n")
    if cfg.export.speculators_config:
        write_speculators(
            out,
            drafter,
            target_name,
            archs,
            serving_k,
            lambda: read_input_embedding(target_name),
            _DTYPES[dtype_name],
            lambda: read_output_embedding(target_name),
        )
    load_tokenizer(target_name).save_pretrained(str(out))
    shutil.copyfile(run / "training_args.yaml", out / "training_args.yaml")
    plot = run / "training_curves.png"
    if plot.is_file():
        shutil.copyfile(plot, out / "training_curves.png")
    if card:
        write_model_card(run, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m drafttrain.export", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="export directory (default RUN_DIR/export)")
    p.add_argument("--checkpoint", default=None, help="checkpoint name (default: latest)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES))
    p.add_argument("--push-to-hub", default=None, metavar="ORG/NAME", help="upload the export")
    p.add_argument("--private", action="store_true", help="create the Hub repository private")
    p.add_argument(
        "--base-model",
        default=None,
        metavar="ORG/NAME",
        help="the target's hub id for the card (default: export.hub_base_model, else the target)",
    )
    p.add_argument(
        "--dry-run",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="write the folder --push-to-hub would upload to DIR "
        "(default RUN_DIR/hub_dry_run/ORG--NAME) and upload nothing",
    )
    a = p.parse_args(argv)
    try:
        if a.dry_run is not None and not a.push_to_hub:
            raise DraftError("--dry-run needs --push-to-hub ORG/NAME")
        push = None
        if a.push_to_hub:
            from drafttrain.hub import check_push, check_repo_id

            check_repo_id(a.push_to_hub)
            cfg = load_train_config(Path(a.run_dir) / "training_args.yaml")
            if a.base_model:
                cfg.export.hub_base_model = a.base_model
            dry = a.dry_run
            if dry == "":
                dry = str(Path(a.run_dir) / "hub_dry_run" / a.push_to_hub.replace("/", "--"))
            push = (check_push(a.push_to_hub, cfg.target, cfg.export, dry), dry)
        out = export_run(a.run_dir, a.out, a.checkpoint, a.dtype)
        if push is not None:
            from drafttrain.hub import push_to_hub

            base, dry = push
            where = push_to_hub(a.run_dir, out, a.push_to_hub, base, a.private, dry)
            print(where)
            return 0
    except DraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
