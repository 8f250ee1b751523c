"""Write an exported drafter into a copy of its target checkpoint.

    python -m drafttrain.stitch EXPORT_DIR TARGET_DIR OUT_DIR [--replace]

For drafters engines load from the target itself (multi-layer MTP modules under
`model.layers.{L+k}.*` with `num_nextn_predict_layers` in the target's `config.json`). What
is written, and how, is the drafter kind's (`DrafterSpec.stitch`); `TARGET_DIR` may be a local
directory, `zoo:<name>` or a hub id in the local cache. A target that ships MTP layers of
its own (DeepSeek-V3, GLM) is refused unless `--replace` puts the modules in their place.
"""

from __future__ import annotations

import argparse
import sys

from draftinfer.files.checkpoint import read_drafter_config
from draftinfer.files.errors import DraftError
from draftinfer.files.target_dir import resolve_checkpoint_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m drafttrain.stitch", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("export_dir")
    p.add_argument("target_dir")
    p.add_argument("out_dir")
    p.add_argument(
        "--replace",
        action="store_true",
        help="the modules take the place of the MTP layers the target ships",
    )
    a = p.parse_args(argv)
    try:
        spec, arch, _ = read_drafter_config(a.export_dir)
        out = spec.stitch(
            a.export_dir, arch, resolve_checkpoint_dir(a.target_dir), a.out_dir, a.replace
        )
    except DraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
