"""Files shipped inside the installed packages, and the `zoo:<name>` shorthand.

Presets (`conf/drafttrain/`, `conf/draftinfer/`) and the target zoo (`draftinfer/zoo/`) are
package data: they are found through `importlib.resources` from wherever the package was
installed (a wheel, `pip install .`, an editable checkout), never through the current
directory or the repository layout (DESIGN 5).

The target zoo (DESIGN section 5) is a small trained target and its chat data, rebuilt by
`python -m drafttrain.zoo.build_text` / `build_vl` and committed, so offline runs have a target
that actually learned something. Any other string is returned unchanged (a hub id or a local
path).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

ZOO_PREFIX = "zoo:"


def package_dir(package: str, *parts: str) -> Path:
    """The folder `parts` shipped inside the installed `package`, as a real directory.

    Hydra and `from_pretrained` need filesystem paths, so a package imported from a zip
    archive (where `files()` is not a `Path`) is refused with a one-line error."""
    root = files(package)
    if not isinstance(root, Path):
        raise RuntimeError(
            f"{package} is installed as {root!r}, not as a directory; install it from a wheel "
            "or a checkout (pip install ...), not as a zip archive"
        )
    return root.joinpath(*parts)


ZOO_DIR = package_dir("draftinfer", "zoo")
CONF_PACKAGE = "draftconf"  # the top-level `conf/`, installed under this name (setup.py)


def conf_dir(program: str, *parts: str) -> Path:
    """The config tree `program` (`drafttrain`, `draftinfer`, `launch`) reads: `conf/<program>/`
    of the checkout, installed as `draftconf/<program>/`."""
    return package_dir(CONF_PACKAGE, program, *parts)


def resolve_path(name_or_path: str) -> str:
    """`zoo:llama-tiny` -> `<installed draftinfer>/zoo/llama-tiny`; anything else unchanged."""
    if name_or_path.startswith(ZOO_PREFIX):
        return str(ZOO_DIR / name_or_path[len(ZOO_PREFIX) :])
    return name_or_path
