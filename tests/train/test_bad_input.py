"""The bad-input catalogue: each kind of bad input (config, data, target, checkpoint, target
mismatch, prompts, export) is a one-line `DraftError` naming the problem, and nothing is
half-written (no run directory, no export directory, no report)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftinfer.evaluation.config import InferConfig
from draftinfer.evaluation.run import run_eval
from draftinfer.files.checkpoint import write_drafter
from draftinfer.files.errors import DraftError
from draftinfer.files.loading import load_native_target
from drafttrain.export.directory import export_run
from drafttrain.jobs.job import run_job
from tests.support.presets import compose_preset
from tests.support.tiny_models import untrained_drafter

REPO = Path(__file__).resolve().parents[2]


def _one_line(exc: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


# ---- training: config, data and target ------------------------------------------------
def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _train_cases(env, tmp):
    no_asst = _write(tmp / "no_asst.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    no_col = _write(tmp / "no_col.jsonl", [{"text": "hello"}])
    bad_role = _write(tmp / "bad_role.jsonl", [{"messages": [{"content": "no role"}]}])
    return {
        "unknown drafter kind": (["drafter.kind=medusa"], "unknown drafter kind 'medusa'"),
        "missing target": (["target.name_or_path=/no/such/target"], "target not found"),
        "bad target dtype": (["target.dtype=float8"], "target.dtype must be"),
        "hidden size mismatch": (["drafter.hidden_size=48"], "hidden_size 48 does not fit"),
        "draft vocab too large": (["drafter.draft_vocab_size=100000"], "draft_vocab_size 100000"),
        "tap out of range": (["drafter.aux_layer_ids=[1,2,9]"], "aux_layer_ids [9] out of range"),
        "heads vs kv heads": (
            ["drafter.num_attention_heads=4", "drafter.num_key_value_heads=3"],
            "not a multiple of num_key_value_heads 3",
        ),
        "zero layers": (["drafter.num_layers=0"], "num_layers must be >= 1"),
        "unknown loss": (["trainer.loss=focal"], "trainer.loss must be one of"),
        "bad attention backend": (["drafter.attention_backend=fast"], "attention_backend"),
        "missing data": (["data.path=/no/such/data.jsonl"], "does not exist"),
        "no assistant turns": ([f"data.path={no_asst}"], "assistant"),
        "no messages column": ([f"data.path={no_col}"], "has no column 'messages'"),
        "message without role": ([f"data.path={bad_role}"], "has no 'role'"),
        "mask token outside vocabulary": (
            ["drafter=ptd", "drafter.mask_token_id=99999"],
            "mask_token_id 99999 is outside the target vocabulary",
        ),
        "parallel K below 1": (["drafter=ptd", "drafter.parallel_k=0"], "parallel_k must be >= 1"),
    } | (
        {}
        if torch.cuda.is_available()
        else {"cudnn without CUDA": (["drafter.attention_backend=cudnn"], "needs a CUDA device")}
    )


TRAIN_CASES = sorted(_train_cases({"target": "", "data": ""}, Path("/")))


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_training_bad_input(case, train_env, tmp_path):
    overrides, needle = _train_cases(train_env, tmp_path)[case]
    out = tmp_path / "run"
    base = [
        f"target.name_or_path={train_env['target']}",
        f"data.path={train_env['data']}",
        f"output_dir={out}",
        "trainer.max_steps=2",
        "trainer.progress=false",
        "data.batch_size=2",
        "drafter.draft_vocab_size=64",
        "export.verify=false",
    ]
    cfg = compose_preset("eagle3", base + overrides)
    with pytest.raises(DraftError) as e:
        run_job(cfg)
    _one_line(e, needle)
    assert not out.exists(), f"{case}: left {sorted(p.name for p in out.rglob('*'))}"


# ---- the runner: checkpoints, target mismatch, prompts, options --------------------------
@pytest.fixture(scope="module")
def good_export(train_env, tmp_path_factory):
    target = load_native_target(train_env["target"], max_batch=2, max_seq_len=128)
    out = tmp_path_factory.mktemp("export")
    d = untrained_drafter("ptd", train_env["target"], target, parallel_k=3)
    write_drafter(out, d, {"target": train_env["target"], "serving_k": 3}, torch.float32)
    return out


def _corrupt_tensors(d: Path):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:64])


def _edit(key, value):
    def f(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))

    return f


RUNNER_CASES = {
    "no drafter given": ({"drafter": ""}, None, "drafter=DIR is required"),
    "not a checkpoint": ({}, lambda d: (d / "config.json").unlink(), "does not exist"),
    "corrupted safetensors": ({}, _corrupt_tensors, "corrupted safetensors file"),
    "corrupted config.json": (
        {},
        lambda d: (d / "config.json").write_text("{"),
        "corrupted",
    ),
    "missing max_position_embeddings": (
        {},
        _edit("max_position_embeddings", None),
        "missing field 'max_position_embeddings'",
    ),
    "missing parallel_k": ({}, _edit("parallel_k", None), "missing field 'parallel_k'"),
    "unknown rope key": (
        {},
        _edit("rope_scaling", {"rope_type": "linear", "factor": 2.0, "nope": 1}),
        "unknown rope key 'nope'",
    ),
    "short max_position_embeddings": (
        {},
        _edit("max_position_embeddings", 64),
        "max_position_embeddings 64 is shorter than the target's 512",
    ),
    "target mismatch": ({"target": "QWEN"}, None, "does not match"),
    "k beyond trained K": ({"k": 5}, None, "k=5 exceeds the K=3"),
    "k below 1": ({"k": 0}, None, "k must be >= 1"),
    "unknown verify mode": ({"verify": "exact"}, None, "verify must be one of"),
    "bad dtype": ({"dtype": "int8"}, None, "dtype must be auto or one of"),
    "prompts file missing": ({"prompts": "/no/such/prompts.txt"}, None, "prompts file not found"),
    "empty prompts file": ({"prompts": "EMPTY"}, None, "no prompts in"),
    "bad sampling": ({"top_p": 0.0}, None, "0 < top_p <= 1"),
}


@pytest.mark.parametrize("case", sorted(RUNNER_CASES))
def test_runner_bad_input(case, good_export, train_env, tiny_qwen3_dir, tmp_path):
    fields, damage, needle = RUNNER_CASES[case]
    export = tmp_path / "export"
    shutil.copytree(good_export, export)
    if damage is not None:
        damage(export)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    subst = {"QWEN": str(tiny_qwen3_dir), "EMPTY": str(empty)}
    fields = {k: subst.get(v, v) if isinstance(v, str) else v for k, v in fields.items()}
    report = tmp_path / "report.json"
    cfg = InferConfig(
        drafter=str(export),
        target=train_env["target"],
        prompts=train_env["data"],
        num_prompts=2,
        k=3,
        max_new_tokens=4,
        batch_size=2,
        max_model_len=128,
        report=str(report),
        progress=False,
    )
    for k, v in fields.items():
        setattr(cfg, k, v)
    with pytest.raises(DraftError) as e:
        run_eval(cfg)
    _one_line(e, needle)
    assert not report.exists() and not report.with_suffix(".png").exists()


def test_runner_cli_error_is_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "draftinfer", f"drafter={tmp_path}", "progress=false"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 2
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: not a drafter checkpoint: {tmp_path / 'config.json'} does not exist"
    ]


# ---- export ----------------------------------------------------------------------------
def test_export_bad_input(tmp_path):
    with pytest.raises(DraftError) as e:
        export_run(tmp_path / "nope", out_dir=tmp_path / "out")
    _one_line(e, "not a training run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "training_args.yaml").write_text("drafter: {kind: eagle3, bogus: 1}\n")
    with pytest.raises(DraftError) as e:
        export_run(tmp_path / "run", out_dir=tmp_path / "out")
    _one_line(e, "unknown key 'bogus'")
    assert not (tmp_path / "out").exists()
