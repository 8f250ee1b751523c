"""Export a training run as a drafter checkpoint directory (DESIGN section 4).

    python -m drafttrain.export RUN_DIR [--out DIR] [--checkpoint step_000200] [--dtype bfloat16]
        [--push-to-hub ORG/NAME [--private] [--base-model ORG/NAME] [--dry-run [DIR]]]

Writes `config.json` (the kind's serving layout, e.g. vLLM/SGLang `LlamaForCausalLMEagle3`;
our conventions under `"drafttrain"`; the target family's top-level fields, e.g.
`target_model_type` for Qwen3-VL), `model.safetensors`, `speculators/` (the same drafter in
vllm-project/speculators' layout, when the kind has one), the target's tokenizer files,
`training_args.yaml` and a `README.md` model card. The run's config is read back through the
typed schema and the tensors come from the run's checkpoint on disk, so the export is exactly
what training saved. `--push-to-hub` uploads it afterwards (`drafttrain.export.hub`); every check of
the upload (repository id, the card's `base_model`, the token) runs before anything is written. Nothing here names a drafter kind (`draftinfer.registry`).

Files an engine reads hold no path of the training machine (`training_args.yaml` and the card,
the user's own record, may): the target is recorded by a name that resolves anywhere
(`recorded_target`). One exception, for speculators' own loader: a target with no hub id is
named in `speculators/config.json` by its absolute path (`speculators_verifier`), which
resolves from any working directory of the machine that has the target; the Hub upload names
the hub id instead (`drafttrain.export.hub`). The export holds no copy of, and no link to, the
target's files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from draftinfer.files.checkfields import require
from draftinfer.files.checkpoint import (
    write_drafter,
    write_speculators,
)
from draftinfer.files.paths import ZOO_PREFIX, resolve_path
from draftinfer.registry import drafter_spec
from drafttrain.export.card import write_model_card
from drafttrain.frozen.target import (
    is_hub_id,
    load_target_config,
    load_tokenizer,
    read_input_embedding,
)
from drafttrain.jobs.config import load_train_config
from drafttrain.jobs.errors import CheckpointError, DraftError
from drafttrain.registry import family_for
from drafttrain.trainer.checkpoint import latest_checkpoint, load_checkpoint

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TargetShared(Mapping):
    """The target weights drafters share (`"input_embeddings"`, `"output_embeddings"`, the
    roles of `target.shared_weights()`), read from the target's safetensors on first use (no
    model is built; a kind that shares nothing reads nothing). The output embedding is
    `lm_head.weight`, or the input embedding of a target that ties them."""

    ROLES = ("input_embeddings", "output_embeddings")

    def __init__(self, name_or_path: str):
        self.name, self._read = name_or_path, {}

    def __getitem__(self, role: str) -> torch.Tensor:
        if role not in self.ROLES:
            raise KeyError(role)
        if role not in self._read:
            if role == "input_embeddings":
                self._read[role] = read_input_embedding(self.name)
            else:
                self._read[role] = self._output_embedding()
        return self._read[role]

    def __iter__(self):
        return iter(self.ROLES)

    def __len__(self) -> int:
        return len(self.ROLES)

    def _output_embedding(self) -> torch.Tensor:
        from safetensors import safe_open

        from draftinfer.files.target_dir import resolve_checkpoint_dir, weight_files

        ckpt = resolve_checkpoint_dir(resolve_path(self.name))
        for path in weight_files(ckpt):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = [
                    n for n in f.keys() if n.endswith("lm_head.weight") and ".layers." not in n
                ]
                if names:
                    return f.get_tensor(min(names, key=len))
        config = json.loads((ckpt / "config.json").read_text())
        tied = config.get(
            "tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings")
        )
        if not tied:
            raise CheckpointError(
                f"no output embedding (lm_head.weight) in the weights of {self.name!r}, which does "
                "not tie it to the input embedding"
            )
        return self["input_embeddings"]


def recorded_target(cfg) -> str | None:
    """The target's name as `config.json` records it (`drafttrain.frozen.target`, which the runner
    loads when no `target=` is given): a hub id or a `zoo:` name as trained, the hub id
    `export.hub_base_model` names for a local directory, else None (a local directory is a
    path of the training machine; the runner then asks for `target=`)."""
    name = cfg.target.name_or_path
    if name.startswith(ZOO_PREFIX) or is_hub_id(name):
        return name
    return cfg.export.hub_base_model


def speculators_verifier(cfg) -> str:
    """`speculators_config.verifier.name_or_path`, which speculators 0.9.0 resolves as a local
    directory or else a hub id (it reads the verifier's `config.json` and its `embed_tokens` /
    `lm_head` at load, from any working directory): the target's hub id when it has one
    (`export.hub_base_model`, or the target's own name); otherwise (a `zoo:` target or a local
    directory) the target directory's absolute path. Nothing of the target is copied or linked
    into the export: a relative name would resolve only from one working directory (speculators
    resolves it from there, not from the config's folder), and a copy would ship the target's
    weights with the drafter."""
    hub = cfg.export.hub_base_model or cfg.target.name_or_path
    if is_hub_id(hub):
        return hub
    return str(Path(resolve_path(cfg.target.name_or_path)).expanduser().resolve())


def checkpoint_drafter(ckpt: Path, target: str) -> tuple[torch.nn.Module, dict, TargetShared]:
    """(the drafter of a training checkpoint directory, its `state.json`, the target weights it
    shares): built by its kind's spec, its own tensors loaded, the shared ones attached from
    `target` (what `export_run` and the online publisher write from)."""
    ck = load_checkpoint(ckpt)
    state = ck["state"]
    where = str(ckpt / "state.json")
    spec = drafter_spec(require(state, "drafter_kind", where))
    arch = spec.config_class(**require(state, "drafter_config", where))
    drafter = spec.build(arch)
    drafter.load_own_state(ck["drafter"])
    # The weights the drafter shares with its target are not in its checkpoint; a layout that
    # stores copies of them (an MTP module's `shared_head.head` and `embed_tokens`, which vLLM's
    # DeepSeek MTP loader reads) must hold the target's, not the module's initial values.
    shared = TargetShared(target)
    spec.attach_shared(drafter, shared)
    return drafter, state, shared


def export_run(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    checkpoint: str | None = None,
    dtype: str | None = None,
    card: bool = True,
    hub_base_model: str | None = None,
) -> Path:
    """Write the export of `run_dir`'s checkpoint (default: the latest). `card=False` leaves
    the model card to the caller (the job writes it once, after verification);
    `hub_base_model` overrides the run's `export.hub_base_model` (the target's hub id, which
    the exported files then name the target by)."""
    run = Path(run_dir)
    cfg = load_train_config(run / "training_args.yaml")
    if hub_base_model:
        cfg.export.hub_base_model = hub_base_model
    ckpt = (
        (run / "checkpoints" / checkpoint) if checkpoint else latest_checkpoint(run / "checkpoints")
    )
    if ckpt is None or not ckpt.is_dir():
        raise CheckpointError(f"no checkpoint to export under {run / 'checkpoints'}")
    dtype_name = dtype or cfg.export.dtype
    if dtype_name not in _DTYPES:
        raise DraftError(f"export dtype must be one of {sorted(_DTYPES)}, got {dtype_name!r}")
    drafter, state, shared = checkpoint_drafter(ckpt, cfg.target.name_or_path)
    objective_meta = require(state, "objective", str(ckpt / "state.json"))
    serving_k = int(require(objective_meta, "serving_k", str(ckpt / "state.json")))

    out = Path(out_dir) if out_dir else run / "export"
    out.mkdir(parents=True, exist_ok=True)
    target_name = cfg.target.name_or_path
    meta = {
        "target": recorded_target(cfg),
        "trained_steps": state["step"],
        "preset": cfg.preset,
        **objective_meta,
    }
    target_config = load_target_config(target_name)
    archs = list(getattr(target_config, "architectures", None) or [])
    # The target family's top-level fields (e.g. `target_model_type` for Qwen3-VL) are written
    # with the kind's: config.json is written once.
    write_drafter(
        out, drafter, meta, _DTYPES[dtype_name], family_for(archs).export_fields(target_config)
    )
    if cfg.export.speculators_config:
        write_speculators(
            out,
            drafter,
            speculators_verifier(cfg),
            archs,
            serving_k,
            lambda: shared["input_embeddings"],
            _DTYPES[dtype_name],
            lambda: shared["output_embeddings"],
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
            from drafttrain.export.hub import check_push, check_repo_id

            check_repo_id(a.push_to_hub)
            cfg = load_train_config(Path(a.run_dir) / "training_args.yaml")
            if a.base_model:
                cfg.export.hub_base_model = a.base_model
            dry = a.dry_run
            if dry == "":
                dry = str(Path(a.run_dir) / "hub_dry_run" / a.push_to_hub.replace("/", "--"))
            push = (check_push(a.push_to_hub, cfg.target, cfg.export, dry), dry)
        out = export_run(a.run_dir, a.out, a.checkpoint, a.dtype, hub_base_model=a.base_model)
        if push is not None:
            from drafttrain.export.hub import push_to_hub

            base, dry = push
            where = push_to_hub(a.run_dir, out, a.push_to_hub, base, a.private, dry)
            print(where)
            return 0
    except DraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
