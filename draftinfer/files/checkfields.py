"""Reading `config.json` fields strictly: a missing field is a one-line `CheckpointError`
naming it, never a silent default (DESIGN section 4: a defaulted `max_position_embeddings`
or `parallel_k` would serve a different drafter than the one trained)."""

from __future__ import annotations

from typing import Any

from draftinfer.files.errors import CheckpointError


def require(config: dict[str, Any], key: str, where: str) -> Any:
    if key not in config:
        raise CheckpointError(f"{where}: missing field {key!r}")
    return config[key]


def require_any(config: dict[str, Any], keys: tuple[str, ...], where: str) -> Any:
    """The first of `keys` present (engines spell some fields several ways)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise CheckpointError(f"{where}: missing field {' / '.join(repr(k) for k in keys)}")
