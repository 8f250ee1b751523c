"""The shipped MoE zoo targets (`draftinfer/zoo/gpt-oss-tiny`, `qwen3-moe-tiny`, built by
`python -m drafttrain.zoo.build_moe`) load with transformers and were trained.

Fast (seconds): the configs are the real architectures' at toy scale, the weights small bf16
safetensors, the tokenizers carry the chat formats the targets were trained on, the shipped
harmony chat is a pure function of the zoo chat, the training side's loss mask on a shipped
row is what the target was trained to write, and the models answer held-out prompts in their
format with a teacher-forced accuracy a random model would not reach.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftinfer.files.paths import ZOO_DIR, resolve_path
from drafttrain.data import tokenize_conversation
from drafttrain.families.gpt_oss.harmony import PINNED_DATE, SPECIAL_TOKENS
from drafttrain.zoo import text_data, text_train
from drafttrain.zoo.moe_targets import GPT_OSS, QWEN3_MOE, SLIDING_WINDOW, with_analysis

SPECS = {"gpt-oss-tiny": GPT_OSS, "qwen3-moe-tiny": QWEN3_MOE}


@pytest.fixture(scope="module", params=sorted(SPECS))
def zoo(request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = SPECS[request.param]
    path = resolve_path(f"zoo:{spec.model_dir}")
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    rows = text_data.read_jsonl(ZOO_DIR / spec.data_dir / "test.jsonl")
    return spec, model.eval(), AutoTokenizer.from_pretrained(path), rows


def test_configs_are_the_architectures_at_toy_scale(zoo):
    spec, model, tok, _ = zoo
    cfg = model.config
    assert cfg.num_hidden_layers == 8  # default aux taps (2, 4, 5) distinct
    assert cfg.hidden_size == 256 and cfg.head_dim == 64 and cfg.num_attention_heads == 4
    assert cfg.num_experts_per_tok == 2 and cfg.vocab_size == len(tok) == 4096
    assert not cfg.tie_word_embeddings
    if spec is GPT_OSS:
        assert cfg.model_type == "gpt_oss" and cfg.num_local_experts == 8
        assert cfg.sliding_window == SLIDING_WINDOW
        assert cfg.layer_types[:2] == ["sliding_attention", "full_attention"]
        rope = cfg.rope_parameters
        assert rope["rope_type"] == "yarn" and rope["truncate"] is False
        assert rope["factor"] * rope["original_max_position_embeddings"] == 2048
        assert model.model.layers[0].self_attn.sinks.shape == (4,)
    else:
        assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 8 and cfg.norm_topk_prob
        assert cfg.mlp_only_layers == [] and cfg.decoder_sparse_step == 1


def test_weights_are_small_bf16_safetensors(zoo):
    from safetensors import safe_open

    spec = zoo[0]
    path = ZOO_DIR / spec.model_dir / "model.safetensors"
    assert path.stat().st_size <= 10 * 2**20
    with safe_open(path, "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert "lm_head.weight" in f.keys()  # untied, as the releases


def test_tokenizer_and_generation_config(zoo):
    spec, _, tok, _ = zoo
    for s in spec.specials:
        assert tok.convert_tokens_to_ids(s) != tok.unk_token_id
    assert tok("x y")["input_ids"] == tok("x y", add_special_tokens=False)["input_ids"]  # no BOS
    gen = json.loads((ZOO_DIR / spec.model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids(t) for t in spec.stop_tokens]
    assert tok.eos_token == spec.eos and tok.pad_token == spec.pad


def test_gpt_oss_chat_is_the_zoo_chat_with_an_analysis():
    chat = text_data.read_jsonl(ZOO_DIR / "chat" / "test.jsonl")
    harmony = text_data.read_jsonl(ZOO_DIR / "chat_harmony" / "test.jsonl")
    assert harmony == with_analysis(chat)
    assert all("thinking" in r["messages"][-1] for r in harmony)
    assert set(SPECIAL_TOKENS) <= set(GPT_OSS.specials)


def test_loss_mask_of_a_shipped_row_is_what_the_target_writes(zoo):
    spec, _, tok, rows = zoo
    row = rows[0]["messages"]
    enc = tokenize_conversation(tok, row, 4096)
    written = tok.decode([t for t, m in zip(enc["input_ids"], enc["loss_mask"]) if m])
    answer = row[-1]["content"]
    if spec is GPT_OSS:
        text = tok.apply_chat_template(row, tokenize=False)
        assert f"Current date: {PINNED_DATE}\n" in text and "Reasoning: low\n" in text
        assert written.endswith(
            f"<|channel|>analysis<|message|>{row[-1]['thinking']}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{answer}<|return|>"
        )
    else:
        assert written.endswith(f"<think>\n\n</think>\n\n{answer}<|im_end|>")


def test_trained_target_answers_in_its_format(zoo):
    """Teacher-forced next-token accuracy on held-out answers (a random model: ~0), and a
    greedy answer that closes in the format's stop token (harmony: both channels)."""
    spec, model, tok, rows = zoo
    examples = [tokenize_conversation(tok, r["messages"], 4096) for r in rows[:16]]
    ex = [(e["input_ids"], e["loss_mask"]) for e in examples]
    scored = text_train.evaluate(model, ex, tok.pad_token_id)
    assert scored["acc"] > 0.5, scored  # shipped builds: gpt-oss 0.71, Qwen3-MoE 0.57
    stop_ids = [tok.convert_tokens_to_ids(t) for t in spec.stop_tokens]
    (gen,) = text_train.generate_answers(model, tok, rows[:1], 64, stop_ids, spec.answer)
    assert gen["ends_with_eot"], gen
    if spec is GPT_OSS:
        assert gen["generated"].startswith("<|channel|>analysis<|message|>"), gen
        assert "<|start|>assistant<|channel|>final<|message|>" in gen["generated"], gen
    else:
        assert gen["generated"].startswith("<think>\n\n</think>\n\n"), gen


def test_build_logs_record_the_builds():
    for spec in SPECS.values():
        log = json.loads((ZOO_DIR / f"build_log_{spec.family}.json").read_text())
        assert log["command"].startswith("python -m drafttrain.zoo.build_moe")
        assert log["losses"][-1] < 0.5 * log["losses"][0]
        # Routing spread over the experts in every layer (the load-balancing term balances the
        # layers' sum, as transformers computes it, so a layer may starve an expert or two).
        for shares in log["expert_load"]["per_layer"]:
            assert max(shares) < 0.5 and sum(x >= 0.01 for x in shares) >= 6, shares
