"""The shipped DeepSeek-V3 zoo target (`draftinfer/zoo/deepseek-tiny`, built by
`python -m drafttrain.zoo.build_moe --family deepseek_v3`): DeepSeek-V3's anatomy at toy scale,
trained, with its own MTP layer trained jointly and shipped where DeepSeek ships it, which the
runner serves as released (lossless, drafts accepted).

Oracles: transformers' own `DeepseekV3ForCausalLM` (loads every tensor but the MTP layer's,
which its class ignores), the files' tensors, the runner's plain greedy decoding, and the
balancer's rule checked on hand-made loads.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftinfer.files.paths import ZOO_DIR, resolve_path
from drafttrain.data import tokenize_conversation
from drafttrain.zoo import deepseek_target, text_train
from drafttrain.zoo.moe_targets import DEEPSEEK_V3
from tests.support.moe_targets import load_zoo_with_mtp

SPEC = DEEPSEEK_V3
L = 8  # decoder layers: the MTP layer is model.layers.8.*


@pytest.fixture(scope="module")
def zoo():
    # transformers' DeepSeek-V3 class ignores the MTP layer; nothing else is left unread.
    return load_zoo_with_mtp(SPEC, L)


def test_config_is_deepseek_v3_at_toy_scale(zoo):
    model, tok, _ = zoo
    cfg = model.config
    assert cfg.model_type == "deepseek_v3" and cfg.num_hidden_layers == L
    assert cfg.q_lora_rank and cfg.kv_lora_rank and cfg.qk_rope_head_dim  # MLA, q LoRA
    assert cfg.rope_interleave and cfg.rope_parameters["rope_type"] == "yarn"
    assert cfg.n_group > 1 and 1 <= cfg.topk_group < cfg.n_group  # group-limited routing
    assert cfg.n_shared_experts == 1 and cfg.first_k_dense_replace == 1
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.vocab_size == len(tok) == 4096 and not cfg.tie_word_embeddings
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds[0] == "DeepseekV3MLP" and set(kinds[1:]) == {"DeepseekV3MoE"}


def test_correction_bias_was_trained(zoo):
    """The auxiliary-loss-free balancer moved every MoE layer's selection bias (it starts at
    zero), by a multiple of its rate per step."""
    model = zoo[0]
    biases = [r.e_score_correction_bias for r in deepseek_target.routers(model)]
    assert len(biases) == L - 1
    for b in biases:
        assert b.abs().max() > 0 and b.std() > 0, b


def test_shipped_mtp_layer_is_in_deepseeks_layout():
    from safetensors import safe_open

    path = ZOO_DIR / SPEC.model_dir / "model.safetensors"
    assert path.stat().st_size <= 10 * 2**20
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
        p = f"model.layers.{L}."
        for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head"):
            assert f"{p}{name}.weight" in keys, name
        assert (
            f"{p}embed_tokens.weight" in keys and f"{p}self_attn.kv_a_proj_with_mqa.weight" in keys
        )
        assert f"{p}mlp.experts.7.down_proj.weight" in keys  # experts per expert
        assert f.get_tensor(f"{p}shared_head.head.weight").equal(f.get_tensor("lm_head.weight"))


def test_loss_mask_of_a_shipped_row_is_what_the_target_writes(zoo):
    _, tok, rows = zoo
    row = rows[0]["messages"]
    enc = tokenize_conversation(tok, row, 4096)
    written = tok.decode([t for t, m in zip(enc["input_ids"], enc["loss_mask"]) if m])
    assert written.endswith(f"{row[-1]['content']}{deepseek_target.EOS}")
    text = tok.apply_chat_template(row, tokenize=False)
    assert text.startswith(deepseek_target.BOS) and deepseek_target.USER in text


def test_trained_target_answers_in_its_format(zoo):
    """Teacher-forced next-token accuracy on held-out answers (a random model: ~0); the
    build's greedy answers to 48 held-out prompts mostly close with the EOS."""
    model, tok, rows = zoo
    examples = [tokenize_conversation(tok, r["messages"], 4096) for r in rows[:16]]
    ex = [(e["input_ids"], e["loss_mask"]) for e in examples]
    scored = text_train.evaluate(model, ex, tok.pad_token_id)
    assert scored["acc"] > 0.4, scored  # the shipped build: 0.459 on the 400 test rows
    log = json.loads((ZOO_DIR / f"build_log_{SPEC.family}.json").read_text())
    gen = log["metrics"]["test_generation"]
    assert gen["rows"] == 48 and gen["ends_with_eot"] >= 0.8, gen  # shipped: 0.875


def test_build_log_records_the_joint_training():
    log = json.loads((ZOO_DIR / f"build_log_{SPEC.family}.json").read_text())
    assert log["command"].startswith("python -m drafttrain.zoo.build_moe")
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
    path = resolve_path(f"zoo:{SPEC.model_dir}")
    target = load_native_target(path, "cpu", torch.float32, 4, 512)
    drafter, _ = load_released_drafter(path, target.shared_weights())
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
    print(f"deepseek-tiny, released MTP layer reused at K=3: AL {al:.3f}")
    assert al > 1.5, al  # drafts accepted (a useless layer: ~1.0)


class _Router(torch.nn.Module):
    def __init__(self, E: int):
        super().__init__()
        self.e_score_correction_bias = torch.nn.Buffer(torch.zeros(E))


def test_bias_balancer_moves_against_the_load():
    """DeepSeek-V3's rule: an overloaded expert's bias goes down by the rate, an underloaded
    one's up, one at the mean stays; the counts restart every step."""
    model = torch.nn.ModuleList([_Router(4), _Router(4)])

    class Counts:
        routers = list(model)
        counts = torch.tensor([[10.0, 2.0, 4.0, 0.0], [4.0, 4.0, 4.0, 4.0]])

        def reset(self):
            self.counts = torch.zeros_like(self.counts)

    c = Counts()
    out = deepseek_target.BiasBalancer(c, rate=0.5)(1, {})
    assert model[0].e_score_correction_bias.tolist() == [-0.5, 0.5, 0.0, 0.5]
    assert model[1].e_score_correction_bias.tolist() == [0.0] * 4
    assert out["max_expert_share"] == pytest.approx(10 / 16)
    assert c.counts.sum() == 0
