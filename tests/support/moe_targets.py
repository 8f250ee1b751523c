"""Tiny MoE targets for the training side's family tests: a random gpt-oss or Qwen3-MoE
(`tests.support.moe_models`, saved and loaded back through `from_pretrained`) with a chat
tokenizer of its format (harmony, Qwen3) and patterned chat data, so a drafter has something
to learn; and whether the runner's registry knows a family yet (the native MoE families are
another branch's: tests that need the architecture lookup skip, naming it, until it lands)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

# Patterned answers (as `tiny_models.write_counting_chat`), with an analysis message on the
# answers of gpt-oss rows (harmony renders it for the last message).
_THINKING = "count up by one"


def runner_knows(family: str) -> bool:
    from draftinfer.registry import registered_families

    return family in registered_families()


def needs_runner_family(family: str):
    """Skip (with the reason) a test that selects the family by architecture
    (`draftinfer.registry.FAMILIES.for_architectures`) while the runner has no such family."""
    return pytest.mark.skipif(
        not runner_knows(family),
        reason=f"needs the runner-side {family} family (draftinfer/families/{family}/, branch "
        "moe-native) to select it by architecture",
    )


def write_chat(path: Path, n: int = 96, thinking: bool = False, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a = rng.randint(0, 5)
            answer = " ".join(str(x % 10) for x in range(a, a + rng.randint(6, 14)))
            reply = {"role": "assistant", "content": answer}
            if thinking:
                reply["thinking"] = _THINKING
            row = {"messages": [{"role": "user", "content": f"count from {a}"}, reply]}
            f.write(json.dumps(row) + "\n")
    return path


def make_moe_env(root: Path, family: str, layers: int = 8, seed: int = 0) -> dict[str, str]:
    """`{"target": dir, "data": jsonl}`: a tiny random `family` target (8 layers: the default
    taps (2, 4, 5) are distinct; gpt-oss windows of 8 keys, which the prompts cross) with its
    chat tokenizer saved beside it, and chat data in its format. `initializer_range` is raised
    so the random target's next-token distributions are peaked."""
    from tests.support.moe_models import gpt_oss_config, qwen3_moe_config
    from tests.support.tiny_models import save_tiny_target
    from tests.support.tiny_tokenizers import make_harmony_tokenizer, make_qwen3_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    if family == "gpt_oss":
        tok = make_harmony_tokenizer(root / "tok")
        cfg = gpt_oss_config(vocab_size=len(tok), layers=layers, window=8)
    elif family == "qwen3_moe":
        tok = make_qwen3_tokenizer(root / "tok")
        cfg = qwen3_moe_config(vocab_size=len(tok), layers=layers)
    else:
        raise ValueError(family)
    cfg.initializer_range = 0.2
    cfg.pad_token_id = tok.pad_token_id
    cfg.eos_token_id = tok.eos_token_id
    target = save_tiny_target(cfg, root / "target", seed=seed)
    tok.save_pretrained(str(target))
    data = write_chat(root / "chat.jsonl", thinking=family == "gpt_oss")
    return {"target": str(target), "data": str(data)}


def hf_hidden_states(
    target_dir: str, ids: torch.Tensor, attention_mask: torch.Tensor, attn: str = "eager"
):
    """transformers' own `output_hidden_states` of the target, a fresh model from disk run
    with attention implementation `attn` (the frozen target's, so the two differ only in how
    the hidden states are read: hooks against transformers' recording)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.float32, attn_implementation=attn
    ).eval()
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=positions,
            output_hidden_states=True,
            use_cache=False,
        )
    return out.hidden_states, model.config.num_hidden_layers


def family_target(family: str, target_dir: str, **target_cfg):
    """The frozen target as `family`'s `TrainFamily` builds it (selected by name: no
    architecture lookup), on the CPU."""
    from drafttrain.jobs.config import TargetConfig
    from drafttrain.registry import train_family

    cfg = TargetConfig(name_or_path=target_dir, **target_cfg)
    return train_family(family).target(cfg, torch.device("cpu"))


def padded_batch(ids: list[list[int]], pad_id: int):
    """(input_ids [B, T], attention_mask [B, T], Slots) of right-padded rows."""
    from draftinfer.conventions.slots import Slots

    T = max(len(r) for r in ids)
    x = torch.full((len(ids), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), T), dtype=torch.long)
    for b, r in enumerate(ids):
        x[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
    pos = torch.arange(T).expand(len(ids), T)
    slots = Slots(torch.arange(len(ids)), torch.where(mask.bool(), pos, -1))
    return x, mask, slots


def assert_frozen_equals_native(family: str, path) -> None:
    """A padded batch of three rows, taps at the input of every layer up to 4 plus the
    post-norm final hidden: `family`'s frozen training target (HF) and the runner's native
    target of the checkpoint at `path` give the same features and logits (fp32)."""
    from draftinfer.files.loading import load_native_target
    from draftinfer.models.target import FeatureSpec
    from tests.support.native_parity import rand_ids

    frozen = family_target(family, str(path))
    native = load_native_target(path, "cpu", torch.float32, 3, 64)
    rows = [rand_ids(n, 10 + n) for n in (13, 5, 9)]
    ids, mask, slots = padded_batch(rows, 0)
    spec = FeatureSpec(layer_inputs=(0, 1, 2, 3), final_hidden="post_norm")
    a, b = frozen(ids, slots, spec), native(ids, slots, spec)
    live = mask.bool()
    diff = (a.features[live] - b.features[live]).abs().max().item()
    logit_diff = (a.logits[live] - b.logits[live]).abs().max().item()
    print(f"frozen vs native: features {diff:.2e}, logits {logit_diff:.2e}")
    torch.testing.assert_close(a.features[live], b.features[live], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.logits[live], b.logits[live], rtol=1e-5, atol=1e-5)


def split_for(family: str, env: dict[str, str], max_length: int = 256):
    """(tokenizer, tokenized training split) of `env`'s data through `family`'s data adapter."""
    from drafttrain.frozen.target import load_tokenizer
    from drafttrain.jobs.config import DataConfig
    from drafttrain.registry import train_family

    tok = load_tokenizer(env["target"])
    adapter = train_family(family).data(env["target"], tok)
    return tok, adapter.tokenize(DataConfig(path=env["data"], max_length=max_length))


def train_a_few_steps(family: str, env: dict[str, str], kind: str, tmp: Path, steps: int = 20):
    """Per-step losses of `kind`'s objective trained on one fixed batch through `family`'s own
    target and data adapter (no architecture lookup, no `train()`), AdamW at 3e-3, and the
    drafter's architecture."""
    import dataclasses

    from drafttrain.registry import InitContext, train_spec

    target = family_target(family, env["target"])
    tok, split = split_for(family, env)
    spec = train_spec(kind)
    fields = {f.name for f in dataclasses.fields(spec.config_class)}
    small = {
        "num_layers": 1,
        "draft_vocab_size": target.info.vocab_size,
        "ttt_steps": 3,
        "parallel_k": 3,
        "block_size": 4,
        "num_anchors": 16,
        "gamma": 4.0,
        "n_predict": 2,
    }
    cfg = spec.config_class(**{k: v for k, v in small.items() if k in fields})
    torch.manual_seed(0)
    drafter = spec.init_drafter(cfg, InitContext(target, tok, split.data, tmp))
    objective = spec.objective(drafter, cfg, "eager")
    batch = split.collate(list(range(4)), tok.pad_token_id)
    out = target.batch_output(batch, drafter.config.features)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(steps):
        loss, _ = objective(batch, out)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, drafter.config


def load_zoo_with_mtp(spec, n_layers: int):
    """(model, tokenizer, held-out rows) of a shipped zoo target whose MTP layer sits at
    `model.layers.{n_layers}.*`: transformers' own class loads every tensor but that layer's,
    which it ignores (asserted: nothing missing, nothing else left unread)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftinfer.files.paths import ZOO_DIR, resolve_path
    from drafttrain.zoo import text_data

    path = resolve_path(f"zoo:{spec.model_dir}")
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] and all(
        k.startswith(f"model.layers.{n_layers}.") for k in info["unexpected_keys"]
    )
    rows = text_data.read_jsonl(ZOO_DIR / spec.data_dir / "test.jsonl")
    return model.eval(), AutoTokenizer.from_pretrained(path), rows
