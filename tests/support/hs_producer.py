"""A hidden-state producer writing files exactly as the engines do, for the engine source's
tests (`drafttrain.sources.engine`); also runnable as a process that can be killed mid-sample:

    python -m tests.support.hs_producer SRC DST --mode connector|generator [--die-at ROW]

The layouts, read from the producers' code:
- `connector`: vLLM's `ExampleHiddenStatesConnector`
  (`vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py` @015a95c8):
  opens `<file>.lock` with `O_CREAT | O_WRONLY | O_TRUNC` (0o644), takes `LOCK_EX`, writes
  `save_file({"hidden_states": [T, S, H], "token_ids": [T] int64}, <file>)` in place, then closes
  the lock fd (releasing it; the lock file stays for the reader to remove). Here `<file>` is
  `DST/hs_<row>.safetensors` (a request's `hidden_states_path` with `allow_custom_save_path`).
- `generator`: speculators 0.9.0's offline generator (`speculators/cli/generate_offline_data.py`
  `_worker`): vLLM writes `<req_id>.safetensors` as above into its storage directory, the
  generator waits for the lock (`wait_for_lock`, which removes it) and `shutil.move`s the file
  to `DST/hs_<row>.safetensors`; on a restart it keeps files that open and regenerates the rest
  (`_drop_unreadable_cached_files`).

SRC holds one `row_<i>.safetensors` per row with the tensors to write (the test derives them
from the project's own feature cache). `--die-at ROW`: the producer writes half of that row's
bytes (under the lock, as a writer killed mid-`save_file` would) and SIGKILLs itself.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import signal
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

from drafttrain.sources.engine import FILE, slot_feature


def vllm_write(path: Path, tensors: dict[str, torch.Tensor], die: bool = False) -> None:
    """`ExampleHiddenStatesConnector`'s write of one request (module docstring)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        if die:
            data = save(tensors)
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        save_file(tensors, str(path))
    finally:
        os.close(lock_fd)  # releases LOCK_EX


def readable(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt"):
            return True
    except Exception:  # noqa: BLE001
        return False


def produce(src: Path, dst: Path, mode: str, die_at: int | None = None, delay: float = 0.0):
    rows = sorted(int(p.stem.split("_")[1]) for p in src.glob("row_*.safetensors"))
    staging = dst.parent / (dst.name + ".vllm")
    for row in rows:
        final = dst / FILE.format(row)
        if final.exists() and readable(final):
            continue  # resumed: kept, as speculators' generator keeps readable files
        tensors = load_file(str(src / f"row_{row}.safetensors"))
        die = row == die_at
        if mode == "connector":
            vllm_write(final, tensors, die)
        else:
            req = staging / f"cmpl-{row:08x}-0.safetensors"
            vllm_write(req, tensors, die)
            from hs_connectors.transfer import wait_for_lock

            lock = Path(str(req) + ".lock")
            if lock.exists():
                wait_for_lock(str(lock))
            dst.mkdir(parents=True, exist_ok=True)
            shutil.move(str(req), str(final))
        time.sleep(delay)


def engine_sample(
    cache_hidden: torch.Tensor, segments: list[str], layer_ids: list[int], num_layers: int,
    tokens: list[int], dtype: torch.dtype,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The engine's tensors of one row from a feature-cache row `cache_hidden [T, S_cache*H]`:
    vLLM slot k is our `slot_feature(k)` (the rule under test elsewhere)."""
    H = cache_hidden.shape[-1] // len(segments)
    segs = cache_hidden.unflatten(-1, (len(segments), H))
    cols = [segments.index(slot_feature(k, num_layers)) for k in layer_ids]
    return {
        "hidden_states": segs[:, cols].to(dtype).contiguous(),  # [T, S, H]
        "token_ids": torch.tensor(tokens, dtype=torch.long),  # [T]
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--mode", choices=("connector", "generator"), default="connector")
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--delay", type=float, default=0.0)
    a = ap.parse_args()
    produce(a.src, a.dst, a.mode, a.die_at, a.delay)


if __name__ == "__main__":
    main()
