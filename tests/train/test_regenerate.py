"""`python -m drafttrain.regenerate` on the shipped zoo target (`zoo:llama-tiny`, `zoo:chat`):
native greedy == transformers' greedy `generate`; the turn logic (multi-turn conditioning,
`turns=last`, skips); SIGKILL mid-run + rerun == an uninterrupted run, row for row; one-line
errors that write nothing (no chat template, missing data, another config against an existing
output, a misspelled key); the output loads with `datasets` and with `load_data`;
`data.eval_path` keeps verification on the original held-out split."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from draftinfer.decoding.sampling import SamplingParams
from draftinfer.files.paths import resolve_path
from drafttrain.data import load_data, tokenize_dataset
from drafttrain.jobs.config import DataConfig
from drafttrain.jobs.errors import ConfigError, DataError
from drafttrain.regenerate import RegenConfig, regenerate
from drafttrain.regenerate.__main__ import CONF_DIR, register_configs, to_regen_config
from drafttrain.regenerate.backends import HFBackend, NativeBackend
from drafttrain.regenerate.job import regenerate_rows, render_prompt, stop_token_ids
from drafttrain.regenerate.manifest import MANIFEST

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ZOO_TARGET = resolve_path("zoo:llama-tiny")

# Small and fast: 1 thread (2 threads on 2 busy cores is many times slower), short turns.
BASE = [
    "regenerate.max_new_tokens=24",
    "regenerate.batch_size=4",
    "regenerate.num_threads=1",
    "regenerate.progress=false",
]
# The kill test: 12 shards of 4 rows, so a kill after the first shard lands mid-run.
KILL_RUN = [*BASE, "data.max_samples=48", "regenerate.shard_size=4"]


def compose_regen(overrides: list[str]) -> RegenConfig:
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_regen_config(compose(config_name="regenerate", overrides=overrides))


def run_cli(overrides: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "drafttrain.regenerate", *overrides],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def read_rows(out: Path) -> list[dict]:
    rows = []
    for f in sorted((out / "data").glob("*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


def one_line(exc: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


@pytest.fixture(autouse=True)
def one_thread():
    """The in-process model runs use one thread too (restored after each test)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ZOO_TARGET)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted CLI run of KILL_RUN."""
    out = tmp_path_factory.mktemp("regen_ref") / "out"
    p = run_cli([*KILL_RUN, f"regenerate.output_dir={out}"])
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-2000:]
    assert "rows written       48 of 48 (native)" in stdout, stdout
    return out


# ---- config -------------------------------------------------------------------------------
def test_config_composes_and_misspelled_key_is_named():
    cfg = compose_regen([])
    assert cfg.target.name_or_path == "zoo:llama-tiny" and cfg.data.path == "zoo:chat"
    assert cfg.regenerate.turns == "all" and cfg.regenerate.temperature == 0.0
    with pytest.raises(ConfigCompositionException) as e:
        compose_regen(["regenerate.max_new_tokns=3"])
    assert "max_new_tokns" in str(e.value) or "max_new_tokns" in str(e.value.__cause__)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("regenerate.turns=first", "regenerate.turns must be one of"),
        ("regenerate.backend=vllm", "regenerate.backend must be one of"),
        ("regenerate.shard_size=0", "regenerate.shard_size must be >= 1"),
        ("regenerate.top_p=0", "0 < top_p <= 1"),
    ],
)
def test_bad_values_are_one_line_errors(override, needle, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as e:
        regenerate(compose_regen([*BASE, override, f"regenerate.output_dir={out}"]))
    one_line(e, needle)
    assert not out.exists()


# ---- backends -------------------------------------------------------------------------------
def test_native_greedy_equals_transformers_generate(tokenizer):
    """Token ids of the native backend (batched, padded ragged prompts) == HF `generate` one
    prompt at a time (no padding), and == the HF backend's left-padded batches."""
    from transformers import AutoModelForCausalLM

    convs = load_data(DataConfig(path="zoo:chat", split="train", max_samples=6))["messages"]
    prompts = []
    for msgs in convs:
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        prompts.append(render_prompt(tokenizer, msgs[:first]))
    assert len({len(p) for p in prompts}) > 1  # ragged batch
    stops = stop_token_ids(tokenizer, [4, 1])
    greedy = [SamplingParams(0.0)] * len(prompts)
    native = NativeBackend(ZOO_TARGET, torch.device("cpu"), torch.float32, 6, 256, stops)
    got = native.generate(prompts, greedy, 24)

    hf = AutoModelForCausalLM.from_pretrained(ZOO_TARGET, dtype=torch.float32).eval()
    want = []
    for p in prompts:
        out = hf.generate(
            input_ids=torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
        )
        want.append(out[0, len(p) :].tolist())
    for (tokens, reason), ref in zip(got, want):
        assert tokens == ref[: len(tokens)]
        assert reason == ("stop" if tokens[-1] in stops else "length")
        assert len(tokens) == len(ref) or reason == "stop"
    assert {r for _, r in got} >= {"stop"}

    hf_backend = HFBackend(
        ZOO_TARGET,
        compose_regen([]).target,
        torch.device("cpu"),
        torch.float32,
        256,
        stops,
        tokenizer.pad_token_id,
    )
    assert hf_backend.generate(prompts, greedy, 24) == got


def test_native_sampling_is_seeded_per_turn_not_per_batch(tokenizer):
    """Sampled turns depend on (seed, source row, turn), not on the batch they ran in."""
    convs = load_data(DataConfig(path="zoo:chat", split="train", max_samples=5))["messages"]
    stops = stop_token_ids(tokenizer, [4, 1])
    backend = NativeBackend(ZOO_TARGET, torch.device("cpu"), torch.float32, 4, 256, stops)

    def run(batch_size: int, seed: int):
        cfg = compose_regen(
            [*BASE, "regenerate.temperature=1.0", f"regenerate.seed={seed}"]
        ).regenerate
        cfg.batch_size, cfg.max_new_tokens = batch_size, 12
        return regenerate_rows(convs, list(range(5)), tokenizer, backend, cfg, 256)[0]

    a, b = run(4, 0), run(2, 0)
    assert a == b
    assert run(4, 1) != a  # another seed samples other text
    # Sampled plain decoding at temperature 0 is greedy decoding, token for token.
    from draftinfer.decoding.baseline import greedy_generate, sample_generate

    prompts = [render_prompt(tokenizer, c[:1]) for c in convs]
    greedy = [SamplingParams(0.0, seed=i) for i in range(5)]
    assert sample_generate(backend.model, prompts, 12, stops, greedy) == greedy_generate(
        backend.model, prompts, 12, stops
    )


# ---- the turn logic (a scripted backend: no model) ------------------------------------------
class ScriptedBackend:
    """Answers turn `k` of a call with the tokens of `ANSWER<k>` + EOT; records the prompts."""

    def __init__(self, tokenizer, stop_ids):
        self.tok, self.stop_ids, self.prompts, self.calls = tokenizer, stop_ids, [], 0

    def generate(self, prompts, params, max_new_tokens):
        out = []
        for p in prompts:
            self.prompts.append(self.tok.decode(p))
            text = self.tok.encode(f"ANSWER{self.calls}", add_special_tokens=False)
            out.append((text + [self.stop_ids[0]], "stop"))
            self.calls += 1
        return out


def _conversations():
    return [
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "old1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "old2"},
        ],
        [{"role": "user", "content": "only a question"}],
        [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "long"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}],
    ]


def test_every_turn_is_conditioned_on_the_regenerated_earlier_turns(tokenizer):
    backend = ScriptedBackend(tokenizer, stop_token_ids(tokenizer, [4]))
    cfg = compose_regen(BASE).regenerate
    results, skipped = regenerate_rows(
        _conversations(), [10, 11, 12, 13], tokenizer, backend, cfg, 128
    )
    assert skipped == {"no_assistant_turn": 1, "prompt_too_long": 1}
    assert results[1] is None and results[2] is None
    row, msgs, turns = results[0]
    assert row == 10
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    first, second = msgs[2]["content"], msgs[4]["content"]
    assert first.startswith("ANSWER") and second.startswith("ANSWER") and first != second
    assert msgs[:2] == _conversations()[0][:2] and msgs[3] == _conversations()[0][3]
    assert [t["message"] for t in turns] == [2, 4]
    assert all(t["finish_reason"] == "stop" for t in turns)
    # The prompt of turn 2 holds the regenerated turn 1, not the dataset's, and ends in the
    # generation prompt.
    second_prompt = next(p for p in backend.prompts if "q2" in p)
    assert first in second_prompt and "old1" not in second_prompt
    assert second_prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert results[3][1][1]["content"].startswith("ANSWER")


def test_turns_last_keeps_the_earlier_turns(tokenizer):
    backend = ScriptedBackend(tokenizer, stop_token_ids(tokenizer, [4]))
    cfg = compose_regen([*BASE, "regenerate.turns=last"]).regenerate
    results, _ = regenerate_rows(_conversations()[:1], [0], tokenizer, backend, cfg, 128)
    _, msgs, turns = results[0]
    assert msgs[2]["content"] == "old1" and msgs[4]["content"].startswith("ANSWER")
    assert [t["message"] for t in turns] == [4] and len(backend.prompts) == 1
    assert "old1" in backend.prompts[0]


# ---- resume after SIGKILL ------------------------------------------------------------------
def test_sigkill_then_rerun_equals_an_uninterrupted_run(reference_run, tmp_path):
    out = tmp_path / "out"
    args = [*KILL_RUN, f"regenerate.output_dir={out}"]
    p = run_cli(args)
    deadline = time.monotonic() + 240
    done = 0
    while time.monotonic() < deadline and p.poll() is None:
        try:
            done = len(manifest(out)["shards"])
        except (OSError, ValueError):  # not written yet (the rename is atomic: never partial)
            done = 0
        if done >= 1:
            os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed = manifest(out)
    assert 1 <= len(killed["shards"]) < killed["num_shards"] == 12
    # Every visible shard file is complete (temp files are hidden); the listed ones are there;
    # the unfinished directory refuses to load.
    visible = [f for f in (out / "data").iterdir() if not f.name.startswith(".")]
    for f in visible:
        assert all(json.loads(line) for line in f.read_text().splitlines())
    assert {f"data/{f.name}" for f in visible} >= {s["file"] for s in killed["shards"]}
    with pytest.raises(DataError) as e:
        load_data(DataConfig(path=str(out), split="train"))
    one_line(e, "unfinished regeneration")

    p = run_cli(args)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-2000:]
    resumed, ref = manifest(out), manifest(reference_run)
    assert resumed["complete"] and [s["index"] for s in resumed["shards"]] == list(range(12))
    # The shards the killed run finished were kept, not redone.
    assert resumed["shards"][: len(killed["shards"])] == killed["shards"]
    rows, ref_rows = read_rows(out), read_rows(reference_run)
    assert rows == ref_rows
    assert [r["regen"]["source_row"] for r in rows] == list(range(48))  # none lost, no dups
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in ref["shards"]]
    assert not [f for f in out.rglob(".*.tmp")]


# ---- errors that write nothing --------------------------------------------------------------
def test_target_without_chat_template_is_a_one_line_error(tmp_path):
    target = tmp_path / "no_template"
    shutil.copytree(ZOO_TARGET, target)
    tc = json.loads((target / "tokenizer_config.json").read_text())
    del tc["chat_template"]
    (target / "tokenizer_config.json").write_text(json.dumps(tc))
    out = tmp_path / "out"
    cfg = compose_regen([*BASE, f"target.name_or_path={target}", f"regenerate.output_dir={out}"])
    with pytest.raises(DataError) as e:
        regenerate(cfg)
    one_line(e, "has no chat template")
    assert not out.exists()


def test_missing_dataset_is_a_one_line_error(tmp_path):
    out = tmp_path / "out"
    cfg = compose_regen([*BASE, "data.path=/no/such/data.jsonl", f"regenerate.output_dir={out}"])
    with pytest.raises(DataError) as e:
        regenerate(cfg)
    one_line(e, "does not exist")
    assert not out.exists()


def test_other_config_against_an_existing_output_is_a_one_line_error(reference_run, tmp_path):
    before = {p: p.read_bytes() for p in reference_run.rglob("*") if p.is_file()}
    cfg = compose_regen(
        [*KILL_RUN, "regenerate.max_new_tokens=12", f"regenerate.output_dir={reference_run}"]
    )
    with pytest.raises(ConfigError) as e:
        regenerate(cfg)
    one_line(e, "other settings", "regenerate.max_new_tokens: 24 != 12")
    assert {p: p.read_bytes() for p in reference_run.rglob("*") if p.is_file()} == before
    # The CLI prints the same line and exits 2.
    p = run_cli([*KILL_RUN, "regenerate.temperature=0.5", f"regenerate.output_dir={reference_run}"])
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 2
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "regenerate.temperature: 0.0 != 0.5" in errors[0], stderr
    # A directory that is not a regeneration output is refused too.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError) as e:
        regenerate(compose_regen([*KILL_RUN, f"regenerate.output_dir={tmp_path / 'other'}"]))
    one_line(e, "has no manifest.json")


def test_a_complete_output_reruns_as_a_no_op(reference_run):
    before = {p: p.read_bytes() for p in reference_run.rglob("*") if p.is_file()}
    s = regenerate(compose_regen([*KILL_RUN, f"regenerate.output_dir={reference_run}"]))
    assert s["complete"] and s["written"] == 48
    assert {p: p.read_bytes() for p in reference_run.rglob("*") if p.is_file()} == before


# ---- the output as a dataset ----------------------------------------------------------------
def test_output_loads_with_datasets_and_load_data(reference_run, tokenizer):
    import datasets

    files = sorted(str(f) for f in (reference_run / "data").glob("*.jsonl"))
    ds = datasets.load_dataset("json", data_files=files, split="train")
    ours = load_data(DataConfig(path=str(reference_run), split="train"))
    assert len(ds) == len(ours) == 48
    assert ds["messages"] == ours["messages"] == [r["messages"] for r in read_rows(reference_run)]
    assert {t["finish_reason"] for r in ours["regen"] for t in r["turns"]} <= {"stop", "length"}
    # What training does with it: assistant-only loss masks over the regenerated turns.
    tok = tokenize_dataset(ours, tokenizer, DataConfig(path=str(reference_run), max_length=256))
    assert len(tok) == 48 and all(sum(m) > 0 for m in tok["loss_mask"])
    # Every source row's system/user turns survive unchanged.
    src = load_data(DataConfig(path="zoo:chat", split="train", max_samples=48))["messages"]
    for a, b in zip(src, ours["messages"]):
        assert [m for m in a if m["role"] != "assistant"] == [
            m for m in b if m["role"] != "assistant"
        ]


def test_eval_path_points_verification_at_the_original_data(monkeypatch, tmp_path):
    """`data.eval_path` moves the job's verification prompts (and held-out evaluation) off
    `data.path`, so a run on a regenerated train split verifies on the original test split."""
    import draftinfer.evaluation.run as runner
    from drafttrain.jobs.job import verify
    from tests.support.presets import compose_preset

    seen = {}

    def fake_run_eval(icfg):
        seen.update(prompts=icfg.prompts, split=icfg.prompts_split)
        return {}

    monkeypatch.setattr(runner, "run_eval", fake_run_eval)
    monkeypatch.setattr(runner, "format_report", lambda report: "")
    verify(compose_preset("eagle3", ["data.path=/data/regen", "data.eval_path=zoo:chat"]), tmp_path)
    assert seen == {"prompts": "zoo:chat", "split": "test"}
    verify(compose_preset("eagle3", ["data.path=/data/regen"]), tmp_path)
    assert seen == {"prompts": "/data/regen", "split": "test"}
