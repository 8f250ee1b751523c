"""What the trainer applies to a drafter from outside its model code (STYLE rule 3), in this
order, before the accelerator wraps it for data parallelism:

0. `freeze_parameters` (`trainer.freeze`): the named parameters stop requiring gradients;
1. `cast_parameters`: trainable and frozen parameters to `trainer.param_dtype` (buffers such
   as RoPE frequencies and the vocabulary maps keep theirs);
2. `apply_compile` (`trainer.compile`): `torch.compile(dynamic=True)` of each decoder block
   the kind names (`TrainSpec.blocks`): norms, projections, RoPE, SwiGLU and residuals fused.
   The attention call inside is a graph break (`drafttrain.objectives.ttt.StepAttention` keeps Python
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


def freeze_parameters(module: nn.Module, prefixes: list[str]) -> None:
    """Parameters whose name starts with one of `prefixes` (a dotted module path or a full
    name, matched at a dot) stop requiring gradients; a one-line `ConfigError` for a prefix
    that names no parameter, or when nothing would be left to train."""
    from drafttrain.jobs.errors import ConfigError

    names = [n for n, _ in module.named_parameters()]
    for prefix in prefixes:
        if not any(n == prefix or n.startswith(prefix + ".") for n in names):
            tops = sorted({n.split(".")[0] for n in names})
            raise ConfigError(
                f"trainer.freeze: {prefix!r} names no drafter parameter "
                f"(its modules: {', '.join(tops)})"
            )
    for name, p in module.named_parameters():
        if any(name == x or name.startswith(x + ".") for x in prefixes):
            p.requires_grad_(False)
    if not any(p.requires_grad for p in module.parameters()):
        raise ConfigError(f"trainer.freeze {list(prefixes)} leaves no drafter parameter to train")


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
    from drafttrain.trainer.optim import dtype_of

    freeze_parameters(drafter, list(tc.freeze))
    cast_parameters(drafter, dtype_of(tc.param_dtype, "param_dtype"))
    if tc.compile:
        apply_compile(blocks)
    if tc.activation_checkpointing:
        apply_activation_checkpointing(blocks)
