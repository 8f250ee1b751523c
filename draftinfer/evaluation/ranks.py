"""The runner's ranks under tensor parallel (`tp=N`, `draftinfer.models.tensor_parallel`): one
process per rank, started torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment; LOCAL_RANK picks the GPU). Every rank loads the same target and shards it, loads
the same drafter whole, and runs the same rounds: their collectives leave bitwise-equal logits
on every rank, so every rank samples the same tokens and takes the same branches. Rank 0 alone
writes (the report, the plot, the progress bar).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from draftinfer.files.errors import ConfigError


def join_ranks(tp: int, device: torch.device) -> torch.device:
    """Join the world of `tp` ranks (initialising the default process group from the
    environment unless the caller did: gloo on the CPU, NCCL on CUDA) and return this rank's
    device (`cuda:LOCAL_RANK` on CUDA). `tp=1`: `device` as it is, no process group. One-line
    `ConfigError`s for a world that is not `tp` processes."""
    if tp == 1:
        return device
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError(
                f"tp={tp} runs one process per rank: start it with torchrun "
                f"(torchrun --nproc-per-node {tp} -m draftinfer tp={tp} ...)"
            )
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise ConfigError(f"tp={tp} needs {tp} processes, torchrun started {world}")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    elif dist.get_world_size() != tp:
        raise ConfigError(
            f"tp={tp} needs {tp} processes, the process group has {dist.get_world_size()}"
        )
    elif device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def is_writer() -> bool:
    """Whether this process writes what a run writes: rank 0, or the only process."""
    return not dist.is_initialized() or dist.get_rank() == 0


def leave_ranks() -> None:
    """Tear down the process group `join_ranks` joined, if any (the end of a `tp > 1` run)."""
    if dist.is_initialized():
        dist.destroy_process_group()
