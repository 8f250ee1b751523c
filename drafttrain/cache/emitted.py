"""Runner-emitted samples as training data: what `SpecDecoder(emit_features=True)` hands back
for the sequences it decoded, written in the offline feature cache's format, so training reads
them through `CachedTarget` (`data.emitted=DIR`) exactly as it reads a cache, and runs no
target forward of its own (the online mode of docs/training.md, "Online drafters").

A sample is a decoded request: its committed tokens `prompt + output` and the runner's
`RequestOutput.features [N - 1, F]` (row i is f_i, which pairs with token i + 1, convention
1). The runner asked its target for `FeatureSpec.with_head_input()` of the drafter's spec, the
same segments the cache writer stores (`Layout.for_features`), so the columns are the layout's
segments as they are. The last committed token has no feature yet (its verify forward never
ran), so a sample holds the first `N - 1` tokens, each with its feature: the same sequence a
live target would be run on. Its loss mask is 1 on the output tokens (the answer the target
gave), 0 on the prompt.

Beside the cache's tensors (`drafttrain.cache.format`) an emitted shard holds the tokens it
was computed for, `input_ids [N]` and `loss_mask [N]` (int64, concatenated along tokens like
`hidden`), because they are the training data: no dataset is tokenized for them. The manifest
is a cache manifest whose fingerprint says `"source": "runner"` and names the target the
runner ran (`target.name_or_path`, which training's `target.name_or_path` must equal: its head
recomputes the distribution); `rope_pos` is the 1-D position `0..n-1` (a target with M-RoPE
positions is refused: the runner does not emit them). The directory is written under a
temporary name and renamed, so it either is complete or is not there.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from draftinfer.models.target import FeatureSpec
from drafttrain.cache.fingerprint import _sha
from drafttrain.cache.format import FORMAT, Layout, encode, plan_shards, shard_name
from drafttrain.jobs.errors import ConfigError, DataError
from drafttrain.trainer.shards import ShardedOutput

SOURCE = "runner"


@dataclass
class EmittedSample:
    """One decoded request: `tokens` (prompt + output, committed), `prompt_len`, and the
    runner's features of all but the last token, `[len(tokens) - 1, F]`."""

    tokens: list[int]
    prompt_len: int
    features: torch.Tensor

    @classmethod
    def of(cls, prompt: list[int], output) -> EmittedSample:
        """From a prompt and its `RequestOutput` (decoded with `emit_features=True`)."""
        if output.features is None:
            raise DataError("the runner emitted no features: decode with emit_features=True")
        return cls(list(prompt) + list(output.token_ids), len(prompt), output.features)


def is_emitted(manifest: dict[str, Any]) -> bool:
    return manifest.get("fingerprint", {}).get("source") == SOURCE


def write_emitted(
    root: str | Path,
    samples: list[EmittedSample],
    spec: FeatureSpec,
    hidden_size: int,
    target_name: str,
    rope_axes: int = 1,
    dtype: str = "float32",
    max_length: int | None = None,
    shard_tokens: int = 32768,
) -> dict[str, Any]:
    """Write `samples` (the drafter's features `spec` plus the head input, as the runner
    emits them) to `root` as a feature cache of runner samples (module docstring), each cut
    to `max_length` tokens. Returns the manifest."""
    root = Path(root)
    if rope_axes != 1:
        raise ConfigError(
            "runner-emitted training data needs a 1-D RoPE target: the runner does not emit "
            "M-RoPE positions"
        )
    layout, ask = Layout.for_features(spec, hidden_size, rope_axes, dtype)
    width = ask.width(hidden_size)
    seqs = []
    for i, s in enumerate(samples):
        n = len(s.tokens) - 1
        if tuple(s.features.shape) != (n, width):
            raise DataError(
                f"emitted sample {i}: features {tuple(s.features.shape)}, expected ({n}, {width})"
                " (the drafter's features plus the head input, one row per token but the last)"
            )
        m = n if max_length is None else min(n, max_length)
        mask = [0] * min(s.prompt_len, m) + [1] * max(0, m - s.prompt_len)
        seqs.append((s.tokens[:m], mask, s.features[:m]))
    seqs = [q for q in seqs if sum(q[1]) > 0]  # a sample with no output token trains nothing
    lengths = [len(q[0]) for q in seqs]
    plan = plan_shards(lengths, shard_tokens)
    digest = _sha(repr([q[0] for q in seqs]).encode())
    manifest = FORMAT.new(
        len(plan),
        fingerprint={"source": SOURCE, "target.name_or_path": target_name, "cache.dtype": dtype},
        layout=layout.to_dict(),
        shard_tokens=shard_tokens,
        splits={
            "train": {
                "fingerprint": {"train.num_samples": len(seqs), "train.tokens_sha256": digest},
                "num_samples": len(seqs),
                "num_tokens": sum(lengths),
                "num_shards": len(plan),
            }
        },
        info={"target_dtype": str(seqs[0][2].dtype).removeprefix("torch.") if seqs else None},
    )
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    out = ShardedOutput(tmp, FORMAT, manifest)
    S = layout.num_segments
    for j, (a, b) in enumerate(plan):
        part = seqs[a:b]
        offsets = torch.zeros(len(part) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(torch.tensor([len(q[0]) for q in part]), 0)
        tensors = {
            **encode(torch.cat([q[2] for q in part]), S, dtype),
            "rope_pos": torch.cat([torch.arange(len(q[0])) for q in part])[None].int(),
            "offsets": offsets,
            "rows": torch.arange(a, b, dtype=torch.long),
            "input_ids": torch.tensor([t for q in part for t in q[0]], dtype=torch.long),
            "loss_mask": torch.tensor([t for q in part for t in q[1]], dtype=torch.long),
        }
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        n = int(offsets[-1])
        out.commit(
            j, shard_name("train", j), save(tensors), split="train", samples=[a, b], tokens=n
        )
    out.save()
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return out.manifest
