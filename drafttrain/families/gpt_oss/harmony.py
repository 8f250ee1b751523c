"""The harmony chat format of gpt-oss (REFERENCES A5), as the chat template training renders
with: the released `chat_template.jinja`'s layout for system, developer, user and assistant
messages, with the date pinned.

What a conversation renders to:

    <|start|>system<|message|>{identity}\\nKnowledge cutoff: 2024-06\\nCurrent date: {date}\\n\\n
        Reasoning: {effort}\\n\\n# Valid channels: analysis, commentary, final. Channel must be
        included for every message.<|end|>
    [<|start|>developer<|message|># Instructions\\n\\n{system content}\\n\\n<|end|>]
                                                 for a non-empty first system (or developer) message
    <|start|>user<|message|>{content}<|end|>
    <|start|>assistant<|channel|>final<|message|>{content}<|end|>          earlier assistant turns
    ...
    [<|start|>assistant<|channel|>analysis<|message|>{thinking}<|end|>]   the last message only,
    <|start|>assistant<|channel|>final<|message|>{content}<|return|>       when it is an assistant's

and the generation prompt is `<|start|>assistant` (the model writes the channel itself).

- **The date is pinned** (`PINNED_DATE`): the release stamps `strftime_now("%Y-%m-%d")`, which
  changes the prompt tokens every day, so cached features and tokenized data would go stale
  overnight. Render kwargs `current_date`, `reasoning_effort` and `model_identity` override the
  defaults, as the release's `reasoning_effort` / `model_identity` do.
- **`Reasoning: low`** by default (SpecForge's `HarmonyParser` default; the release's is medium).
- **Thinking.** The analysis message is the assistant message's `thinking` field (the release's
  name) or, when that is absent, its `reasoning_content` (the name Qwen3 / OpenAI-style data
  uses). It is rendered for the conversation's last message only (earlier turns' thinking is
  dropped, as the release drops it: "CoT is dropped during all previous turns"). A message
  without either field renders no analysis message at all, as the release does; an empty
  string renders an empty one (`<|channel|>analysis<|message|><|end|>`).
- Tools (`tool_calls`, `tool` messages) are not rendered: conversations with them are an error
  naming the target's own template (which renders them) as the way to train on them.

What the loss mask covers follows from the template and `drafttrain.data.chat`'s rule: an
assistant turn's span starts after the generation prompt `<|start|>assistant` and runs through
the marker closing the turn (`<|return|>` for the last message, `<|end|>` for earlier ones), so
`<|channel|>`, `analysis` / `final`, `<|message|>`, the thinking, the analysis' `<|end|>` and the
second `<|start|>assistant` are all trained: the target generates them (SpecForge's
`HarmonyParser` trains every token after the first `<|start|>assistant` up to the next user turn).
"""

from __future__ import annotations

import copy
import logging
import re

log = logging.getLogger(__name__)

# The release's identity line and the date every rendering carries unless told otherwise (the
# day gpt-oss was released).
RELEASE_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
PINNED_DATE = "2025-08-05"
REASONING_EFFORT = "low"

# The o200k_harmony special tokens (REFERENCES A5) the format uses, in their release order.
SPECIAL_TOKENS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)
# What generation stops on (the release's generation_config: <|return|>, <|endoftext|>, <|call|>).
STOP_TOKENS = ("<|return|>", "<|endoftext|>", "<|call|>")


def harmony_template(
    model_identity: str = RELEASE_IDENTITY,
    current_date: str = PINNED_DATE,
    reasoning_effort: str = REASONING_EFFORT,
) -> str:
    """The harmony chat template (jinja) with these defaults (module docstring)."""
    defaults = (
        "{%- if model_identity is not defined %}{%- set model_identity = "
        + repr(model_identity)
        + " %}{%- endif %}"
        "{%- if current_date is not defined %}{%- set current_date = "
        + repr(current_date)
        + " %}{%- endif %}"
        "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = "
        + repr(reasoning_effort)
        + " %}{%- endif %}"
    )
    return defaults + _BODY


_BODY = """
{#- The release's system message, its date pinned (drafttrain/families/gpt_oss/harmony.py) #}
{{- "<|start|>system<|message|>" + model_identity + "\\n" }}
{{- "Knowledge cutoff: 2024-06\\n" }}
{{- "Current date: " + current_date + "\\n\\n" }}
{{- "Reasoning: " + reasoning_effort + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{{- "<|end|>" }}
{%- if messages and messages[0].role in ("system", "developer") %}
    {%- if messages[0].content %}
        {{- "<|start|>developer<|message|># Instructions\\n\\n" + messages[0].content + "\\n\\n<|end|>" }}
    {%- endif %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" %}
        {%- if message.tool_calls is defined %}
            {{- raise_exception("this harmony template renders no tool calls: train tool conversations with the target's own chat template") }}
        {%- endif %}
        {%- if "<|channel|>" in message.content %}
            {{- raise_exception("an assistant message holds <|channel|> tags in its content: put the analysis in `thinking` and the final answer in `content`") }}
        {%- endif %}
        {%- if loop.last and not add_generation_prompt %}
            {%- if message.thinking is defined %}
                {%- set thinking = message.thinking %}
            {%- elif message.reasoning_content is defined %}
                {%- set thinking = message.reasoning_content %}
            {%- else %}
                {%- set thinking = none %}
            {%- endif %}
            {%- if thinking is not none %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- else %}
        {{- raise_exception("this harmony template renders system (first), user and assistant messages, not " + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|start|>assistant" }}
{%- endif %}
"""

# The template with the release's identity: what hub gpt-oss targets train with
# (`pinned_tokenizer`).
HARMONY_TEMPLATE = harmony_template()


def stamps_today(template: str | None) -> bool:
    """Whether a chat template renders the day it runs (the release's `strftime_now`)."""
    return bool(template) and "strftime_now" in template


def pinned_tokenizer(tokenizer):
    """`tokenizer`, or a shallow copy that renders with `HARMONY_TEMPLATE` when its own
    template stamps today's date (the released gpt-oss template does). The copy renders a chat
    conversation as the release does but for the pinned date and `Reasoning: low`; the target's
    tokenizer object itself (saved into exports) is left as it is."""
    if not stamps_today(getattr(tokenizer, "chat_template", None)):
        return tokenizer
    log.info(
        "gpt-oss: the tokenizer's chat template stamps today's date; training renders with the "
        "harmony template pinned to %s (drafttrain/families/gpt_oss/harmony.py)",
        PINNED_DATE,
    )
    pinned = copy.copy(tokenizer)
    pinned.chat_template = HARMONY_TEMPLATE
    return pinned


_ANALYSIS = re.compile(r"<\|channel\|>analysis<\|message\|>(.*?)(?:<\|end\|>|$)", re.S)
_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)", re.S)


def split_channels(text: str) -> dict[str, str]:
    """A harmony generation (what follows `<|start|>assistant`, decoded with its special
    tokens) as message fields: `thinking` = the analysis message's text (the first one),
    `content` = the final message's text ("" when the generation stopped before it). Text
    without harmony channels is the content as it is."""
    analysis, final = _ANALYSIS.search(text), _FINAL.search(text)
    if analysis is None and final is None:
        return {"content": text}
    out = {"content": final.group(1) if final else ""}
    if analysis is not None:
        out["thinking"] = analysis.group(1)
    return out
