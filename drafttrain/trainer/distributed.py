"""Data-parallel training through `accelerate`, applied from outside the model code.

One process per device, launched by `accelerate launch` (shipped configs under
`conf/launch/accelerate/`: DDP, DeepSpeed ZeRO-2 / ZeRO-3, FSDP2), `torchrun` or `deepspeed`
(`trainer.deepspeed=<json>` picks DeepSpeed without an accelerate config), or a single plain
process. What the training loop needs from it:

- `make_accelerator(tc)`: the `Accelerator` (bf16 autocast on GPU, gloo on CPU processes);
- `ObjectiveModule`: the unit the accelerator wraps: the drafter is its only submodule and
  `forward(batch)` runs the target and the kind's objective, so DDP's gradient hooks,
  DeepSpeed's ZeRO-3 parameter gathering and FSDP2's unsharding all happen inside one
  forward whatever the kind does. The frozen target is a plain attribute: never wrapped,
  never sharded, never in the optimizer (each rank holds a replica);
- `shard_batch`: each rank's rows of the global batch (`rank::world`; what a data split keeps
  per item rather than per row, e.g. a row's images and their pixel patches, goes with its
  row), so N processes see exactly the batch one process would, and `drafttrain.objectives.losses.data_parallel` normalises the
  loss by the global counts: per-step losses match a one-process run with the same global
  batch (test: `tests/train/test_distributed.py`, two gloo processes on the CPU);
- `shards_state(accelerator)`: whether the drafter and its optimizer are sharded across ranks
  (ZeRO / FSDP), in which case checkpoints hold the engine's own state (`engine/`) and the
  full drafter is gathered on rank 0 (`full_drafter_state`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from drafttrain.jobs.config import TrainerConfig
from drafttrain.jobs.errors import ConfigError


def make_accelerator(tc: TrainerConfig, cpu: bool | None = None):
    """The run's `Accelerator`. Mixed precision `auto` = bf16 on GPU, none on CPU; with
    `trainer.deepspeed` a DeepSpeed plugin from that JSON (launchers without an accelerate
    config: `torchrun`, `deepspeed`). `cpu=True` keeps a run on the CPU where there is a GPU
    (default: the GPU when there is one)."""
    from accelerate import Accelerator

    cuda = torch.cuda.is_available() and not cpu
    mp = tc.mixed_precision
    if mp == "auto":
        mp = "bf16" if cuda else "no"
    kwargs: dict[str, Any] = {}
    if tc.deepspeed:
        from accelerate.utils import DeepSpeedPlugin

        if not os.path.isfile(tc.deepspeed):
            raise ConfigError(f"trainer.deepspeed: no such DeepSpeed config file {tc.deepspeed!r}")
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=tc.deepspeed)
    if not cuda and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # torchrun on CPUs: gloo
    accelerator = Accelerator(
        mixed_precision=mp, cpu=not cuda, gradient_accumulation_steps=tc.grad_accum, **kwargs
    )
    if tc.deepspeed and accelerator.state.deepspeed_plugin is None:
        raise ConfigError(
            f"trainer.deepspeed={tc.deepspeed!r} needs CUDA GPUs (DeepSpeed does not run under "
            "accelerate on CPUs); leave it unset here"
        )
    return accelerator


@contextmanager
def replicated_loading(accelerator) -> Iterator[None]:
    """Load models whole on every rank. With a ZeRO-3 config registered, transformers'
    `from_pretrained` builds models inside `deepspeed.zero.Init`, partitioned across ranks
    and through collectives: the frozen target would be sharded (it must be replicated) and,
    loaded by the main process first, would wait forever for the other ranks."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def shards_state(accelerator) -> bool:
    """ZeRO (any stage) or FSDP: the optimizer state (and with ZeRO-3 / FSDP the weights) live
    in shards across ranks, so only the engine can save and restore them."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)


def configure_engine(accelerator, tc: TrainerConfig, rows_per_rank: int) -> None:
    """Values DeepSpeed needs before `prepare` that the trainer config owns (its JSON may say
    `auto`): micro-batch, accumulation, clipping; ZeRO-3 gathers 16-bit weights on save."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = rows_per_rank
    ds["gradient_accumulation_steps"] = tc.grad_accum
    ds["train_batch_size"] = rows_per_rank * tc.grad_accum * accelerator.num_processes
    ds["gradient_clipping"] = tc.grad_clip if tc.grad_clip > 0 else 0.0
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True


class ObjectiveModule(nn.Module):
    """`forward(batch) -> (loss, metrics)`: the target's output for the batch, then the
    objective. The drafter is the only submodule (what the accelerator wraps and shards)."""

    def __init__(self, objective, target):
        super().__init__()
        self.drafter = objective.drafter
        self._run = (objective, target, target)  # a tuple: not registered as submodules

    def use_split(self, split: str) -> None:
        """Batches come from `split` ("train" / "eval"): a feature cache reads that part."""
        objective, base, _ = self._run
        self._run = (objective, base, base.for_split(split))

    def forward(self, batch: dict[str, torch.Tensor]):
        objective, _, target = self._run
        return objective(batch, target.batch_output(batch, objective.drafter.config.features))


def shard_batch(
    batch: dict[str, torch.Tensor], rank: int, world: int, split=None
) -> dict[str, torch.Tensor]:
    """Rows `rank::world` of a global batch: tensors with the batch as first axis are
    row-selected; the keys whose first axis is not the batch row (`split.item_keys`, e.g. a
    multimodal family's images) go with their rows through `split.shard_items(batch, rows)`
    (`drafttrain.data.batching.TokenizedSplit`). A rank left without rows gets row 0 with an
    empty loss mask: it runs the collectives and counts nothing."""
    if world == 1:
        return batch
    B = batch["input_ids"].shape[0]
    idx = torch.arange(rank, B, world, device=batch["input_ids"].device)
    empty = idx.numel() == 0
    if empty:
        idx = idx.new_zeros(1)
    item_keys = getattr(split, "item_keys", ())
    out = {k: v.index_select(0, idx) for k, v in batch.items() if k not in item_keys}
    if any(k in batch for k in item_keys):
        out.update(split.shard_items(batch, idx))
    if empty:
        out["loss_mask"] = torch.zeros_like(out["loss_mask"])
    return out


def reduce_sum(accelerator):
    """Sum a tensor over ranks (for `drafttrain.objectives.losses.data_parallel`)."""

    def f(t: torch.Tensor) -> torch.Tensor:
        return accelerator.reduce(t, reduction="sum")

    return f


def full_drafter_state(accelerator, wrapped: nn.Module, keys: set[str]) -> dict[str, torch.Tensor]:
    """The drafter's own tensors (`keys`, its `trainable_state_dict()` names) gathered from the
    shards: a collective, every rank calls it; complete on the main process."""
    sd = accelerator.get_state_dict(wrapped)
    prefix = "drafter."
    return {k[len(prefix) :]: v for k, v in (sd or {}).items() if k[len(prefix) :] in keys}
