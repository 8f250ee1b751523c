"""The steps every text zoo build shares (`build_text`: the Llama; `build_moe`: gpt-oss and
Qwen3-MoE): writing the tokenizer and the bf16 model the way released checkpoints ship them,
reading them back from disk as a user would, scoring the reloaded model and writing the build
log. What each target *is* (its data, tokenizer, config) stays in its builder.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from drafttrain.zoo import text_train

N_EVAL_TRAIN = 400  # train rows re-scored after training (same size as the test split)
N_EXAMPLES = 8


def save_tokenizer(tok, out: Path, chat_template: str) -> None:
    """Save, then make tokenizer_config.json what the releases ship: the chat template inline
    and the class transformers 4.x and 5.x both know (5.x writes its own `TokenizersBackend`)."""
    tok.save_pretrained(out)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = chat_template
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)  # one copy of the template


def save_model(model, out: Path, generation_config) -> None:
    """bf16 safetensors + config with legacy `rope_scaling`/`rope_theta` keys beside
    transformers-5 `rope_parameters`, so 4.x-era loaders (and engines) read the same RoPE
    (`rope_scaling: null` for plain RoPE, as the releases write it; a partial rotary's
    `partial_rotary_factor` at the top level, where GLM-4.5's config.json has it)."""
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.generation_config = generation_config
    model.generation_config.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = dict(cfg["rope_parameters"])
    cfg["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    cfg["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.to(torch.float32)


def generation_config(tok, stop_tokens: list[str], bos: str | None, pad: str):
    """Greedy decoding that stops at `stop_tokens` (the first is the tokenizer's EOS)."""
    from transformers import GenerationConfig

    ids = tok.convert_tokens_to_ids
    return GenerationConfig(
        bos_token_id=ids(bos) if bos else None,
        eos_token_id=[ids(t) for t in stop_tokens],
        pad_token_id=ids(pad),
        do_sample=False,
        max_new_tokens=128,
    )


def load_shipped(mdir: Path, mtp_prefixes: tuple[str, ...] = (), **kwargs):
    """The model as written, loaded back in fp32; no missing, unexpected or mismatched key
    (but the keys under `mtp_prefixes`: MTP layers the model class does not load, e.g.
    DeepSeek-V3's `model.layers.{L}.`)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        mdir, dtype=torch.float32, output_loading_info=True, **kwargs
    )
    unexpected = {k for k in info["unexpected_keys"] if not k.startswith(mtp_prefixes)}
    if mtp_prefixes:  # every MTP layer is in the files
        assert all(any(k.startswith(p) for k in info["unexpected_keys"]) for p in mtp_prefixes)
    info = {**info, "unexpected_keys": unexpected}
    assert not any(info.values()), f"loading {mdir}: {info}"
    return model.eval()


def score(
    model,
    tok,
    train_ex: list,
    test_ex: list,
    test_rows: list[dict],
    gen_rows: int,
    stop_ids: list[int] | None = None,
    answer=None,
) -> tuple[dict, list[dict]]:
    """(metrics, example generations) of the shipped model: teacher-forced assistant-token
    loss and accuracy on `N_EVAL_TRAIN` train rows and the test rows, and greedy answers to the
    first `gen_rows` test rows (`text_train.generate_answers`)."""
    metrics = {
        "train": text_train.evaluate(model, train_ex[:N_EVAL_TRAIN], tok.pad_token_id),
        "test": text_train.evaluate(model, test_ex, tok.pad_token_id),
    }
    gen = text_train.generate_answers(
        model, tok, test_rows[:gen_rows], stop_ids=stop_ids, answer=answer
    )
    metrics["test_generation"] = {
        "rows": len(gen),
        "ends_with_eot": sum(g["ends_with_eot"] for g in gen) / max(1, len(gen)),
        "exact_match": sum(g["exact"] for g in gen) / max(1, len(gen)),
    }
    return metrics, gen[:N_EXAMPLES]


def token_counts(train_ex: list, test_ex: list) -> dict:
    """Tokens of the training and test examples (`(ids, loss_mask, ...)` each), and the
    training tokens in the loss (the assistant's)."""
    return {
        "train": sum(len(x[0]) for x in train_ex),
        "train_assistant": sum(sum(x[1]) for x in train_ex),
        "test": sum(len(x[0]) for x in test_ex),
    }


def write_report(
    path: Path,
    command: str,
    args: Any,
    targs: Any,
    shape: dict,
    n_params: int,
    rows: dict,
    tokens: dict,
    metrics: dict,
    times: dict,
    threads: int,
    examples: list[dict],
    log: list[dict],
    losses: list[float],
    **extra,
) -> dict:
    """The build log (`build_log*.json`): how the build ran and what it measured."""
    report = {
        "command": command,
        "args": {k: str(v) for k, v in vars(args).items()},
        "train_args": vars(targs),
        "shape": shape,
        "n_params": n_params,
        "rows": rows,
        "tokens": tokens,
        "metrics": metrics,
        **extra,
        "times_s": times,
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": threads,
        },
        "examples": examples,
        "log": log,
        "losses": losses,  # per optimizer step
    }
    path.write_text(json.dumps(report, indent=2) + "\n")
    return report


class Timer:
    """Seconds per build phase: `with timer("train_s"): ...` adds to `timer.times`."""

    def __init__(self):
        self.times: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.t = time.time()

            def __exit__(self, *exc):
                timer.times[name] = timer.times.get(name, 0.0) + time.time() - self.t

        return _Phase()
