"""The shipped GLM-4.5 zoo target (`draftinfer/zoo/glm-tiny`, built by
`python -m drafttrain.zoo.build_moe --family glm4_moe`): GLM-4.5's anatomy at toy scale
(GQA with partial rotary, the q/k norm, q/k/v biases, grouped sigmoid routing with the
correction bias, a shared expert, a dense first layer), trained, with its own MTP layer trained
jointly and shipped where GLM ships it, which the runner reads and serves as released
(lossless, drafts accepted).

Oracles: transformers' own `Glm4MoeForCausalLM` (loads every tensor but the MTP layer's, which
its class ignores), the files' tensors (the runner's released drafter holds them), the runner's
plain greedy decoding.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftinfer.files.paths import ZOO_DIR
from drafttrain.data import tokenize_conversation
from drafttrain.zoo import deepseek_target, glm_target, text_train
from drafttrain.zoo.moe_targets import GLM4_MOE
from tests.support.moe_targets import load_zoo_with_mtp

SPEC = GLM4_MOE
L = 8  # decoder layers: the MTP layer is model.layers.8.*
PATH = ZOO_DIR / SPEC.model_dir


@pytest.fixture(scope="module")
def zoo():
    # transformers' GLM class ignores the MTP layer; nothing else is left unread.
    return load_zoo_with_mtp(SPEC, L)


def test_config_is_glm45_at_toy_scale(zoo):
    model, tok, _ = zoo
    cfg = model.config
    assert cfg.model_type == "glm4_moe" and cfg.num_hidden_layers == L
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5  # half of each head rotates
    assert cfg.use_qk_norm and cfg.attention_bias
    assert cfg.n_shared_experts == 1 and cfg.first_k_dense_replace == 1
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.vocab_size == len(tok) == 4096 and not cfg.tie_word_embeddings
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds[0] == "Glm4MoeMLP" and set(kinds[1:]) == {"Glm4MoeMoE"}
    biases = [r.e_score_correction_bias for r in deepseek_target.routers(model)]
    assert len(biases) == L - 1 and all(b.abs().max() > 0 for b in biases)  # balancer moved


def test_shipped_mtp_layer_is_in_glms_layout_and_read_by_the_runner():
    """The MTP layer under GLM's released names (what vLLM's `glm4_moe_mtp` loads), and the
    runner's released drafter (`drafter=native`) holds exactly those tensors."""
    from safetensors import safe_open

    from draftinfer.files.checkpoint import load_released_drafter
    from draftinfer.files.loading import load_native_target

    file = PATH / "model.safetensors"
    assert file.stat().st_size <= 10 * 2**20
    p = f"model.layers.{L}."
    with safe_open(file, "pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
        for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head"):
            assert f"{p}{name}.weight" in keys, name
        for name in ("q_proj.bias", "q_norm.weight", "k_norm.weight", "o_proj.weight"):
            assert f"{p}self_attn.{name}" in keys, name
        assert f"{p}mlp.experts.7.down_proj.weight" in keys  # experts per expert
        assert f"{p}mlp.gate.e_score_correction_bias" in keys
        assert f.get_tensor(f"{p}shared_head.head.weight").equal(f.get_tensor("lm_head.weight"))
        eh = f.get_tensor(f"{p}eh_proj.weight").float()
        gate = f.get_tensor(f"{p}mlp.experts.3.gate_proj.weight").float()
    target = load_native_target(PATH, "cpu", torch.float32, 1, 64)
    drafter, _ = load_released_drafter(PATH, target.shared_weights())
    state = drafter.state_dict()
    got_eh = [v for k, v in state.items() if k.endswith("eh_proj.weight")]
    assert len(got_eh) == 1 and got_eh[0].equal(eh)
    stacked = [v for k, v in state.items() if k.endswith("experts.gate_up_proj")]
    assert len(stacked) == 1 and stacked[0][3, : gate.shape[0]].equal(gate)


def test_loss_mask_of_a_shipped_row_is_what_the_target_writes(zoo):
    """GLM-4.5's format: the target writes the empty think block, the answer and the stop."""
    _, tok, rows = zoo
    row = rows[0]["messages"]
    enc = tokenize_conversation(tok, row, 4096)
    written = tok.decode([t for t, m in zip(enc["input_ids"], enc["loss_mask"]) if m])
    assert written.startswith("\n<think></think>\n")
    assert written.endswith(f"{row[-1]['content'].strip()}{glm_target.EOS}")
    text = tok.apply_chat_template(row, tokenize=False)
    assert text.startswith(glm_target.GMASK + glm_target.SOP) and glm_target.USER in text


def test_trained_target_answers_in_its_format(zoo):
    """Teacher-forced next-token accuracy on held-out answers (a random model: ~0), and the
    build log's joint training: both losses fell, the experts stayed in use."""
    model, tok, rows = zoo
    examples = [tokenize_conversation(tok, r["messages"], 4096) for r in rows[:16]]
    scored = text_train.evaluate(
        model, [(e["input_ids"], e["loss_mask"]) for e in examples], tok.pad_token_id
    )
    assert scored["acc"] > 0.4, scored
    log = json.loads((ZOO_DIR / f"build_log_{SPEC.family}.json").read_text())
    assert log["command"].startswith("python -m drafttrain.zoo.build_moe")
    assert log["metrics"]["test_generation"]["ends_with_eot"] >= 0.8, log["metrics"]
    assert log["losses"][-1] < 0.5 * log["losses"][0]
    rows = [r for r in log["log"] if "mtp_loss" in r]
    assert rows[-1]["mtp_loss"] < 0.5 * rows[0]["mtp_loss"], rows  # the MTP layer learned
    for shares in log["expert_load"]["per_layer"]:
        assert max(shares) < 0.5 and sum(x >= 0.01 for x in shares) >= 6, shares


@pytest.mark.usefixtures("one_thread")
def test_released_mtp_layer_is_served_losslessly_and_accepted(zoo):
    """`drafter=native` on the shipped target: the released layer reused K = 3 times drafts
    held-out answers; output equals plain greedy, and its drafts are accepted."""
    from draftinfer.conventions.metrics import acceptance_length
    from draftinfer.decoding.baseline import greedy_generate
    from draftinfer.decoding.engine import Request, SpecDecoder
    from draftinfer.files.checkpoint import load_released_drafter
    from draftinfer.files.loading import load_native_target

    _, tok, rows = zoo
    target = load_native_target(PATH, "cpu", torch.float32, 4, 512)
    drafter, _ = load_released_drafter(PATH, target.shared_weights())
    texts = [
        tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, tokenize=False)
        for r in rows[:4]
    ]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    eos = [tok.convert_tokens_to_ids(t) for t in SPEC.stop_tokens]
    plain = greedy_generate(target, prompts, 32, eos)
    dec = SpecDecoder(target, drafter, 3, max_batch=4, max_model_len=512)
    outs, _ = dec.generate([Request(p, max_tokens=32, stop_token_ids=tuple(eos)) for p in prompts])
    assert [o.token_ids for o in outs] == plain
    al = acceptance_length([a for o in outs for a in o.accepted])
    print(f"glm-tiny, released MTP layer reused at K=3: AL {al:.3f}")
    assert al > 1.5, al  # drafts accepted (a useless layer: ~1.0)


def test_mtp_export_config_keeps_the_legacy_rope_keys_of_the_target():
    """An MTP export's config.json is the target's (what engines read): built from
    transformers 5's `to_dict` (which keeps the partial rotary only inside `rope_parameters`),
    it still writes `partial_rotary_factor` and `rope_scaling: null` where GLM-4.5's config.json
    and the shipped one have them (engines on transformers 4 read the top-level key)."""
    from transformers import AutoConfig

    from draftinfer.kinds.mtp.config import MTPConfig

    shipped = json.loads((PATH / "config.json").read_text())
    assert shipped["partial_rotary_factor"] == 0.5 and shipped["rope_scaling"] is None
    d = AutoConfig.from_pretrained(PATH).to_dict()
    assert "partial_rotary_factor" not in d  # what the export starts from
    out = MTPConfig(n_predict=3, target_config=d).to_hf()
    assert out["partial_rotary_factor"] == 0.5 and out.get("rope_scaling") is None
    assert out["rope_theta"] == shipped["rope_theta"] and out["num_nextn_predict_layers"] == 3
