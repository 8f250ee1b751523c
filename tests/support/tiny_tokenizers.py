"""Tiny fast tokenizers with chat templates that reproduce real chat formats.

Each builder trains a byte-level BPE (about 500 tokens) on a small fixed word list with the
`tokenizers` library, wraps it as a Hugging Face fast tokenizer with our own jinja chat
template, saves it to a directory and loads it back through `AutoTokenizer.from_pretrained`,
so tests exercise the same loading path as a real hub tokenizer.

Formats reproduced (facts about the public formats; the templates are written here):

- Llama-3: per message `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`
  after one `<|begin_of_text|>`; generation prompt `<|start_header_id|>assistant<|end_header_id|>\\n\\n`.
- Qwen3: per message `<|im_start|>{role}\\n{content}<|im_end|>\\n`; generation prompt
  `<|im_start|>assistant\\n`. An assistant turn after the last user message that is the last
  message (or carries `reasoning_content`) renders `<think>\\n{reasoning}\\n</think>\\n\\n{content}`;
  earlier assistant turns render their content only.

The byte-level alphabet is part of the initial vocabulary, so any text tokenizes.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

_WORDS = (
    "Hi there Hello hello How are you I am fine thanks system user assistant answer "
    "First Second Third question reply You are a helpful model Think about it think "
    "reasoning Let me see The result is the and of to in it is that for on with as "
    "PROBE probe content message role a b c d e f g h i j k l m n o p q r s t u v w x y z "
    "0 1 2 3 4 5 6 7 8 9 . , ! ? : ; - ' \" ( ) [ ] { } \n \n\n"
).split(" ")

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Llama-3 style: one BOS, then header / content / end-of-turn per message.
LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

# Qwen3 style: the think block is rendered only for assistant turns after the last user
# message, and among those only for the final message or one that carries reasoning.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set reasoning = m['reasoning_content'] if m['reasoning_content'] is defined"
    " and m['reasoning_content'] is not none else '' -%}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + m['content'].lstrip('\\n') + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _train_bpe(special_tokens: list[str], vocab_size: int = 500) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets on the exact characters a token covers (as the real
    # Llama-3 / Qwen tokenizers do), which the loss mask relies on.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so frequent pairs merge; word order is fixed, so training is deterministic.
    corpus = [" ".join(_WORDS)] * 20 + [" ".join(reversed(_WORDS))] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _save_and_load(
    tok: Tokenizer, tmpdir: str | Path, chat_template: str | None, **special: str
) -> PreTrainedTokenizerFast:
    out = Path(tmpdir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = dict(special)
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def make_llama3_tokenizer(tmpdir: str | Path) -> PreTrainedTokenizerFast:
    """A tiny fast tokenizer with a Llama-3 format chat template, loaded back from `tmpdir`."""
    return _save_and_load(
        _train_bpe(LLAMA3_SPECIALS),
        tmpdir,
        LLAMA3_TEMPLATE,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
    )


def make_qwen3_tokenizer(tmpdir: str | Path) -> PreTrainedTokenizerFast:
    """A tiny fast tokenizer with a Qwen3 format chat template (with `<think>`), loaded back."""
    return _save_and_load(
        _train_bpe(QWEN3_SPECIALS),
        tmpdir,
        QWEN3_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


def make_tokenizer_without_template(tmpdir: str | Path) -> PreTrainedTokenizerFast:
    """A tiny fast tokenizer that has no chat template at all."""
    return _save_and_load(_train_bpe(["<|endoftext|>"]), tmpdir, None, eos_token="<|endoftext|>")


def make_harmony_tokenizer(tmpdir: str | Path) -> PreTrainedTokenizerFast:
    """A tiny fast tokenizer with gpt-oss's harmony specials and the harmony chat template
    training renders with (`drafttrain.families.gpt_oss.harmony`), loaded back. No BOS, as
    o200k_harmony; EOS `<|return|>`, pad `<|endoftext|>`."""
    from drafttrain.families.gpt_oss.harmony import HARMONY_TEMPLATE, SPECIAL_TOKENS

    return _save_and_load(
        _train_bpe(list(SPECIAL_TOKENS)),
        tmpdir,
        HARMONY_TEMPLATE,
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
    )
