"""What the trainer applies to a drafter from outside its model code (STYLE rule 3), in this
order, before the accelerator wraps it for data parallelism:

1. `cast_parameters`: trainable and frozen parameters to `trainer.param_dtype` (buffers such
   as RoPE frequencies and the vocabulary maps keep theirs);
2. `apply_compile` (`trainer.compile`): `torch.compile(dynamic=True)` of each decoder block
   the kind names (`TrainSpec.blocks`): norms, projections, RoPE, SwiGLU and residuals fused.
   The attention call inside is a graph break (`drafttrain.ttt.StepAttention` keeps Python
   state; its flex kernel is compiled on its own), so one compilation serves every TTT step
   and every sequence length;
3. `apply_activation_checkpointing` (`trainer.activation_checkpointing`): each block's
   forward under non-reentrant `torch.utils.checkpoint`: its activations are recomputed in
   backward instead of kept (per TTT step and per decoder layer for eagle3, since the
   objective calls each block once per step). The TTT attention is recompute-safe: a step's
   attention reads only the keys of the steps before it (`TTTAttention.at`).

Both wrap the block's `forward` on the instance, so parameter names, state dicts and
checkpoints are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter of `module` to `dtype`, in place (grads dropped)."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            p.grad = None


def apply_compile(blocks: list[nn.Module]) -> None:
    for block in blocks:
        block.forward = torch.compile(block.forward, dynamic=True)


def apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    for block in blocks:
        forward = block.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed


def apply_training_wrappers(drafter: nn.Module, blocks: list[nn.Module], tc) -> None:
    """The trainer's precision, compile and activation-checkpointing choices (module
    docstring), applied to `drafter` and its decoder `blocks`."""
    from drafttrain.optim import dtype_of

    cast_parameters(drafter, dtype_of(tc.param_dtype, "param_dtype"))
    if tc.compile:
        apply_compile(blocks)
    if tc.activation_checkpointing:
        apply_activation_checkpointing(blocks)
