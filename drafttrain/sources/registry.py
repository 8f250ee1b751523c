"""Feature sources: where training reads the target's features when it does not run the target.

Training asks one object for the target's output of a batch, `batch_output(batch, features)`
(`drafttrain.jobs.setup.setup_training`): the live frozen target, or a *source* standing in for
it. A source is registered here by name from its own file, with the config key that selects it,
and `setup_training` asks the registry which one (at most one) the config selects; nothing in
shared code branches on a source's name (DESIGN 2.1, STYLE rule 5).

- `cache` (`data.cache`): the offline feature cache `python -m drafttrain.cache` wrote
  (`drafttrain.cache.reader.CachedTarget.open`);
- `emitted` (`data.emitted`): samples the runner decoded with `emit_features=True`; they carry
  their own tokens, so the source replaces the training split as well;
- `engine` (`data.hidden_states.path`): hidden states a serving engine extracted: vLLM's
  `extract_hidden_states` through an hs_connectors backend, or speculators' offline generator
  (`drafttrain.sources.engine`).

A `FeatureSource` gives
- `selected(cfg)`: whether the config asks for it;
- `check(cfg)`: config-only refusals, before anything loads (one-line `ConfigError`s);
- `open(cfg, job, features)`: the stand-in for the target, checked against the config, the
  loaded target (`job.target`, of which only the head is kept afterwards), the tokenized split
  (`job.split`, which the source may replace) and the drafter's `FeatureSpec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from drafttrain.jobs.errors import ConfigError


def _no_check(cfg) -> None:
    return None


@dataclass(frozen=True)
class FeatureSource:
    name: str
    key: str  # the config key that selects it (named in errors)
    selected: Callable[[Any], bool]
    open: Callable[[Any, Any, Any], Any]  # (cfg, job, features) -> the target stand-in
    check: Callable[[Any], None] = _no_check


SOURCES: dict[str, FeatureSource] = {}


def register_source(source: FeatureSource) -> FeatureSource:
    if source.name in SOURCES:
        raise ValueError(f"feature source {source.name!r} is already registered")
    SOURCES[source.name] = source
    return source


def selected_source(cfg) -> FeatureSource | None:
    """The source `cfg` selects (None: the live target), after its config checks; a one-line
    `ConfigError` when several are set. Call it through `drafttrain.sources`, whose import
    registers the built-in sources."""
    chosen = [s for s in SOURCES.values() if s.selected(cfg)]
    if len(chosen) > 1:
        keys = " and ".join(s.key for s in chosen)
        raise ConfigError(f"{keys} are both set: train from one of them")
    if not chosen:
        return None
    chosen[0].check(cfg)
    return chosen[0]
