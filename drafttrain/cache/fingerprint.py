"""What a feature cache was computed from: the manifest's fingerprint, checked by training
(`data.cache=DIR`) and by a resumed write, one field at a time so a mismatch names the field.

Common fields: the target (name, a hash of its config, a hash of a sample of its weights, so
a retrained target with the same config is caught), `cache.dtype`, and the data settings that
change tokenization (`data.path`, `data.name`, `data.messages_field`, `data.max_length`, the
chat template's hash). Per split: its name and size settings, the number of samples and a
hash of every sample's token ids (catches anything else that changes tokenization: the
tokenizer's vocabulary, the data files' contents).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

from drafttrain.jobs.config import TrainConfig

# transformers writes these into a config without changing the model.
_VOLATILE = {"transformers_version", "_name_or_path", "_commit_hash", "torch_dtype", "dtype"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_sha256(config) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE}
    return _sha(json.dumps(d, sort_keys=True, default=str).encode())


def weights_sample_sha256(target) -> str:
    """sha256 of the final norm and 64 evenly spaced rows of the output embedding, rounded to
    bf16 (so a bf16 load on GPU and an fp32 load on CPU of the same checkpoint agree)."""
    head = target.model.get_output_embeddings().weight
    rows = head[:: max(1, head.shape[0] // 64)]
    parts = [rows] + ([target.final_norm.weight] if target.final_norm is not None else [])
    h = hashlib.sha256()
    for t in parts:
        h.update(t.detach().to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()


def tokens_sha256(data, rows: list[int]) -> str:
    """sha256 over the token ids of `rows` of a tokenized dataset, with their lengths."""
    h = hashlib.sha256()
    ids = data.select_columns(["input_ids"]).with_format("numpy")
    step = 1024
    for lo in range(0, len(rows), step):
        part = ids[rows[lo : lo + step]]["input_ids"]
        arrays = [np.asarray(a, dtype=np.int64) for a in part]
        h.update(np.asarray([len(a) for a in arrays], dtype=np.int64).tobytes())
        h.update(np.concatenate(arrays).tobytes() if arrays else b"")
    return h.hexdigest()


def common_fingerprint(cfg: TrainConfig, tokenizer, target) -> dict[str, Any]:
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # a dict of named templates
        template = json.dumps(template, sort_keys=True)
    d = cfg.data
    return {
        "target.name_or_path": cfg.target.name_or_path,
        "target.config_sha256": config_sha256(target.config),
        "target.weights_sample_sha256": weights_sample_sha256(target),
        "cache.dtype": cfg.cache.dtype,
        "data.path": d.path,
        "data.name": d.name,
        "data.messages_field": d.messages_field,
        "data.max_length": d.max_length,
        "tokenizer.chat_template_sha256": _sha(template.encode()),
    }


def split_fingerprint(cfg: TrainConfig, split: str, data, rows: list[int]) -> dict[str, Any]:
    """`train`: every row of `data.split`; `eval`: the rows of the batches evaluation runs
    (which `data.batch_size` and `data.eval_batches` choose)."""
    d = cfg.data
    if split == "train":
        out: dict[str, Any] = {"data.split": d.split, "data.max_samples": d.max_samples}
    else:
        out = {
            "data.eval_split": d.eval_split,
            "data.batch_size": d.batch_size,
            "data.eval_batches": d.eval_batches,
        }
    out[f"{split}.num_samples"] = len(rows)
    out[f"{split}.tokens_sha256"] = tokens_sha256(data, rows)
    return out
