"""`torch.compile` applied from outside the model code (STYLE rule 3), once per function.

The round's hot pieces are plain module-level functions taking the module and tensors as
arguments (`target_forward`, `cached_drafter_forward`), compiled once per process and shared
by every `SpecDecoder`: compiling a bound method per decoder would guard on each new `self`,
recompile for every decoder and, past dynamo's recompile limit, fall back to eager silently.
With `dynamic=True`, sequence lengths, draft counts and attention lengths are symbolic, so a
new K or attention bucket is not a new compile (sizes of 1 are specialised by dynamo).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from draftinfer.conventions.slots import Slots
from draftinfer.conventions.window import TokenEmbeds
from draftinfer.models.kv_cache import bind_cache
from draftinfer.models.target import FeatureSpec

_COMPILED: dict[tuple, Callable] = {}

# Inductor settings a CUDA `SpecDecoder` compiles with when it is given none
# (`compile_options=None`, the runner's `infer.compile_options: null`): inductor's combo kernels
# (independent kernels, e.g. a layer's query RoPE and its key RoPE + cache write, in one launch:
# 0.05 ms off dflash's K=7 round on an H100 in each of two processes, 2026-11-27, with
# every round GPU test passing; docs/results.md). On the CPU, inductor's own defaults. The
# tests' `--inductor NAME=VALUE` (tests/conftest.py) sets entries here, so a candidate
# default's GPU tests change the runner's compiles and nothing else (not training's).
RUNNER_CUDA_OPTIONS: dict = {"combo_kernels": True}


def runner_compile_options(options: dict | None, device) -> dict:
    """The inductor settings of a runner compile on `device`: `options` when given (`{}`:
    inductor's defaults), else `RUNNER_CUDA_OPTIONS` on CUDA and none elsewhere."""
    if options is not None:
        return dict(options)
    return dict(RUNNER_CUDA_OPTIONS) if torch.device(device).type == "cuda" else {}


def compiled(fn: Callable, **options) -> Callable:
    """`torch.compile(fn, **options)`, built once per (function, options); `options=` (the
    inductor settings dict) is part of the key. With combo kernels on, a compile that
    inductor cannot finish with them is redone without (`ComboFallback`)."""
    key = (fn, tuple(sorted((k, _frozen(v)) for k, v in options.items())))
    if key not in _COMPILED:
        if (options.get("options") or {}).get("combo_kernels"):
            _COMPILED[key] = ComboFallback(fn, options)
        else:
            _COMPILED[key] = torch.compile(fn, **options)
    return _COMPILED[key]


class ComboFallback:
    """`torch.compile(fn, **options)` with combo kernels that, when a call's compile fails in
    inductor (its combo kernels cannot take a reduction over a dynamic dimension: "Dynamic
    shape on reduction dimension is not supported", met in Qwen3-MoE's verify forward on an
    H200, torch 2.11), warns once and compiles `fn` again without them, for this and every
    later call. Only a compile error is caught (`InductorError`: raised while compiling a
    graph, before it runs; the round's compiled pieces trace as one graph each, so nothing
    of the failed call ran)."""

    def __init__(self, fn: Callable, options: dict):
        self.fn, self.options = fn, options
        self.impl = torch.compile(fn, **options)
        self.fell_back = False

    def __call__(self, *args, **kwargs):
        from torch._inductor.exc import InductorError

        try:
            return self.impl(*args, **kwargs)
        except InductorError as e:
            if self.fell_back:
                raise
            name = getattr(self.fn, "__name__", "fn")
            warnings.warn(
                f"{name}: inductor could not compile it with combo kernels "
                f"({str(e).strip().splitlines()[-1][:160]}); compiling it without them",
                stacklevel=2,
            )
            inductor = {**self.options["options"], "combo_kernels": False}
            self.impl = torch.compile(self.fn, **{**self.options, "options": inductor})
            self.fell_back = True
            return self.impl(*args, **kwargs)


def unknown_inductor_settings(names) -> list[str]:
    """Those of `names` that are not inductor settings (`torch._inductor.config`), sorted: what
    `torch.compile(options=...)` would reject only at the first compile."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    return sorted(str(n) for n in names if n not in known)


def _frozen(value):
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


_EAGER: set[Callable] = set()


def cuda_compiled_call(fn: Callable, *args):
    """`fn(*args)`: compiled (`dynamic=True`, once per function) when `args[0]` is on CUDA,
    eager elsewhere. Used for fused elementwise / reduction pieces (training's loss chunks,
    the optimizer update) whose eager form is several memory passes. A compiler failure must
    not stop training: it is reported once and `fn` runs eagerly from then on."""
    if args[0].device.type != "cuda" or fn in _EAGER:
        return fn(*args)
    try:
        return compiled(fn, dynamic=True)(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        warnings.warn(
            f"torch.compile of {fn.__name__} failed ({type(e).__name__}: {e}); eager from now on",
            stacklevel=2,
        )
        _EAGER.add(fn)
        return fn(*args)


def target_forward(
    target,
    ids: torch.Tensor,  # [B, T]
    rows: torch.Tensor,  # [B]
    cache_pos: torch.Tensor,  # [B, T]
    rope_pos: torch.Tensor,  # [B, T] / [3, B, T]
    attn_len: int,
    layer_inputs: tuple[int, ...],
    final_hidden: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target interface with plain arguments: (logits `[B, T, V]`, features)."""
    out = target(
        ids, Slots(rows, cache_pos, rope_pos, attn_len), FeatureSpec(layer_inputs, final_hidden)
    )
    return out.logits, out.features


def cached_drafter_forward(
    drafter,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    ids: torch.Tensor,  # [B, T]
    feature: torch.Tensor,  # [B, T, H] carried feature
    rope_pos: torch.Tensor,  # [B, T] / [3, B, T]
    rows: torch.Tensor,  # [B]
    cache_pos: torch.Tensor,  # [B, T]
    attn_len: int | None,
    mm: TokenEmbeds | None = None,  # multimodal rows' input embeddings (prefill only)
) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter forward through its KV cache -> (normed, pre-norm) `[B, T, H]`."""
    slots = Slots(rows, cache_pos, rope_pos, attn_len)
    return drafter(ids, feature, rope_pos, bind_cache(k_cache, v_cache, slots), mm)
