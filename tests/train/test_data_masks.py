"""R2: assistant-only loss masks on Llama-3 and Qwen3 (`<think>`) templates, token by token;
chat data loading (json / jsonl / parquet / directory / zoo / ShareGPT) and its errors.

The expected masks are derived independently of `drafttrain.data.chat`: each test writes the
rendered conversation out literally as segments flagged generated (1) or not (0)
(`tests.support.chat_masks`). The harmony format of gpt-oss is checked the same way in
`tests/families/test_gpt_oss_harmony.py`.
"""

from __future__ import annotations

import json

import datasets
import pytest

from drafttrain.data import (
    assistant_spans,
    end_of_turn_marker,
    load_data,
    tokenize_conversation,
    tokenize_dataset,
)
from drafttrain.jobs.config import DataConfig
from drafttrain.jobs.errors import DataError
from tests.support.chat_masks import assert_mask_matches, expected_from_segments
from tests.support.tiny_tokenizers import (
    make_llama3_tokenizer,
    make_qwen3_tokenizer,
    make_tokenizer_without_template,
)

SYSTEM = "You are a helpful model."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Second question"},
    {"role": "assistant", "content": "Second answer"},
]

LLAMA3_SEGMENTS = [
    (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        f"{SYSTEM}<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        0,
    ),
    ("Hi there<|eot_id|>", 1),
    (
        "<|start_header_id|>user<|end_header_id|>\n\nSecond question<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        0,
    ),
    ("Second answer<|eot_id|>", 1),
]

_QWEN3_PROMPT = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    "<|im_start|>user\nHello<|im_end|>\n"
    "<|im_start|>assistant\n"
)
_QWEN3_MIDDLE = "\n<|im_start|>user\nSecond question<|im_end|>\n<|im_start|>assistant\n"
QWEN3_SEGMENTS = [
    (_QWEN3_PROMPT, 0),
    ("Hi there<|im_end|>", 1),
    (_QWEN3_MIDDLE, 0),
    # The template inserts an empty think block in the last turn: the model generates it.
    ("<think>\n\n</think>\n\nSecond answer<|im_end|>", 1),
    ("\n", 0),  # the newline after the end-of-turn marker is not generated
]
QWEN3_REASONING_SEGMENTS = [
    (_QWEN3_PROMPT, 0),
    ("Hi there<|im_end|>", 1),
    (_QWEN3_MIDDLE, 0),
    ("<think>\nLet me see\n</think>\n\nSecond answer<|im_end|>", 1),
    ("\n", 0),
]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return make_llama3_tokenizer(tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3"))


def test_end_of_turn_marker_is_probed_from_the_template(llama3, qwen3):
    assert end_of_turn_marker(llama3) == "<|eot_id|>"
    assert end_of_turn_marker(qwen3) == "<|im_end|>"


def test_llama3_mask_is_assistant_only(llama3):
    out = assert_mask_matches(llama3, CONVERSATION, LLAMA3_SEGMENTS)
    # BOS comes from the template, not from add_special_tokens: exactly one.
    assert out["input_ids"].count(llama3.convert_tokens_to_ids("<|begin_of_text|>")) == 1


def test_qwen3_mask_includes_empty_think_block_of_last_turn(qwen3):
    assert_mask_matches(qwen3, CONVERSATION, QWEN3_SEGMENTS)


def test_qwen3_mask_with_reasoning_content(qwen3):
    messages = [dict(m) for m in CONVERSATION]
    messages[-1]["reasoning_content"] = "Let me see"
    assert_mask_matches(qwen3, messages, QWEN3_REASONING_SEGMENTS)


def test_sharegpt_rows_give_the_same_mask(qwen3):
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"from": speaker[m["role"]], "value": m["content"]} for m in CONVERSATION]
    assert tokenize_conversation(qwen3, sharegpt, 10_000) == tokenize_conversation(
        qwen3, CONVERSATION, 10_000
    )


def test_truncation_cuts_ids_and_mask_together(llama3):
    full = tokenize_conversation(llama3, CONVERSATION, 10_000)
    cut = tokenize_conversation(llama3, CONVERSATION, 17)
    assert cut["input_ids"] == full["input_ids"][:17]
    assert cut["loss_mask"] == full["loss_mask"][:17]


def test_template_that_is_not_prefix_stable_is_an_error(qwen3):
    # Two assistant turns in a row: rendered alone, the first is "last" and gets a think
    # block; in the full conversation it does not, so its start cannot be located.
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "assistant", "content": "Second answer"},
    ]
    with pytest.raises(DataError, match="not prefix-stable") as err:
        assistant_spans(qwen3, messages)
    assert "\n" not in str(err.value)


def test_tokenizer_without_chat_template_is_an_error(tmp_path):
    tok = make_tokenizer_without_template(tmp_path)
    with pytest.raises(DataError, match="chat template") as err:
        tokenize_conversation(tok, CONVERSATION, 64)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- datasets


def _rows(n=3):
    rows = [{"messages": CONVERSATION, "id": i} for i in range(n)]
    rows.append({"messages": [{"role": "user", "content": "no reply"}], "id": n})
    return rows


def _write(path, rows, kind):
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
def test_load_local_file(tmp_path, kind):
    path = tmp_path / f"chat.{kind}"
    _write(path, _rows(), kind)
    ds = load_data(DataConfig(path=str(path), cache_dir=str(tmp_path / "cache")))
    assert len(ds) == 4
    assert ds[0]["messages"][2] == {"role": "assistant", "content": "Hi there"}


def test_load_directory_split_and_max_samples(tmp_path):
    _write(tmp_path / "train.jsonl", _rows(5), "jsonl")
    _write(tmp_path / "test.jsonl", _rows(1), "jsonl")
    cfg = DataConfig(path=str(tmp_path), split="test", cache_dir=str(tmp_path / "cache"))
    assert len(load_data(cfg)) == 2
    cfg = DataConfig(path=str(tmp_path), max_samples=3, cache_dir=str(tmp_path / "cache"))
    assert load_data(cfg)["id"] == [0, 1, 2]


def test_zoo_path_is_resolved(tmp_path, monkeypatch):
    import draftinfer.files.paths

    (tmp_path / "chat").mkdir()
    _write(tmp_path / "chat" / "train.jsonl", _rows(2), "jsonl")
    monkeypatch.setattr(draftinfer.files.paths, "ZOO_DIR", tmp_path)
    ds = load_data(DataConfig(path="zoo:chat", cache_dir=str(tmp_path / "cache")))
    assert len(ds) == 3


def test_sharegpt_dataset_is_normalized(tmp_path):
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    rows = [
        {
            "conversations": [
                {"from": speaker[m["role"]], "value": m["content"]} for m in CONVERSATION
            ]
        }
    ]
    _write(tmp_path / "sg.jsonl", rows, "jsonl")
    cfg = DataConfig(
        path=str(tmp_path / "sg.jsonl"),
        messages_field="conversations",
        cache_dir=str(tmp_path / "c"),
    )
    ds = load_data(cfg)
    got = [{"role": m["role"], "content": m["content"]} for m in ds[0]["conversations"]]
    assert got == CONVERSATION


def test_missing_local_path_is_an_error(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="nope.jsonl") as err:
        load_data(DataConfig(path=missing))
    assert "\n" not in str(err.value)


def test_missing_messages_column_is_an_error(tmp_path):
    _write(tmp_path / "chat.jsonl", _rows(), "jsonl")
    cfg = DataConfig(
        path=str(tmp_path / "chat.jsonl"), messages_field="dialogue", cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(DataError, match=r"no column 'dialogue'.*\['messages', 'id'\]") as err:
        load_data(cfg)
    assert "\n" not in str(err.value)


def test_tokenize_dataset_drops_rows_without_loss_tokens(qwen3):
    ds = datasets.Dataset.from_list(_rows(3))
    out = tokenize_dataset(ds, qwen3, DataConfig(path="mem", max_length=10_000))
    assert out.column_names == ["input_ids", "loss_mask", "length"]
    assert len(out) == 3  # the user-only row is dropped
    expected_ids, expected_mask = expected_from_segments(qwen3, QWEN3_SEGMENTS)
    assert out[0]["input_ids"] == expected_ids
    assert out[0]["loss_mask"] == expected_mask
    assert out["length"] == [len(expected_ids)] * 3


def test_dataset_without_assistant_turns_is_an_error(qwen3):
    ds = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}] * 2)
    with pytest.raises(DataError, match="assistant") as err:
        tokenize_dataset(ds, qwen3, DataConfig(path="users-only"))
    assert "\n" not in str(err.value) and "users-only" in str(err.value)


def test_dataset_truncated_before_any_assistant_token_is_an_error(llama3):
    ds = datasets.Dataset.from_list(_rows(2))
    with pytest.raises(DataError, match="max_length=8"):
        tokenize_dataset(ds, llama3, DataConfig(path="mem", max_length=8))
