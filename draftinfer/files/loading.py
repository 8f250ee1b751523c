"""Native targets from checkpoints: the class of the target family that serves the architecture
(`draftinfer.families`), its config, its safetensors weights by HF name, its static KV cache.

    model = load_native_target("path/to/llama", "cuda", torch.bfloat16, max_batch=8, max_seq_len=4096)
    out = model(input_ids, Slots(rows, cache_pos), FeatureSpec(layer_inputs=(2, 16, 29)))
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from draftinfer.files.errors import CheckpointError, ConfigError
from draftinfer.files.target_dir import (
    eos_token_ids,
    read_json,
    resolve_checkpoint_dir,
    weight_files,
)
from draftinfer.models.decoder import NativeCausalLM, NativeConfig, TensorSource
from draftinfer.registry import FAMILIES

try:  # transformers 5 validates config classes as strict dataclasses (huggingface_hub)
    from huggingface_hub.errors import StrictDataclassError

    _STRICT_ERRORS: tuple[type[Exception], ...] = (StrictDataclassError,)
except ImportError:  # an older huggingface_hub: its config errors are ValueErrors
    _STRICT_ERRORS = ()

# Checkpoint tensors that carry no weights of ours: old checkpoints saved RoPE tables.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def native_class_for(config: dict[str, Any]) -> type[NativeCausalLM]:
    """The native class of the family serving a parsed config.json; a one-line `ConfigError`
    otherwise."""
    return FAMILIES.native_class(config)


@torch.no_grad()
def load_weights(model: NativeCausalLM, files: Iterable[Path], extra_layers: int = 0) -> None:
    """Copy safetensors tensors into `model` by HF name (cast to the model's dtype/device);
    every parameter must be present, and no unknown tensor may be left over, except the
    `extra_layers` decoder layers past the model's own (MTP modules stitched into the target
    checkpoint, `num_nextn_predict_layers`), which belong to a drafter. Then every module's
    `after_load_weights()`, where it has one (a serving transform's fold, redone).

    A parameter the checkpoint does not hold under its own name is filled from the tensors its
    family names (`NativeCausalLM.checkpoint_sources`: per-expert tensors into slices of stacked
    experts, MXFP4 blocks and scales dequantized); tensors no parameter consumes are unknown.
    Missing, unknown or misshaped tensors are one-line `CheckpointError`s."""
    from safetensors import SafetensorError, safe_open

    params = dict(model.named_parameters())  # a tied head appears once, as embed_tokens
    tied = model.config.tie_word_embeddings
    missing: list[str] = []
    consumed: set[str] = set()
    reading: Path | None = None  # the file an I/O error is about
    try:
        with ExitStack() as stack:
            where: dict[str, tuple[Any, Path]] = {}  # tensor name -> (open file, its path)
            for reading in files:
                f = stack.enter_context(safe_open(str(reading), framework="pt", device="cpu"))
                where.update((name, (f, reading)) for name in f.keys())
            for pname, p in params.items():
                if pname in where:
                    sources = [TensorSource((pname,))]
                else:
                    sources = model.checkpoint_sources(pname, where)
                    if sources is None:
                        missing.append(pname)
                        continue
                for src in sources:
                    absent = [n for n in src.names if n not in where]
                    if absent:
                        missing.extend(absent)
                        continue
                    tensors = []
                    for n in src.names:
                        f, reading = where[n]
                        tensors.append(f.get_tensor(n))
                    _fill(p, src, tensors, where)
                    consumed.update(src.names)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {reading}: {e}") from None
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint lacks tensor(s) {', '.join(missing[:3])}{more}")
    unknown = [
        name
        for name in where
        if name not in consumed
        and not (
            _stitched(name, model.config.num_layers, extra_layers)
            or _IGNORED.match(name)
            or (tied and name == "lm_head.weight")
        )
    ]
    if unknown:
        more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise CheckpointError(
            f"checkpoint has tensor(s) the native {model.config.architecture} does not use: "
            f"{', '.join(unknown[:3])}{more}"
        )
    for m in model.modules():  # a serving transform that derived tensors from the weights
        hook = getattr(m, "after_load_weights", None)
        if hook is not None:
            hook()


def _fill(p: torch.Tensor, src: TensorSource, tensors: list[torch.Tensor], where) -> None:
    """`p[src.index] = src.convert(*tensors)` (or the one tensor), shapes checked."""
    value = src.convert(*tensors) if src.convert is not None else tensors[0]
    target = p[src.index] if src.index else p
    if value.shape != target.shape:
        if src.convert is None and not src.index:
            file = where[src.names[0]][1]
            raise CheckpointError(
                f"{file.name}: tensor {src.names[0]} has shape {tuple(value.shape)}, "
                f"the config implies {tuple(target.shape)}"
            )
        raise CheckpointError(
            f"tensor(s) {', '.join(src.names)} give shape {tuple(value.shape)}, the config "
            f"implies {tuple(target.shape)} for their part of a parameter"
        )
    target.copy_(value)


def _stitched(name: str, num_layers: int, extra_layers: int) -> bool:
    """Whether `name` is in one of the `extra_layers` decoder layers past the model's own."""
    layer = _LAYER.match(name)
    return layer is not None and num_layers <= int(layer.group(1)) < num_layers + extra_layers


def load_native_config(path: str | Path) -> tuple[type[NativeCausalLM], NativeConfig, Path]:
    """(class, config, checkpoint dir) without touching the weights."""
    ckpt = resolve_checkpoint_dir(path)
    cfg_path = ckpt / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"no config.json in {ckpt}")
    raw = read_json(cfg_path)
    cls = native_class_for(raw)  # before AutoConfig: an unknown model_type fails there
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(ckpt))
    except (OSError, ValueError, KeyError, *_STRICT_ERRORS) as e:
        # A strict config class's validation error says what is wrong in its cause.
        cause = e.__cause__ if isinstance(e, _STRICT_ERRORS) and e.__cause__ else e
        first = (str(cause).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"cannot parse {cfg_path}: {first}") from None
    return cls, cls.config_from_hf(hf, eos_token_ids(ckpt, raw)), ckpt


def load_native_target(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_batch: int = 1,
    max_seq_len: int = 2048,
) -> NativeCausalLM:
    """Build the native model for an HF checkpoint directory, load its safetensors weights,
    allocate a KV cache of `max_batch` rows x `max_seq_len` positions; eval, grads off.

    Errors (one line): `CheckpointError` for a missing directory / config / weights, a
    missing, extra or misshaped tensor; `ConfigError` for an unsupported architecture.
    """
    cls, cfg, ckpt = load_native_config(path)
    files = weight_files(ckpt)
    extra_layers = int(read_json(ckpt / "config.json").get("num_nextn_predict_layers") or 0)
    device = torch.device(device)
    with torch.device("meta"):  # no random init of weights we are about to overwrite
        model = cls(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty may re-create parameters, which unties them
    model.init_rope(device)
    load_weights(model, files, extra_layers)
    model.requires_grad_(False).eval()
    model.setup_caches(max_batch, max_seq_len)
    return model
