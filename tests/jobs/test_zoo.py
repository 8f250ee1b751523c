"""The shipped target zoo (`draftinfer/zoo/`, built by `python -m drafttrain.zoo.build_text`)
loads and is trained.

Fast (a few seconds): loads the committed assets through the public `from_pretrained`
entry points, checks the config is Llama-3.1-shaped, the chat data is split cleanly, the chat
template renders the Llama-3 format, and the model's greedy answers agree with held-out
references (a random-init model would not).
"""

from __future__ import annotations

import json

import pytest
import torch

from draftinfer.files.paths import ZOO_DIR as ZOO

MODEL = ZOO / "llama-tiny"
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
]


def _rows(split: str) -> list[dict]:
    with open(ZOO / "chat" / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m, info = AutoModelForCausalLM.from_pretrained(
        MODEL, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    return m.eval()


@pytest.fixture(scope="module")
def train_rows():
    return _rows("train")


@pytest.fixture(scope="module")
def test_rows():
    return _rows("test")


def test_config_is_llama31_shaped(model):
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.num_hidden_layers == 8  # default aux taps (2, L//2, L-3) = (2, 4, 5) are distinct
    assert cfg.head_dim == 64 and cfg.hidden_size == cfg.num_attention_heads * cfg.head_dim
    assert 1 < cfg.num_key_value_heads < cfg.num_attention_heads  # real GQA, not MHA/MQA
    assert cfg.vocab_size == 4096
    rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert rope["rope_type"] == "llama3"
    assert rope["factor"] * rope["original_max_position_embeddings"] == cfg.max_position_embeddings
    raw = json.loads((MODEL / "config.json").read_text())
    assert raw["rope_scaling"]["rope_type"] == "llama3"  # legacy key for 4.x-era loaders
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_weights_are_small_bf16_safetensors():
    from safetensors import safe_open

    path = MODEL / "model.safetensors"
    assert path.stat().st_size <= 9 * 2**20
    with safe_open(path, "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert "lm_head.weight" not in f.keys()  # tied


def test_tokenizer_specials_and_roundtrip(tok):
    from tokenizers import Tokenizer

    assert len(tok) == 4096
    assert all(tok.convert_tokens_to_ids(s) != tok.unk_token_id for s in SPECIALS)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|pad|>",
    )
    raw = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    text = "What does json.dumps do?\n\nSerialize `obj` to a JSON formatted `str`. 12345"
    assert (
        tok(text, add_special_tokens=False)["input_ids"]
        == raw.encode(text, add_special_tokens=False).ids
    )
    assert tok(text)["input_ids"][0] == tok.bos_token_id  # like Llama-3
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    gen = json.loads((MODEL / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {
        tok.convert_tokens_to_ids("<|eot_id|>"),
        tok.convert_tokens_to_ids("<|end_of_text|>"),
    }


def test_chat_template_renders_llama3_format(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello."},
    ]
    expected = (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
    )
    assert tok.apply_chat_template(msgs, tokenize=False) == expected
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == expected[: expected.index("Hello.")]
    ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    assert ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[-1] == tok.eos_token_id


def test_chat_data_is_well_formed_and_split(train_rows, test_rows):
    assert 8000 <= len(train_rows) <= 20000 and 200 <= len(test_rows) <= 400
    for r in train_rows + test_rows:
        roles = [m["role"] for m in r["messages"]]
        body = roles[1:] if roles[0] == "system" else roles
        assert body and body == ["user", "assistant"] * (len(body) // 2), roles
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in r["messages"])
    assert any(len(r["messages"]) >= 4 and r["messages"][-4]["role"] == "user" for r in train_rows)
    train_prompts = {m["content"] for r in train_rows for m in r["messages"] if m["role"] == "user"}
    test_prompts = {m["content"] for r in test_rows for m in r["messages"] if m["role"] == "user"}
    assert not train_prompts & test_prompts
    size = sum(p.stat().st_size for p in (ZOO / "chat").glob("*.jsonl"))
    assert size <= 6 * 2**20


# Held-out prompts whose answers open with a fixed template.
FIXED_PROMPTS = [
    "What is the signature of mailbox.Mailbox.keys?",
    "What does numbers.Rational inherit from?",
]


@torch.no_grad()
def test_model_is_trained(tok, model, test_rows):
    """Greedy next token at the end of fixed held-out prompts is the reference answer's first
    token, and teacher-forced greedy accuracy on held-out answers is high (a random-init
    model scores ~1/4096 on both). One right-padded forward: with a causal mask no real token
    attends to the padding, so no attention mask is needed."""
    by_prompt = {r["messages"][-2]["content"]: r["messages"] for r in test_rows}
    convs = [by_prompt[p] for p in FIXED_PROMPTS] + [r["messages"] for r in test_rows[:16]]
    seqs, spans = [], []
    for msgs in convs:
        prompt = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        answer = tok(msgs[-1]["content"], add_special_tokens=False)["input_ids"] + [
            tok.eos_token_id
        ]
        seqs.append(prompt + answer)
        spans.append((len(prompt), len(answer)))
    ids = torch.full((len(seqs), max(map(len, seqs))), tok.pad_token_id)  # [B, T]
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    pred = model(input_ids=ids).logits.argmax(-1)  # [B, T]: greedy token for position t + 1
    correct = total = 0
    for i, (p, n) in enumerate(spans):
        hit = pred[i, p - 1 : p - 1 + n] == ids[i, p : p + n]  # [n]
        if i < len(FIXED_PROMPTS):
            assert hit[0], (FIXED_PROMPTS[i], tok.decode(pred[i, p - 1 : p - 1 + n]))
        correct += hit.sum().item()
        total += n
    # Shipped model: 0.54 on these rows (0.58 on the whole test split); random init: ~0.0002.
    assert correct / total > 0.4, correct / total
