"""Offline feature cache: run the frozen target once, train from disk.

    python -m drafttrain.cache conf=<preset> [overrides]        # write (resumable)
    python -m drafttrain conf=<preset> [same overrides] data.cache=DIR   # train from it

The writer (`writer.write_cache`) stores, per token, the features the drafter kind declares
(its `FeatureSpec`) and the target's final hidden state from which its distribution is
recomputed, in sharded, checksummed safetensors with a manifest (`format`). Training reads
it through `reader.CachedTarget`, which answers the same `batch_output(batch, features)` call
as the live `FrozenTarget`, so the objectives do not know which one they got.

`data.cache` (this) and `data.cache_dir` (tokenized data and the draft vocabulary) are
different things; docs/training.md, "Offline feature cache", has the whole story.
"""

from drafttrain.cache.format import Layout, bytes_per_token, decode, encode
from drafttrain.cache.reader import CachedTarget
from drafttrain.cache.writer import write_cache
from drafttrain.errors import ConfigError
from drafttrain.target_head import TargetHead


def check_family(family, target_name: str) -> None:
    """One-line `ConfigError` for a target family the cache cannot stand in for: it stores
    per-token text features, not what a multimodal target's drafter also consumes (the vision
    embeddings scattered into the input, the `[3, T]` M-RoPE positions)."""
    if not family.feature_cache:
        raise ConfigError(
            f"the offline feature cache does not support {family.name} targets "
            f"({target_name!r}): it stores no vision embeddings or M-RoPE positions; "
            "train with the live target (data.cache=null)"
        )


__all__ = [
    "CachedTarget",
    "Layout",
    "TargetHead",
    "bytes_per_token",
    "check_family",
    "decode",
    "encode",
    "write_cache",
]
