"""Upload an export to the Hugging Face Hub.

    python -m drafttrain.export RUN_DIR --push-to-hub ORG/NAME [--private] [--dry-run [DIR]]
    python -m drafttrain conf=<preset> export.push_to_hub=ORG/NAME [export.hub_private=true]

The folder uploaded is staged first: every file of the export (weights, `config.json`,
`speculators/`, tokenizer, `training_args.yaml`, plots, the runner's and the suites' reports;
not the suites' per-request resume store, and never a copy of the target: an older export's
`speculators/verifier/` is left out) plus the model card of `drafttrain.export.card` written
for the Hub (the launch commands load the drafter from `ORG/NAME`). In the staged
`speculators/config.json` the verifier is the target's hub id (`base_model`), where the local
export may name a local target directory. `--dry-run` writes that folder to a local directory and uploads nothing. The upload
is `HfApi.create_repo(exist_ok=True, private=...)` then `HfApi.upload_folder` of the staged
folder. The token is never read here: huggingface_hub resolves it itself (`HF_TOKEN`, then the
token file of `hf auth login`) and only its presence is checked, so it cannot reach a log or a
file. `HF_ENDPOINT` selects another Hub endpoint (tests use a local recording server).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from draftinfer.evaluation.suite_report import SUITES_DIR
from draftinfer.files.checkpoint import SPECULATORS_DIR
from drafttrain.export.card import write_model_card
from drafttrain.frozen.target import is_hub_id
from drafttrain.jobs.config import ExportConfig, TargetConfig
from drafttrain.jobs.errors import ConfigError, DraftError


def check_repo_id(repo_id: str) -> str:
    """`ORG/NAME` as the Hub spells repository ids; a one-line `ConfigError` otherwise."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    bad = ConfigError(f"hub repository must be ORG/NAME, got {repo_id!r}")
    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise bad
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise bad from None
    return repo_id


def check_base_model(target: TargetConfig, export: ExportConfig) -> str:
    """The card's `base_model` must be the target's hub id; a one-line `ConfigError` when the
    target is a local directory or a zoo name and `export.hub_base_model` does not name it."""
    base = export.hub_base_model or target.name_or_path
    if not is_hub_id(base):
        raise ConfigError(
            f"a Hub card's base_model must be the target's hub id, and {base!r} is not one: "
            "set export.hub_base_model=ORG/NAME (--base-model)"
        )
    return base


def check_token() -> None:
    """A one-line `DraftError` when huggingface_hub finds no token (its value is not read)."""
    from huggingface_hub import get_token

    if get_token() is None:
        raise DraftError(
            "no Hugging Face token: set HF_TOKEN or run `hf auth login` before --push-to-hub"
        )


def check_push(
    repo_id: str,
    target: TargetConfig,
    export: ExportConfig,
    dry_run: str | Path | None = None,
) -> str:
    """Everything an upload needs, checked before anything is written: the repository id, the
    card's `base_model` (returned), an empty `--dry-run` directory, or else a token."""
    check_repo_id(repo_id)
    base = check_base_model(target, export)
    if dry_run is not None:
        dest = Path(dry_run)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise DraftError(f"--dry-run directory {dest} exists and is not empty")
    else:
        check_token()
    return base


# Inside an export, what stays local: the acceptance suites' resume store (one record per
# request, with this machine's data paths; `draftinfer.evaluation.suite_run`). Their report is shipped.
# An export written before 2026-11-29 held a hard-linked copy of the target there.
LOCAL_ONLY = (Path(SUITES_DIR) / "requests", Path(SPECULATORS_DIR) / "verifier")


def staged_files(export_dir: Path) -> list[Path]:
    """The export's files that are uploaded, relative to it: all but the local model card
    (the Hub's is written instead), unfinished `.tmp` writes and `LOCAL_ONLY` folders."""
    out = []
    for src in sorted(export_dir.rglob("*")):
        rel = src.relative_to(export_dir)
        if not src.is_file() or rel == Path("README.md") or src.name.endswith(".tmp"):
            continue
        if any(rel.is_relative_to(d) for d in LOCAL_ONLY):
            continue
        out.append(rel)
    return out


def stage(run_dir: Path, export_dir: Path, repo_id: str, base_model: str, dest: Path) -> Path:
    """Write the folder to upload into `dest` (created; must not hold other files): the
    export's `staged_files` and the Hub model card."""
    dest.mkdir(parents=True, exist_ok=True)
    for rel in staged_files(export_dir):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(export_dir / rel, dest / rel)
    name_verifier(dest / SPECULATORS_DIR / "config.json", base_model)
    write_model_card(run_dir, export_dir, dest=dest, drafter_ref=repo_id, base_model=base_model)
    return dest


def name_verifier(config_path: Path, base_model: str) -> None:
    """A staged speculators `config.json` names its verifier by the target's hub id (an export
    of a local target names the local directory, which means nothing on the Hub)."""
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    verifier = config.get("speculators_config", {}).get("verifier")
    if verifier is not None and verifier.get("name_or_path") != base_model:
        verifier["name_or_path"] = base_model
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def push_to_hub(
    run_dir: str | Path,
    export_dir: str | Path,
    repo_id: str,
    base_model: str,
    private: bool = False,
    dry_run: str | Path | None = None,
) -> str:
    """Upload `export_dir` (the export of `run_dir`) as `repo_id` (after `check_push`); returns
    the commit URL. With `dry_run` (a directory), write the folder that would be uploaded there
    and return its path instead."""
    run_dir, export_dir = Path(run_dir), Path(export_dir)
    if dry_run is not None:
        return str(stage(run_dir, export_dir, repo_id, base_model, Path(dry_run)))
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    with tempfile.TemporaryDirectory(prefix="drafttrain-hub-") as tmp:
        folder = Path(tmp) / repo_id.replace("/", "--")
        stage(run_dir, export_dir, repo_id, base_model, folder)
        api = HfApi()
        try:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            info = api.upload_folder(
                repo_id=repo_id,
                folder_path=str(folder),
                repo_type="model",
                commit_message=f"Upload drafter for {base_model} (drafttrain)",
            )
        except (HfHubHTTPError, ValueError) as e:  # ValueError: the Hub refused the card's YAML
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DraftError(f"Hub upload to {repo_id} failed: {first}") from None
    return str(info.commit_url)
