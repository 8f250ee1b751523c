"""Offline feature cache: run the frozen target once, train from disk.

    python -m drafttrain.cache conf=<preset> [overrides]        # write (resumable)
    python -m drafttrain conf=<preset> [same overrides] data.cache=DIR   # train from it

The writer (`drafttrain.cache.writer.write_cache`; not imported here, because it runs the job
setup of `drafttrain.jobs.setup`, which opens caches through `reader`) stores, per token, the
features the drafter kind declares (its `FeatureSpec`) and the target's final hidden state from
which its distribution is recomputed, in sharded, checksummed safetensors with a manifest
(`format`; files, manifest and resume rules are `drafttrain.trainer.shards`, shared with checkpoints
and regeneration). Training reads it through `reader.CachedTarget`, which answers the same
`batch_output(batch, features)` call as the live `FrozenTarget`, so the objectives do not know
which one they got.

`data.cache` (this) and `data.cache_dir` (tokenized data and the draft vocabulary) are
different things; docs/training.md, "Offline feature cache", has the whole story.
"""

from drafttrain.cache.format import Layout, bytes_per_token, decode, encode
from drafttrain.cache.reader import CachedTarget
from drafttrain.frozen.head import TargetHead

__all__ = ["CachedTarget", "Layout", "TargetHead", "bytes_per_token", "decode", "encode"]
