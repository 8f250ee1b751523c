"""Hub upload against a local recording endpoint (not the real Hub).

A `http.server` in a thread answers the calls huggingface_hub 2.4 makes for `create_repo` +
`upload_folder` (read in its `hf_api.py`, `_upload_pipeline.py`, `_commit_api.py`): `POST
/api/repos/create`, `POST /api/validate-yaml` (the README's metadata), `POST
/api/models/{repo}/preupload/{rev}` answering "regular" for every file (so no LFS / Xet
storage is involved) and `POST /api/models/{repo}/commit/{rev}` with the ndjson commit; it
records them. The uploads run as
the user runs them, in a subprocess with `HF_ENDPOINT` pointing at the server and a fake
`HF_TOKEN`: the tests assert what was created and committed, that the token was sent (the
standard resolution found it) and that it appears in no output and in no file written.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from drafttrain.jobs.errors import ConfigError
from drafttrain.jobs.job import run_job
from tests.support.presets import compose_preset
from tests.support.tiny_models import tiny_recipe

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FAKE_TOKEN = "hf_fakeTOKENdrafttrain0123456789abcdefXYZ"
BASE_MODEL = "tiny-org/tiny-llama3-target"


class Recorder(BaseHTTPRequestHandler):
    """Answers what create_repo / upload_folder need; records (method, path, body)."""

    def log_message(self, *args):  # keep the test output clean
        pass

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/api/agent-harnesses":
            # huggingface_hub's best-effort agent detection, not part of the upload (it swallows
            # any error): not recorded.
            return self._reply(404, {"error": "not served"})
        self.server.requests.append(
            {"method": "GET", "path": self.path, "auth": self.headers.get("Authorization")}
        )
        self._reply(404, {"error": "not served by the recording endpoint"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        rec = {"method": "POST", "path": path, "auth": self.headers.get("Authorization")}
        self.server.requests.append(rec)
        endpoint = f"http://127.0.0.1:{self.server.server_port}"
        if path == "/api/validate-yaml":  # upload_folder has the Hub check README.md's metadata
            rec["json"] = json.loads(body)
            return self._reply(200, {"errors": [], "warnings": []})
        if path == "/api/repos/create":
            rec["json"] = json.loads(body)
            repo = f"{rec['json']['organization']}/{rec['json']['name']}"
            return self._reply(200, {"url": f"{endpoint}/{repo}"})
        parts = path.split("/")  # ['', 'api', 'models', org, name, op, rev]
        if len(parts) == 7 and parts[1:3] == ["api", "models"] and parts[5] == "preupload":
            files = json.loads(body)["files"]
            rec["json"] = files
            return self._reply(
                200,
                {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                        for f in files
                    ]
                },
            )
        if len(parts) == 7 and parts[1:3] == ["api", "models"] and parts[5] == "commit":
            lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
            rec["header"] = lines[0]["value"]
            rec["files"] = {
                x["value"]["path"]: base64.b64decode(x["value"]["content"])
                for x in lines[1:]
                if x["key"] == "file"
            }
            rec["other_ops"] = [x["key"] for x in lines[1:] if x["key"] != "file"]
            repo = f"{parts[3]}/{parts[4]}"
            return self._reply(
                200, {"commitUrl": f"{endpoint}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40}
            )
        return self._reply(404, {"error": f"unexpected {path}"})


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _env(tmp_path: Path, hub, token: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{hub.server_port}",
        HF_HOME=str(tmp_path / "hf_home"),  # no token file of the developer's
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        WANDB_MODE="disabled",
        TRITON_INTERPRET="1",
    )
    if token:
        env["HF_TOKEN"] = FAKE_TOKEN
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )


def _no_token_anywhere(root: Path, *outputs: str) -> None:
    for out in outputs:
        assert FAKE_TOKEN not in out
    written = [p for p in root.rglob("*") if p.is_file()]
    assert written  # the check looked at the run, export and dry-run files
    for p in written:
        assert FAKE_TOKEN.encode() not in p.read_bytes(), p


def _commits(hub) -> list[dict]:
    return [r for r in hub.requests if r["path"].endswith("/commit/main")]


def _front(readme: bytes) -> dict:
    return yaml.safe_load(readme.decode().split("---")[1])


@pytest.fixture(scope="module")
def pushed_run(train_env, tmp_path_factory):
    """One job run through `python -m drafttrain` with `export.push_to_hub` (config route),
    verified by the runner at K=2 and K=1, uploaded to a recording endpoint."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = tmp_path_factory.mktemp("hub")
    args = tiny_recipe("eagle3", train_env, root / "run", 4)
    args = [a for a in args if not a.startswith("export.verify=")]
    args += [
        "export.verify=true",
        "export.verify_k=2",
        "export.verify_extra_k=[1]",
        "export.verify_prompts=4",
        "export.verify_max_new_tokens=8",
        "export.verify_batch_size=4",
        "export.push_to_hub=tiny-org/eagle3-drafter",
        f"export.hub_base_model={BASE_MODEL}",
    ]
    proc = _run(["-m", "drafttrain", "conf=eagle3", *args], _env(root, server))
    server.shutdown()
    server.server_close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "run": root / "run", "proc": proc, "requests": server.requests}


def test_job_pushes_export_with_card(pushed_run):
    reqs = pushed_run["requests"]
    create = [r for r in reqs if r["path"] == "/api/repos/create"]
    assert len(create) == 1
    assert create[0]["json"] == {
        "name": "eagle3-drafter",
        "organization": "tiny-org",
        "visibility": "public",
        "type": "model",
    }
    commits = [r for r in reqs if r["path"] == "/api/models/tiny-org/eagle3-drafter/commit/main"]
    assert len(commits) == 1 and commits[0]["other_ops"] == []
    assert all(r["auth"] == f"Bearer {FAKE_TOKEN}" for r in reqs)  # HF_TOKEN was used
    assert [r["path"] for r in reqs if r["method"] == "GET"] == []
    validated = [r for r in reqs if r["path"] == "/api/validate-yaml"]
    assert [r["json"]["content"] for r in validated] == [commits[0]["files"]["README.md"].decode()]
    files = commits[0]["files"]
    export = pushed_run["run"] / "export"
    for name in (
        "config.json",
        "model.safetensors",
        "speculators/config.json",
        "speculators/model.safetensors",
        "tokenizer.json",
        "training_args.yaml",
        "runner_report.json",
        "runner_report_k1.json",
        "acceptance.png",
    ):
        assert files[name] == (export / name).read_bytes(), name
    assert set(files) == {
        str(p.relative_to(export)) for p in export.rglob("*") if p.is_file()
    }  # the export, card included, nothing else
    card = files["README.md"].decode()
    front = _front(files["README.md"])
    assert front["base_model"] == BASE_MODEL
    assert front["library_name"] == "vllm" and front["pipeline_tag"] == "text-generation"
    assert {"speculative-decoding", "eagle3"} <= set(front["tags"])
    k = json.loads((export / "config.json").read_text())["drafttrain"]["serving_k"]
    spec_cfg = (
        f'{{"method": "eagle3", "model": "tiny-org/eagle3-drafter", "num_speculative_tokens": {k}}}'
    )
    assert f"vllm serve {BASE_MODEL} --speculative-config '{spec_cfg}'" in card
    assert "--speculative-draft-model-path tiny-org/eagle3-drafter" in card
    for k in (1, 2):  # the AL table has a row per K the runner measured
        report = json.loads(
            (export / ("runner_report.json" if k == 2 else "runner_report_k1.json")).read_text()
        )
        assert f"| {k} | {report['acceptance_length']:.3f} |" in card
    assert "![per-position acceptance](acceptance.png)" in card
    assert "## Training config" in card and "push_to_hub: tiny-org/eagle3-drafter" in card
    # The local card is the same definition, pointing at the export directory.
    local = (export / "README.md").read_text()
    assert f'"model": "{export.resolve()}"' in local and _front(local.encode()) == front


def test_token_never_printed_or_written(pushed_run):
    proc = pushed_run["proc"]
    _no_token_anywhere(pushed_run["root"], proc.stdout, proc.stderr)


def test_cli_private_push_and_dry_run_write_the_same_folder(pushed_run, hub, tmp_path):
    run = pushed_run["run"]
    env = _env(tmp_path, hub)
    common = ["-m", "drafttrain.export", str(run), "--out", str(tmp_path / "export")]
    common += ["--push-to-hub", "tiny-org/private-drafter", "--base-model", BASE_MODEL]
    dry = tmp_path / "dry"
    proc = _run([*common, "--dry-run", str(dry)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(dry)
    assert hub.requests == []  # a dry run uploads nothing
    proc2 = _run([*common, "--private"], env)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    create = [r for r in hub.requests if r["path"] == "/api/repos/create"]
    assert create[0]["json"]["visibility"] == "private"
    files = _commits(hub)[0]["files"]
    staged = {str(p.relative_to(dry)): p.read_bytes() for p in dry.rglob("*") if p.is_file()}
    assert staged == files  # the dry run wrote exactly the folder that was uploaded
    _no_token_anywhere(tmp_path, proc.stdout, proc.stderr, proc2.stdout, proc2.stderr)


@pytest.mark.parametrize("name", ["no-slash", "a/b/c", "/name", "org/", "org/na me"])
def test_bad_hub_name_is_one_line_before_anything_is_written(pushed_run, hub, tmp_path, name):
    out = tmp_path / "export"
    proc = _run(
        ["-m", "drafttrain.export", str(pushed_run["run"]), "--out", str(out)]
        + ["--push-to-hub", name, "--dry-run", str(tmp_path / "dry")],
        _env(tmp_path, hub),
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: hub repository must be ORG/NAME, got {name!r}"
    ]
    assert not out.exists() and not (tmp_path / "dry").exists() and hub.requests == []


def test_missing_token_fails_before_writing(pushed_run, hub, tmp_path):
    out = tmp_path / "export"
    args = ["-m", "drafttrain.export", str(pushed_run["run"]), "--out", str(out)]
    proc = _run([*args, "--push-to-hub", "o/n"], _env(tmp_path, hub, token=False))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: no Hugging Face token: set HF_TOKEN or run `hf auth login` before --push-to-hub"
    ]
    assert not out.exists() and hub.requests == []


def test_job_refuses_bad_hub_name_before_training(train_env, tmp_path):
    out = tmp_path / "run"
    args = tiny_recipe("eagle3", train_env, out, 2, "export.push_to_hub=not-a-repo")
    with pytest.raises(ConfigError, match="hub repository must be ORG/NAME"):
        run_job(compose_preset("eagle3", args))
    assert not out.exists()


def test_job_refuses_local_target_without_hub_base_model(train_env, tmp_path):
    out = tmp_path / "run"
    args = tiny_recipe("eagle3", train_env, out, 2, "export.push_to_hub=org/name")
    with pytest.raises(ConfigError, match="base_model must be the target's hub id"):
        run_job(compose_preset("eagle3", args))
    assert not out.exists()


def test_suites_resume_store_stays_local(tmp_path):
    """The suites' report is uploaded with the export; their per-request resume store (this
    machine's paths, one file per batch of requests), the local card and an older export's
    copy of its target are not."""
    from drafttrain.export.hub import staged_files

    export = tmp_path / "export"
    for rel in [
        "config.json",
        "README.md",
        "model.safetensors.tmp",
        "suites/suites.json",
        "suites/suites.png",
        "suites/requests/mt_bench/t0/batch_0.json",
        "speculators/config.json",
        "speculators/verifier/model.safetensors",  # an older export's copy of its target
    ]:
        (export / rel).parent.mkdir(parents=True, exist_ok=True)
        (export / rel).write_text("{}")
    got = {str(p) for p in staged_files(export)}
    assert got == {
        "config.json",
        "suites/suites.json",
        "suites/suites.png",
        "speculators/config.json",
    }


def test_an_export_of_a_local_target_ships_none_of_it(train_env, tmp_path):
    """A local target with no hub id: the export names it (speculators' verifier) by its
    absolute path and holds no copy of, and no link to, any of its files (no file shares an
    inode with the target's); the staged Hub folder names the target by its hub id and holds
    no file of the target."""
    import hashlib

    from drafttrain.export.hub import stage
    from tests.support.tiny_models import train_tiny_export

    target_dir = Path(train_env["target"]).resolve()
    export = Path(train_tiny_export("eagle3", train_env, tmp_path / "run", 2)[3])
    spec_cfg = json.loads((export / "speculators" / "config.json").read_text())
    assert spec_cfg["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    inodes = {os.stat(p).st_ino for p in target_dir.rglob("*") if p.is_file()}
    exported = [p for p in export.rglob("*")]
    assert not any(p.is_symlink() for p in exported)
    assert not {os.stat(p).st_ino for p in exported if p.is_file()} & inodes
    weights = {
        hashlib.sha256(p.read_bytes()).hexdigest() for p in target_dir.rglob("*.safetensors")
    }
    dry = stage(tmp_path / "run", export, "tiny-org/x", BASE_MODEL, tmp_path / "dry")
    staged = [p for p in dry.rglob("*") if p.is_file()]
    assert not any("verifier" in p.relative_to(dry).parts for p in staged)
    assert not {hashlib.sha256(p.read_bytes()).hexdigest() for p in staged} & weights
    staged_cfg = json.loads((dry / "speculators" / "config.json").read_text())
    assert staged_cfg["speculators_config"]["verifier"]["name_or_path"] == BASE_MODEL
