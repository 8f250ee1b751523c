"""Tensor parallel for the native target over `torch.distributed`, applied from outside the
model (STYLE rule 3; torchtitan's `parallelize.py`): the model code stays single-device, a
family's plan (`FamilySpec.tensor_parallel`) rewrites a loaded target in place into this rank's
shard.

What is split, Megatron-style, over a process group of `tp` ranks (rank r holds slice r):
- attention: q/k/v projections column-split by heads (q heads `nh / tp`, KV heads
  `nkv / tp` per rank, so each rank's KV cache holds only its heads and the GQA group
  `nh / nkv` is unchanged), o projection row-split; its partial sums are all-reduced;
- the dense MLP (`SwiGLU`): gate/up column-split, down row-split, all-reduced.
Two all-reduces per decoder layer, nothing else: the embedding, the norms, RoPE and the head
stay replicated (why: `head`, below).

Why functional collectives (`torch.distributed._functional_collectives.all_reduce`) and not
DTensor: every parameter stays a plain local tensor, so the serving seams that read modules
(`torch.compile` of the round, CUDA-graph capture, checkpoint-shared weights of the drafter)
see an ordinary single-device module with fewer heads; the one distributed op is traceable
(no host sync, no graph break) and is PyTorch's, not a transport of ours.

Why the embedding and the head are replicated, not vocab-split: every rank runs the same
rounds and samples the same tokens, so each needs the full `[B, T, V]` logits; a vocab-split
head would all-gather them at every forward (and a vocab-split embedding would all-reduce
`[B, T, H]` once more), while the drafters that share the target's embedding and head
(EAGLE-3, MTP: `NativeCausalLM.shared_weights`) read them whole. The cost is their memory on
every rank (`2 V H` elements untied).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

from draftinfer.files.errors import ConfigError
from draftinfer.models.decoder import CachedAttention
from draftinfer.models.layers import SwiGLU


class RowParallelLinear(nn.Module):
    """This rank's columns of a linear layer whose input is split over `group`: the local
    product, all-reduced (sum) so that every rank gets the whole output; the bias, if any, added
    once after the sum. `weight [out, in / tp]`."""

    def __init__(self, linear: nn.Linear, cols: slice, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(linear.weight[:, cols].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in / tp] -> [..., out]
        y = funcol.all_reduce(nn.functional.linear(x, self.weight), "sum", self.group)
        return y if self.bias is None else y + self.bias


@torch.no_grad()
def column_shard(linear: nn.Linear, rows: slice) -> None:
    """Keep output rows `rows` of `linear` (weight `[out / tp, in]`, bias `[out / tp]`)."""
    linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _part(n: int, tp: int, rank: int, unit: int = 1) -> slice:
    """Rank `rank`'s slice of `n // unit` blocks of `unit` over `tp` ranks (checked divisible)."""
    per = n // tp
    return slice(rank * per * unit, (rank + 1) * per * unit)


@torch.no_grad()
def shard_attention(attn: CachedAttention, group: dist.ProcessGroup) -> None:
    """`attn` -> this rank's heads: q/k/v by heads, o by the matching input columns, all-reduced;
    `n_heads`/`n_kv` set to the local counts, so `allocate_cache` allocates only them."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if type(attn) is not CachedAttention or attn.sinks is not None:
        raise ConfigError(
            f"tensor parallel: no plan for {type(attn).__name__}"
            + (" with attention sinks" if attn.sinks is not None else "")
        )
    d = attn.head_dim
    q_rows, kv_rows = _part(attn.n_heads, tp, rank, d), _part(attn.n_kv, tp, rank, d)
    column_shard(attn.q_proj, q_rows)
    column_shard(attn.k_proj, kv_rows)
    column_shard(attn.v_proj, kv_rows)
    attn.o_proj = RowParallelLinear(attn.o_proj, q_rows, group)
    attn.n_heads, attn.n_kv = attn.n_heads // tp, attn.n_kv // tp


@torch.no_grad()
def shard_swiglu(mlp: SwiGLU, group: dist.ProcessGroup) -> None:
    """`mlp` -> this rank's intermediate slice: gate/up rows, down columns, all-reduced."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if type(mlp) is not SwiGLU:
        raise ConfigError(f"tensor parallel: no plan for the MLP {type(mlp).__name__}")
    rows = _part(mlp.gate_proj.out_features, tp, rank)
    column_shard(mlp.gate_proj, rows)
    column_shard(mlp.up_proj, rows)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, rows, group)


def check_dense_split(cfg, tp: int) -> None:
    """A one-line `ConfigError` where heads, KV heads or the MLP width do not split over `tp`."""
    for name, n in (
        ("num_attention_heads", cfg.num_heads),
        ("num_key_value_heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if n % tp:
            raise ConfigError(f"tp={tp}: {cfg.architecture}'s {name} {n} is not divisible by {tp}")


def parallelize_dense(model: nn.Module, group: dist.ProcessGroup) -> None:
    """The dense decoder's plan (`causal_lm`: Llama, Qwen2, Qwen3): every layer's attention and
    `SwiGLU` sharded over `group`; embedding, norms and head replicated. Re-allocates the KV
    cache with this rank's heads when one was set up."""
    check_dense_split(model.config, dist.get_world_size(group))
    for layer in model.model.layers:
        shard_attention(layer.self_attn, group)
        shard_swiglu(layer.mlp, group)
    if model.max_seq_len:
        model.setup_caches(model.max_batch, model.max_seq_len)


def tensor_parallel_plan(model: nn.Module, tp: int):
    """The plan of `model`'s family (`FamilySpec.tensor_parallel`); a one-line `ConfigError`
    for a family without one."""
    from draftinfer.registry import family_spec

    plan = family_spec(model.family).tensor_parallel
    if plan is None:
        raise ConfigError(
            f"tp={tp}: the {model.family} family ({model.config.architecture}) has no "
            "tensor-parallel plan (dense causal_lm targets only, for now)"
        )
    return plan


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Shard a loaded native target over `group` (default: the world) in place, by its family's
    plan (`tensor_parallel_plan`)."""
    group = group if group is not None else dist.group.WORLD
    tensor_parallel_plan(model, dist.get_world_size(group))(model, group)
