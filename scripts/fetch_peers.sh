#!/usr/bin/env bash
# Fetch peer implementations used by the side-by-side benchmarks into peers/ (git-ignored:
# their code is never committed here; each keeps its own licence).
#
#   bash scripts/fetch_peers.sh                      # download from GitHub at the pinned commit
#   bash scripts/fetch_peers.sh /path/to/gpt-fast    # copy from a local clone or bare mirror
#
# gpt-fast (github.com/pytorch-labs/gpt-fast, BSD-3-Clause), commit 32971d3 (pinned below):
# model.py (the dense peer of draftbench/decode_peer.py and draftbench/round.py) and
# mixtral-moe/model.py (the MoE peer of draftbench/round.py's MoE targets), written under
# peers/gpt-fast/ with its LICENSE beside them. A local source may be a work tree or a bare/mirror git dir (the
# file is read at the pinned commit with `git show`); machines without internet (the GPU
# machine) get peers/ carried over from a machine that fetched it.
set -euo pipefail

GPT_FAST_REPO="pytorch-labs/gpt-fast"
GPT_FAST_COMMIT="32971d3129541c5bfb4f715abc33d1c5f408d204"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/peers/gpt-fast"
SRC="${1:-}"
FILES=(model.py mixtral-moe/model.py LICENSE)

mkdir -p "$DEST"
for f in "${FILES[@]}"; do
  mkdir -p "$(dirname "$DEST/$f")"
  if [[ -n "$SRC" ]]; then
    if git -C "$SRC" cat-file -e "$GPT_FAST_COMMIT:$f" 2>/dev/null; then
      git -C "$SRC" show "$GPT_FAST_COMMIT:$f" >"$DEST/$f"
    elif [[ -f "$SRC/$f" ]]; then
      cp "$SRC/$f" "$DEST/$f"
    else
      echo "fetch_peers: $SRC has neither commit $GPT_FAST_COMMIT nor $f" >&2
      exit 1
    fi
  else
    url="https://raw.githubusercontent.com/$GPT_FAST_REPO/$GPT_FAST_COMMIT/$f"
    curl -fsSL "$url" -o "$DEST/$f.tmp"
    mv "$DEST/$f.tmp" "$DEST/$f"
  fi
done
echo "$GPT_FAST_REPO@$GPT_FAST_COMMIT" >"$DEST/SOURCE"
echo "fetch_peers: gpt-fast model.py, mixtral-moe/model.py at ${GPT_FAST_COMMIT:0:7} -> ${DEST#"$ROOT"/}"
