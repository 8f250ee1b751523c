"""The project's own stored features as sources (`drafttrain.sources.registry`): the offline
feature cache (`data.cache`) and the runner's emitted samples (`data.emitted`), both read by
`drafttrain.cache.reader.CachedTarget`."""

from __future__ import annotations

from drafttrain.cache.reader import CachedTarget
from drafttrain.jobs.errors import ConfigError
from drafttrain.sources.registry import FeatureSource, register_source


def _open_emitted(cfg, job, features):
    target = CachedTarget.open_emitted(cfg, job.target, features)
    job.split = target.tokenized_split()  # the samples carry their own tokens
    return target


def _check_emitted(cfg) -> None:
    if cfg.data.eval_split:
        raise ConfigError("data.emitted holds no held-out split: set data.eval_split=null")


register_source(
    FeatureSource(
        "cache",
        "data.cache",
        lambda cfg: bool(cfg.data.cache),
        lambda cfg, job, features: CachedTarget.open(
            cfg, job.target, job.tokenizer, job.split.data, features
        ),
    )
)
register_source(
    FeatureSource(
        "emitted",
        "data.emitted",
        lambda cfg: bool(cfg.data.emitted),
        _open_emitted,
        _check_emitted,
    )
)
