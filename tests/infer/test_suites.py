"""E1: every acceptance suite preset loads a local file in its hub dataset's own schema
through `datasets.load_dataset` and builds the anchors' prompt (checked against the anchors'
own `str.format` strings); a missing column or an unknown suite is a one-line error naming it;
the hub arguments each preset passes; the config tree (`eval=<suite>`, `eval=standard`,
`temperatures=[0,1]`, `eval=sampling`); macro vs micro AL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from draftinfer.conventions.metrics import acceptance_length, macro_acceptance_length
from draftinfer.evaluation.suites import (
    SUITE_DIR,
    SuiteRow,
    load_suite,
    suite_names,
    suite_rows,
    suite_source,
)
from draftinfer.files.errors import ConfigError, DataError
from tests.support.suite_data import TEXT_SUITES, write_mmstar, write_suite_copies, zoo_questions

REPO = Path(__file__).resolve().parents[2]
N = 4
# The anchors' own prompt strings (z-lab benchmark.py / vLLM acceptance tests), as `str.format`.
BOXED = "{q}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
HUMANEVAL = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = write_suite_copies(tmp_path_factory.mktemp("suites"), n=N)
    write_mmstar(root / "mmstar.parquet", zoo_questions(N))
    return root


def _rows(name: str, copies: Path) -> list[SuiteRow]:
    suite = load_suite(name)
    return suite_rows(suite, suite_source(suite, str(copies), n_suites=len(suite_names())))


def test_every_preset_has_a_schema_copy_here():
    """A new preset needs its hub schema in tests/support/suite_data.py (and so in this E1 test)."""
    assert set(suite_names()) == {*TEXT_SUITES, "mmstar"}


@pytest.mark.parametrize("name", suite_names())
def test_preset_loads_its_schema_and_builds_the_anchor_prompt(name, copies):
    q = zoo_questions(2 * N + 1)
    rows = _rows(name, copies)
    assert [r.row for r in rows] == list(range(N))
    first = [r.turns[0] for r in rows]
    expect = {
        "mt_bench": lambda i: q[i],  # the first of the two turns
        "gsm8k": lambda i: BOXED.format(q=q[i]),
        "math500": lambda i: BOXED.format(q=q[i]),
        "humaneval": lambda i: HUMANEVAL.format(prompt=f'def f{i}(x):\n    """{q[i]}"""\n'),
        # z-lab: f"{instruction}\n\nInput:\n{input}" if input else instruction
        "alpaca": lambda i: f"{q[i]}\n\nInput:\n{q[i + N]}" if i % 2 else q[i],
        "speed_bench": lambda i: q[i],
        "spec_bench": lambda i: q[i],
        "chat": lambda i: q[i],
        "mmstar": lambda i: [
            {"type": "image", "image": rows[i].turns[0][0]["image"]},
            {"type": "text", "text": f"{q[i]}\nOptions: A: yes, B: no"},
        ],
    }[name]
    assert first == [expect(i) for i in range(N)]
    if name == "spec_bench":  # every turn: its mt_bench rows have two
        assert [len(r.turns) for r in rows] == [2, 2, 1, 1]
        assert rows[0].turns[1] == q[N]
    else:
        assert all(len(r.turns) == 1 for r in rows)
    if name == "mmstar":
        assert rows[0].turns[0][0]["image"].size == (64, 96)  # a decoded datasets Image
    if name == "chat":  # the conversation's own system prompt comes along
        lines = (copies / "chat.jsonl").read_text().splitlines()
        msgs = [json.loads(ln)["messages"] for ln in lines]
        assert [r.system for r in rows] == [
            m[0]["content"] if m[0]["role"] == "system" else None for m in msgs
        ]


def test_multi_turn_conversation_carries_the_replies():
    r = SuiteRow(3, ["first", "second"], system="sys")
    assert r.conversation([]) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
    ]
    assert r.conversation(["reply"])[1:] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "second"},
    ]


def test_missing_column_is_a_one_line_error_naming_it(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"problem": "x", "answer": "1"}) + "\n")
    with pytest.raises(DataError) as e:
        suite_rows(load_suite("gsm8k"), str(path))
    msg = str(e.value)
    assert "\n" not in msg and "'gsm8k'" in msg and "'question'" in msg and "problem" in msg


def test_wrong_column_type_is_a_one_line_error(tmp_path):
    path = tmp_path / "mt.jsonl"
    path.write_text(json.dumps({"prompt": 3}) + "\n")
    with pytest.raises(DataError) as e:
        suite_rows(load_suite("mt_bench"), str(path))
    assert "\n" not in str(e.value) and "'prompt'" in str(e.value)


def test_unknown_suite_is_a_one_line_error_naming_it():
    with pytest.raises(ConfigError) as e:
        load_suite("mt_bnech")
    msg = str(e.value)
    assert "\n" not in msg and "'mt_bnech'" in msg and "mt_bench" in msg


def test_unknown_suite_on_the_command_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "draftinfer", f"drafter={tmp_path}", "eval.suites=[nope]"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "unknown suite 'nope'" in errors[0], r.stderr


def test_suite_file_with_unknown_key_or_type_is_an_error(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text("dataset: x\ntemplat: '{q}'\n")
    with pytest.raises(ConfigError, match="unknown key 'templat'"):
        load_suite(str(bad))
    bad.write_text("dataset: x\nnum_prompts: lots\n")
    with pytest.raises(ConfigError, match="num_prompts"):
        load_suite(str(bad))
    bad.write_text("dataset: x\ntemplate: '{q}'\noptional: {r: ' {r}'}\n")
    with pytest.raises(ConfigError, match="optional column 'r'"):
        load_suite(str(bad))


def test_a_suite_file_path_works_like_a_preset(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"q": "hi", "ctx": "a"}) + "\n")
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"dataset: {tmp_path / 'd.jsonl'}\ntemplate: 'Q: {{q}} ({{ctx}}) {{}}'\n")
    rows = suite_rows(load_suite(str(mine)))
    assert rows[0].turns == ["Q: hi (a) {}"]  # only column names are placeholders


def test_placeholder_rows_are_refused(tmp_path):
    (tmp_path / "test.jsonl").write_text(
        json.dumps({"turns": ["FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE ..."]}) + "\n"
    )
    with pytest.raises(DataError) as e:
        suite_rows(load_suite("speed_bench"), str(tmp_path))
    assert "placeholder" in str(e.value) and "\n" not in str(e.value)


def test_eval_path_with_several_suites_needs_a_copy_of_each(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    assert suite_source(load_suite("gsm8k"), str(tmp_path), 2) == str(tmp_path / "gsm8k.jsonl")
    with pytest.raises(DataError, match="no copy of suite 'humaneval'"):
        suite_source(load_suite("humaneval"), str(tmp_path), 2)
    # One suite: eval.path is the copy itself.
    assert suite_source(load_suite("humaneval"), str(tmp_path), 1) == str(tmp_path)


# Each preset's hub call: the dataset id / URL, its config and split, as the anchors load them.
HUB_CALLS = {
    "mt_bench": {"path": "HuggingFaceH4/mt_bench_prompts", "name": None, "split": "train"},
    "gsm8k": {"path": "openai/gsm8k", "name": "main", "split": "test"},
    "humaneval": {"path": "openai/openai_humaneval", "name": None, "split": "test"},
    "math500": {"path": "HuggingFaceH4/MATH-500", "name": None, "split": "test"},
    "alpaca": {"path": "tatsu-lab/alpaca", "name": None, "split": "train"},
    "speed_bench": {"path": "nvidia/SPEED-Bench", "name": "qualitative", "split": "test"},
    "mmstar": {"path": "Lin-Chen/MMStar", "name": None, "split": "val"},
    "spec_bench": {
        "path": "json",
        "data_files": {
            "test": "https://raw.githubusercontent.com/hemingkx/Spec-Bench/refs/heads/main/"
            "data/spec_bench/question.jsonl"
        },
        "split": "test",
    },
}


@pytest.mark.parametrize("name", sorted(HUB_CALLS))
def test_preset_asks_datasets_for_the_hub_dataset(name, copies, monkeypatch):
    """Without a local copy the preset goes to the hub through `datasets.load_dataset` with
    the anchors' id, config and split (answered here from the local copy: no network)."""
    import datasets

    real = datasets.load_dataset
    local = suite_source(load_suite(name), str(copies), 9)
    calls = []

    def fake(**kwargs):
        calls.append(kwargs)
        ext = Path(local).suffix or ".jsonl"
        f = local if Path(local).is_file() else str(Path(local) / "test.jsonl")
        return real({".parquet": "parquet"}.get(ext, "json"), data_files=f, split="train")

    monkeypatch.setattr(datasets, "load_dataset", fake)
    rows = suite_rows(load_suite(name))
    assert calls == [HUB_CALLS[name]] and len(rows) == N


def test_enable_thinking_reaches_the_chat_template(tmp_path):
    """Qwen3 templates close an empty think block when `enable_thinking` is false (the
    released template's generation-prompt tail, copied here as the oracle)."""
    from draftinfer.evaluation.suite_decode import PromptRenderer
    from draftinfer.registry import DEFAULT_FAMILY, family_spec
    from tests.support.tiny_tokenizers import QWEN3_TEMPLATE, make_qwen3_tokenizer

    tok = make_qwen3_tokenizer(tmp_path / "tok")
    tok.chat_template = QWEN3_TEMPLATE + (
        "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is "
        "false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    )
    tok.save_pretrained(str(tmp_path / "tok"))
    r = PromptRenderer(family_spec(DEFAULT_FAMILY), str(tmp_path / "tok"), 512)
    conv = [{"role": "user", "content": "First question"}]
    off = r.tokenizer.decode(r.render(conv, "x", {"enable_thinking": False}).ids)
    on = r.tokenizer.decode(r.render(conv, "x", {"enable_thinking": True}).ids)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), off
    assert on.endswith("<|im_start|>assistant\n"), on


def test_mmstar_prompts_render_through_the_vl_processor(copies):
    """The target's family renders image prompts (its `prompt_encoder`: the processor)."""
    from draftinfer.evaluation.suite_decode import PromptRenderer
    from draftinfer.registry import family_of

    rows = _rows("mmstar", copies)
    family = family_of("zoo:qwen3-vl-tiny")
    assert family.takes_images
    r = PromptRenderer(family, "zoo:qwen3-vl-tiny", 1024)
    p = r.render(rows[0].conversation([]), "mmstar row 0", {"enable_thinking": False})
    assert p.mm_inputs is not None and p.mm_inputs["pixel_values"] is not None
    image_id = r.encoder.processor.image_token_id
    n_image = sum(t == image_id for t in p.ids)
    grid = p.mm_inputs["image_grid_thw"][0]
    assert n_image == int(grid.prod()) // 4  # merge 2x2
    assert r.render(rows[0].conversation([]), "x", {}) is not None
    assert (
        PromptRenderer(family, "zoo:qwen3-vl-tiny", n_image + 2).render(
            rows[0].conversation([]), "x", {}
        )
        is None
    )  # does not fit: skipped, never cut


def _compose(overrides: list[str]):
    """The runner's config as `python -m draftinfer` composes it, in a process of its own:
    Hydra's ConfigStore is global, and training's schemas (its `drafter` group, stored when a
    test in this session composed a training preset) would turn `drafter=DIR` into a group
    choice; that group is set aside while composing."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from draftinfer.__main__ import CONF_DIR, register_configs

    store = ConfigStore.instance()
    saved = store.repo
    store.repo = {group: node for group, node in saved.items() if group != "drafter"}
    try:
        register_configs()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return OmegaConf.to_object(compose(config_name="infer", overrides=overrides))
    finally:
        store.repo = saved


def test_config_tree_selects_suites_and_temperatures():
    cfg = _compose(["drafter=x", "eval=standard", "eval.path=/data", "temperatures=[0,1]"])
    assert cfg.eval.suites == ["mt_bench", "humaneval", "gsm8k", "math500", "alpaca"]
    assert cfg.eval.path == "/data" and cfg.temperatures == [0.0, 1.0]
    for name in suite_names():
        assert _compose(["drafter=x", f"eval={name}"]).eval.suites == [name]
    for name in ("eval.suites=[gsm8k,mmstar]", "eval.num_prompts=3"):
        _compose(["drafter=x", name])
    # The held-out run's presets (no suite): greedy by default, sampling on request.
    assert _compose(["drafter=x"]).eval.suites == [] and _compose(["drafter=x"]).temperature == 0
    s = _compose(["drafter=x", "eval=sampling"])
    assert (s.temperature, s.top_p, s.check_reference, s.eval.suites) == (1.0, 0.95, True, [])


def test_compile_options_from_the_command_line():
    """`compile_options` (null by default: the runner's) takes a mapping on the command line,
    `{}` stays distinct from null, and a non-mapping is a one-line error at the config check."""
    from draftinfer.evaluation.run import check_infer_config
    from draftinfer.files.errors import ConfigError

    assert _compose(["drafter=x"]).compile_options is None
    assert _compose(["drafter=x", "compile_options={}"]).compile_options == {}
    two = "compile_options={combo_kernels:false,max_autotune:true}"
    assert _compose(["drafter=x", two]).compile_options == {
        "combo_kernels": False,
        "max_autotune": True,
    }
    bad = _compose(["drafter=x", "compile=true", "compile_options=5"])
    with pytest.raises(ConfigError, match="compile_options must be a mapping"):
        check_infer_config(bad)


def test_suite_files_are_all_in_the_eval_group():
    groups = {p.stem for p in (SUITE_DIR.parent / "eval").glob("*.yaml")}
    assert set(suite_names()) <= groups and {"standard", "greedy", "sampling"} <= groups


def test_macro_and_micro_acceptance_length():
    # Request A: 3 rounds accepting 3,3,3 (AL 4); request B: 1 round accepting 0 (AL 1).
    rounds = [[3, 3, 3], [0], []]
    assert acceptance_length([a for r in rounds for a in r]) == pytest.approx(13 / 4)
    assert macro_acceptance_length(rounds) == pytest.approx((4 + 1) / 2)  # empty one left out
    assert macro_acceptance_length([[], []]) != macro_acceptance_length([[], []])  # NaN


def test_suite_run_settings_are_checked_before_loading():
    from draftinfer.evaluation.config import EvalConfig, InferConfig
    from draftinfer.evaluation.suite_run import check_suites_config

    def cfg(**kw):
        return InferConfig(drafter="x", eval=EvalConfig(suites=["gsm8k"]), **kw)

    assert check_suites_config(cfg()) == [0.0]
    assert check_suites_config(cfg(temperatures=[0, 1])) == [0.0, 1.0]
    for kw, needle in (
        ({"num_prompts": 8}, "eval.num_prompts="),
        ({"max_new_tokens": 8}, "eval.max_new_tokens="),
        ({"prompts": "my.jsonl"}, "eval.path="),
        ({"temperatures": [1, 1]}, "distinct"),
        ({"temperatures": [-1]}, ">= 0"),
        ({"report": "r.json"}, "suites.json"),
    ):
        with pytest.raises(ConfigError, match=needle) as e:
            check_suites_config(cfg(**kw))
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="twice"):
        check_suites_config(InferConfig(drafter="x", eval=EvalConfig(suites=["a", "a"])))
