"""Resolve the `zoo:<name>` shorthand to the assets shipped under the repository's `zoo/`.

The target zoo (DESIGN section 5) is a small trained target and its chat data, rebuilt by
`scripts/build_zoo.py` and committed, so offline runs have a target that actually learned
something. Any other string is returned unchanged (a hub id or a local path).
"""

from __future__ import annotations

from pathlib import Path

ZOO_PREFIX = "zoo:"
ZOO_DIR = Path(__file__).resolve().parents[1] / "zoo"


def resolve_path(name_or_path: str) -> str:
    """`zoo:llama-tiny` -> `<repo>/zoo/llama-tiny`; anything else unchanged."""
    if name_or_path.startswith(ZOO_PREFIX):
        return str(ZOO_DIR / name_or_path[len(ZOO_PREFIX) :])
    return name_or_path
