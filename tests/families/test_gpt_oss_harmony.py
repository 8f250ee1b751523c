"""R2 on gpt-oss's harmony format: the assistant-only loss mask, token by token, covers
everything the target generates after `<|start|>assistant` (both channels, their headers, the
closing `<|end|>` / `<|return|>`), and nothing of the system, developer or user messages; the
template renders as the release does with the date pinned.

Two oracles, both independent of `drafttrain.data.chat`: the conversation written out literally
as generated / not generated segments (`tests.support.chat_masks`), and SpecForge's
`HarmonyParser` rule applied to the rendered text (every character after the first
`<|start|>assistant` of a turn up to the next `<|start|>user<|message|>`, REFERENCES A5).
"""

from __future__ import annotations

import re

import pytest

from drafttrain.data import assistant_spans, tokenize_conversation
from drafttrain.data.chat import TurnEnds, end_of_turn_markers
from drafttrain.families.gpt_oss.harmony import (
    HARMONY_TEMPLATE,
    PINNED_DATE,
    RELEASE_IDENTITY,
    harmony_template,
    pinned_tokenizer,
    split_channels,
    stamps_today,
)
from drafttrain.jobs.errors import DataError
from drafttrain.registry import train_family
from tests.support.chat_masks import assert_mask_matches
from tests.support.tiny_tokenizers import make_harmony_tokenizer

SYSTEM_BLOCK = (
    f"<|start|>system<|message|>{RELEASE_IDENTITY}\nKnowledge cutoff: 2024-06\n"
    f"Current date: {PINNED_DATE}\n\nReasoning: low\n\n# Valid channels: analysis, "
    "commentary, final. Channel must be included for every message.<|end|>"
)
DEVELOPER = "<|start|>developer<|message|># Instructions\n\nYou are a helpful model.\n\n<|end|>"
CONVERSATION = [
    {"role": "system", "content": "You are a helpful model."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there", "thinking": "greet them"},
    {"role": "user", "content": "Second question"},
    {"role": "assistant", "content": "Second answer", "thinking": "Let me see"},
]
PROMPT_1 = SYSTEM_BLOCK + DEVELOPER + "<|start|>user<|message|>Hello<|end|><|start|>assistant"
MIDDLE = "<|start|>user<|message|>Second question<|end|><|start|>assistant"
SEGMENTS = [
    (PROMPT_1, 0),
    # An earlier turn: the final channel only (its thinking is dropped), closed by <|end|>.
    ("<|channel|>final<|message|>Hi there<|end|>", 1),
    (MIDDLE, 0),
    # The last turn: both channels, the second header and <|return|> are generated.
    (
        "<|channel|>analysis<|message|>Let me see<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Second answer<|return|>",
        1,
    ),
]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    return make_harmony_tokenizer(tmp_path_factory.mktemp("harmony"))


def specforge_spans(text: str) -> list[tuple[int, int]]:
    """SpecForge's `HarmonyParser` rule on rendered text: after the first `<|start|>assistant`
    following each user message, up to the next `<|start|>user<|message|>` (or the end)."""
    spans = []
    for user in re.finditer(re.escape("<|start|>user<|message|>"), text):
        opener = text.find("<|start|>assistant", user.end())
        if opener < 0:
            continue
        start = opener + len("<|start|>assistant")
        nxt = text.find("<|start|>user<|message|>", start)
        spans.append((start, len(text) if nxt < 0 else nxt))
    return spans


def test_markers_are_probed_from_the_template(harmony):
    assert end_of_turn_markers(harmony) == TurnEnds(last="<|return|>", earlier="<|end|>")


def test_mask_covers_both_channels_and_their_headers(harmony):
    assert_mask_matches(harmony, CONVERSATION, SEGMENTS)


def test_mask_equals_specforge_harmony_parser_rule(harmony):
    convs = [
        CONVERSATION,
        [m for m in CONVERSATION if m["role"] != "system"],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        CONVERSATION[:3] + [{"role": "user", "content": "c"}, {"role": "assistant", "content": ""}],
    ]
    for conv in convs:
        text, spans = assistant_spans(harmony, conv)
        assert spans == specforge_spans(text), text


def test_without_thinking_no_analysis_message_is_rendered(harmony):
    conv = [{k: v for k, v in m.items() if k != "thinking"} for m in CONVERSATION]
    segments = SEGMENTS[:3] + [("<|channel|>final<|message|>Second answer<|return|>", 1)]
    assert_mask_matches(harmony, conv, segments)


def test_reasoning_content_is_the_analysis_when_thinking_is_absent(harmony):
    conv = [dict(m) for m in CONVERSATION]
    conv[-1]["reasoning_content"] = conv[-1].pop("thinking")
    assert_mask_matches(harmony, conv, SEGMENTS)


def test_empty_thinking_renders_an_empty_analysis_message(harmony):
    conv = [dict(m) for m in CONVERSATION]
    conv[-1]["thinking"] = ""
    segments = SEGMENTS[:3] + [
        (
            "<|channel|>analysis<|message|><|end|>"
            "<|start|>assistant<|channel|>final<|message|>Second answer<|return|>",
            1,
        )
    ]
    assert_mask_matches(harmony, conv, segments)


def test_answer_words_inside_the_thinking_do_not_cut_the_turn(harmony):
    """The answer is searched after the thinking: an analysis that quotes the answer (and an
    earlier turn's dropped thinking that quotes a later answer) leave the spans whole."""
    conv = [dict(m) for m in CONVERSATION]
    conv[2]["thinking"] = "Second answer"  # dropped (earlier turn), quotes the last answer
    conv[-1]["thinking"] = "Second answer is right"
    segments = SEGMENTS[:3] + [
        (
            "<|channel|>analysis<|message|>Second answer is right<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Second answer<|return|>",
            1,
        )
    ]
    assert_mask_matches(harmony, conv, segments)


def test_empty_final_answer_after_thinking(harmony):
    conv = CONVERSATION[:4] + [{"role": "assistant", "content": "", "thinking": "Let me see"}]
    segments = SEGMENTS[:3] + [
        (
            "<|channel|>analysis<|message|>Let me see<|end|>"
            "<|start|>assistant<|channel|>final<|message|><|return|>",
            1,
        )
    ]
    assert_mask_matches(harmony, conv, segments)


def test_generation_prompt_and_multi_turn_prefix(harmony):
    prompt = harmony.apply_chat_template(
        CONVERSATION[:4], tokenize=False, add_generation_prompt=True
    )
    assert prompt == PROMPT_1 + "<|channel|>final<|message|>Hi there<|end|>" + MIDDLE
    ids = tokenize_conversation(harmony, CONVERSATION, 10_000)["input_ids"]
    assert (
        ids[: len(harmony(prompt, add_special_tokens=False)["input_ids"])]
        == harmony(prompt, add_special_tokens=False)["input_ids"]
    )  # a served prompt is a prefix of the trained conversation, token for token


def test_date_is_pinned_and_overridable(harmony):
    text = harmony.apply_chat_template(CONVERSATION[1:3], tokenize=False)
    assert f"Current date: {PINNED_DATE}\n" in text and "Reasoning: low\n" in text
    other = harmony.apply_chat_template(
        CONVERSATION[1:3], tokenize=False, current_date="2026-01-02", reasoning_effort="high"
    )
    assert "Current date: 2026-01-02\n" in other and "Reasoning: high\n" in other
    assert harmony_template(model_identity="X.", current_date="D").count("'D'") == 1


@pytest.mark.parametrize(
    ("message", "needle"),
    [
        ({"role": "assistant", "content": "<|channel|>final<|message|>x"}, "<|channel|> tags"),
        ({"role": "tool", "content": "42"}, "not tool"),
        ({"role": "assistant", "content": "x", "tool_calls": [{"name": "f"}]}, "no tool calls"),
    ],
)
def test_what_the_template_does_not_render_is_an_error(harmony, message, needle):
    conv = [{"role": "user", "content": "q"}, message]
    with pytest.raises(Exception, match=re.escape(needle)):
        harmony.apply_chat_template(conv, tokenize=False)


# A release-like template: the day's date from `strftime_now`, as gpt-oss's chat_template.jinja.
DATED = HARMONY_TEMPLATE.replace("current_date + ", 'strftime_now("%Y-%m-%d") + ')


def test_a_template_that_stamps_today_is_swapped_for_the_pinned_one(harmony, tmp_path):
    assert not stamps_today(HARMONY_TEMPLATE) and stamps_today(DATED)
    dated = make_harmony_tokenizer(tmp_path / "dated")
    dated.chat_template = DATED
    pinned = pinned_tokenizer(dated)
    assert pinned is not dated and pinned.chat_template == HARMONY_TEMPLATE
    assert dated.chat_template == DATED  # the target's tokenizer (saved into exports) untouched
    assert pinned_tokenizer(harmony) is harmony
    # The family's data adapter renders with it: today's date never reaches the tokens.
    adapter = train_family("gpt_oss").data("unused", dated)
    text, _ = assistant_spans(adapter.tokenizer, CONVERSATION)
    assert text == "".join(s for s, _ in SEGMENTS)


def test_a_template_without_a_special_turn_closer_is_an_error(tmp_path):
    """A template whose earlier turns end neither like its last turn nor with a special token
    leaves the span end undefined: one line, naming what it saw."""
    tok = make_harmony_tokenizer(tmp_path / "odd")
    tok.chat_template = (
        "{%- for m in messages -%}{{- m.role + ': ' + m.content -}}"
        "{%- if m.role == 'assistant' and loop.last -%}<|return|>{%- else -%}\n{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}assistant: {%- endif -%}"
    )
    with pytest.raises(DataError, match="closes an earlier assistant turn"):
        end_of_turn_markers(tok)


def test_split_channels_inverts_the_last_turns_rendering():
    body = (
        "<|channel|>analysis<|message|>Let me see<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Second answer"
    )
    assert split_channels(body) == {"thinking": "Let me see", "content": "Second answer"}
    assert split_channels("<|channel|>final<|message|>x<|return|>") == {"content": "x"}
    stopped = "<|channel|>analysis<|message|>still thinking"  # max_new_tokens reached
    assert split_channels(stopped) == {"thinking": "still thinking", "content": ""}
    assert split_channels("plain text") == {"content": "plain text"}


class HarmonyBackend:
    """Answers every prompt with an analysis and a final message, then `<|return|>`."""

    def __init__(self, tok):
        self.tok, self.prompts = tok, []
        self.stop_ids = [tok.convert_tokens_to_ids("<|return|>")]

    def generate(self, prompts, params, max_new_tokens):
        out = []
        for p in prompts:
            self.prompts.append(self.tok.decode(p))
            k = len(self.prompts)
            text = (
                f"<|channel|>analysis<|message|>think {k}<|end|>"
                f"<|start|>assistant<|channel|>final<|message|>answer {k}"
            )
            out.append((self.tok.encode(text, add_special_tokens=False) + self.stop_ids, "stop"))
        return out


def test_regenerated_harmony_answers_train_as_the_target_wrote_them(harmony):
    """Regeneration through the family: the target's channels become `thinking` / `content`,
    the next turn's prompt holds the earlier answer's final channel only (as harmony serves
    it), and the regenerated row's loss mask covers exactly what the backend generated."""
    from drafttrain.regenerate.config import RegenerateConfig
    from drafttrain.regenerate.job import regenerate_rows

    family = train_family("gpt_oss")
    backend = HarmonyBackend(harmony)
    cfg = RegenerateConfig(max_new_tokens=32)
    (res,), _ = regenerate_rows(
        [CONVERSATION], [0], harmony, backend, cfg, 512, message=family.assistant_message
    )
    msgs = res[1]
    assert msgs[2] == {"role": "assistant", "thinking": "think 1", "content": "answer 1"}
    assert msgs[4] == {"role": "assistant", "thinking": "think 2", "content": "answer 2"}
    assert backend.prompts[1].endswith(
        "<|start|>assistant<|channel|>final<|message|>answer 1<|end|>" + MIDDLE
    )
    text, spans = assistant_spans(harmony, msgs)
    assert text[spans[-1][0] : spans[-1][1]] == (
        "<|channel|>analysis<|message|>think 2<|end|>"
        "<|start|>assistant<|channel|>final<|message|>answer 2<|return|>"
    )
