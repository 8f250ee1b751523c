"""Native target models: registry by HF architecture name, a safetensors loader, and a plain
greedy decode loop (the baseline speculative decoding must reproduce token for token).

    model = load_native_target("path/to/llama", "cuda", torch.bfloat16, max_batch=8, max_seq_len=4096)
    out = model(input_ids, Slots(rows, cache_pos), FeatureSpec(layer_inputs=(2, 16, 29)))
    outs = greedy_generate(model, [[1, 2, 3], [1, 5]], max_new_tokens=64, eos_ids=model.config.eos_token_ids)
    outs = sample_generate(model, prompts, 64, eos_ids, [SamplingParams(0.7, top_p=0.9, seed=1)] * 2)

Checkpoints are read with safetensors only (`model.safetensors`, or shards listed by
`model.safetensors.index.json`); pickled `.bin` weights are refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from draftinfer.errors import CheckpointError, ConfigError
from draftinfer.models.llama import (
    LlamaForCausalLM,
    NativeCausalLM,
    NativeConfig,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from draftinfer.models.qwen3_vl import Qwen3VLForConditionalGeneration
from draftinfer.paths import resolve_path
from draftinfer.sampling import (
    RoundKeys,
    SamplingParams,
    exponential_noise,
    logits_to_probs,
    sample_from_probs,
    sampling_tensors,
    with_seed,
)
from draftinfer.slots import Slots, attn_bucket

# HF `architectures[0]` -> native class (STYLE rule 5: variants are selected by name).
TARGET_MODELS: dict[str, type[NativeCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
}

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
# Checkpoint tensors that carry no weights of ours: old checkpoints saved RoPE tables.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def resolve_checkpoint_dir(name_or_path: str | Path) -> Path:
    """A local checkpoint directory: `zoo:` shorthand, a local path, or a hub id already in the
    local HF cache (or fetchable when online)."""
    path = resolve_path(str(name_or_path))
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if not local.exists() and _HUB_ID.match(path):
        try:
            from huggingface_hub import snapshot_download

            pattern = ["*.json", "*.safetensors"]
            return Path(snapshot_download(path, allow_patterns=pattern))
        except Exception as e:  # any hub failure means "not found" to the user
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"target checkpoint not found: {path!r} ({first})") from None
    raise CheckpointError(
        f"target checkpoint not found: {path!r} is not a directory (nor a hub id org/name)"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def _eos_token_ids(ckpt: Path, config: dict[str, Any]) -> list[int]:
    """`eos_token_id` of generation_config.json (what HF `generate` stops on), else of
    config.json; an int or a list in either file."""
    gen = ckpt / "generation_config.json"
    eos = _read_json(gen).get("eos_token_id") if gen.is_file() else None
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys(int(i) for i in ids))


def native_class_for(config: dict[str, Any]) -> type[NativeCausalLM]:
    """The registered class for a parsed config.json; a one-line `ConfigError` otherwise."""
    supported = ", ".join(sorted(TARGET_MODELS))
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in TARGET_MODELS:
            return TARGET_MODELS[arch]
    if not archs:
        model_type = config.get("model_type")
        for cls in TARGET_MODELS.values():
            if model_type in cls.hf_model_types:
                return cls
        raise ConfigError(
            f"unsupported target: config.json has no `architectures` and model_type "
            f"{model_type!r} is not native (supported: {supported})"
        )
    raise ConfigError(
        f"unsupported target architecture {', '.join(map(str, archs))} "
        f"(native targets supported: {supported})"
    )


def weight_files(ckpt: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (`model.safetensors`, or the shards
    of `model.safetensors.index.json`); one-line `CheckpointError`s, pickles refused."""
    single, index = ckpt / SAFE_SINGLE, ckpt / SAFE_INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [ckpt / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists missing shard(s): {', '.join(missing[:3])}")
        return files
    if single.is_file():
        return [single]
    other = sorted(p.name for p in ckpt.glob("*.bin")) + sorted(p.name for p in ckpt.glob("*.pt"))
    hint = f" (found {other[0]}: pickled weights are not loaded)" if other else ""
    raise CheckpointError(f"no {SAFE_SINGLE} or {SAFE_INDEX} in {ckpt}{hint}")


@torch.no_grad()
def load_weights(model: NativeCausalLM, files: Iterable[Path], extra_layers: int = 0) -> None:
    """Copy safetensors tensors into `model` by HF name (cast to the model's dtype/device);
    every parameter must be present, and no unknown tensor may be left over, except the
    `extra_layers` decoder layers past the model's own (MTP modules stitched into the target
    checkpoint, `num_nextn_predict_layers`), which belong to a drafter."""
    from safetensors import SafetensorError, safe_open

    params = dict(model.named_parameters())  # a tied head appears once, as embed_tokens
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    unknown: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in params:
                        layer = _LAYER.match(name)
                        stitched = layer is not None and (
                            model.config.num_layers
                            <= int(layer.group(1))
                            < model.config.num_layers + extra_layers
                        )
                        if not (
                            stitched or _IGNORED.match(name) or (tied and name == "lm_head.weight")
                        ):
                            unknown.append(name)
                        continue
                    t = f.get_tensor(name)
                    p = params[name]
                    if t.shape != p.shape:
                        raise CheckpointError(
                            f"{file.name}: tensor {name} has shape {tuple(t.shape)}, "
                            f"the config implies {tuple(p.shape)}"
                        )
                    p.copy_(t)
                    loaded.add(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from None
    missing = [n for n in params if n not in loaded]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint lacks tensor(s) {', '.join(missing[:3])}{more}")
    if unknown:
        more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise CheckpointError(
            f"checkpoint has tensor(s) the native {model.config.architecture} does not use: "
            f"{', '.join(unknown[:3])}{more}"
        )


def load_native_config(path: str | Path) -> tuple[type[NativeCausalLM], NativeConfig, Path]:
    """(class, config, checkpoint dir) without touching the weights."""
    ckpt = resolve_checkpoint_dir(path)
    cfg_path = ckpt / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"no config.json in {ckpt}")
    raw = _read_json(cfg_path)
    cls = native_class_for(raw)  # before AutoConfig: an unknown model_type fails there
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(ckpt))
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"cannot parse {cfg_path}: {first}") from None
    return cls, cls.config_from_hf(hf, _eos_token_ids(ckpt, raw)), ckpt


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
    extra_layers = int(_read_json(ckpt / "config.json").get("num_nextn_predict_layers") or 0)
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


# ---- plain greedy decoding (the baseline) -----------------------------------------------

# step_fn(input_ids [B, 1], cache_pos [B, 1], cache_rows [B]) -> logits [B, 1, V]
StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# pick(logits [B, V], positions [B]) -> next token [B]; positions: where the token will sit
PickFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def greedy_generate(
    model: NativeCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: Iterable[int] = (),
    *,
    step_fn: StepFn | None = None,
    mm_inputs: Sequence[dict | None] | None = None,
) -> list[list[int]]:
    """Greedy (argmax) continuation of each prompt: a padded, ragged batch through the cache.

    Returns the new tokens of each request (not the prompt). A request stops after emitting
    one of `eos_ids` (kept, as HF `generate` keeps it), after `max_new_tokens`, or when its
    length reaches `model.max_seq_len`. Prompts beyond `model.max_batch` run in successive
    groups. `step_fn` replaces the one-token decode step (e.g. a `torch.compile`d
    `model.forward` with a fixed `attn_len`); prefill always runs `model.forward`, fed by the
    target's `prefill_plan` (`mm_inputs[b]`: request b's multimodal inputs or None, as
    `draftinfer.engine.Request.mm_inputs`).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    eos = list(dict.fromkeys(int(e) for e in eos_ids))
    mm = _check_mm(mm_inputs, prompts)
    out: list[list[int]] = []
    for start in range(0, len(prompts), model.max_batch):
        group = slice(start, start + model.max_batch)
        out.extend(_greedy_group(model, prompts[group], max_new_tokens, eos, step_fn, mm[group]))
    return out


def _check_mm(mm_inputs: Sequence[dict | None] | None, prompts: list) -> list[dict | None]:
    if mm_inputs is None:
        return [None] * len(prompts)
    if len(mm_inputs) != len(prompts):
        raise ValueError(f"{len(mm_inputs)} multimodal inputs for {len(prompts)} prompts")
    return list(mm_inputs)


@torch.no_grad()
def sample_generate(
    model: NativeCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: Iterable[int],
    params: Sequence[SamplingParams],
    *,
    mm_inputs: Sequence[dict | None] | None = None,
) -> list[list[int]]:
    """`greedy_generate` with per-request sampling (temperature, top-k, top-p, seed).

    The token that will sit at position `p` of a request is drawn with the noise keyed by
    `(request seed, p, STREAM_SAMPLE)` (`draftinfer.sampling`, DESIGN 3.12), so a request's
    output does not depend on the rest of the batch. Greedy requests (temperature 0) get
    exactly `greedy_generate`'s tokens. Unseeded params get a fresh seed (`with_seed`).
    """
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    eos = list(dict.fromkeys(int(e) for e in eos_ids))
    mm = _check_mm(mm_inputs, prompts)
    device = model.embed_tokens.weight.device
    out: list[list[int]] = []
    for start in range(0, len(prompts), model.max_batch):
        group = slice(start, start + model.max_batch)
        pick = _sampling_pick(params[group], device)
        out.extend(_greedy_group(model, prompts[group], max_new_tokens, eos, None, mm[group], pick))
    return out


def _sampling_pick(params: Sequence[SamplingParams], device: torch.device) -> PickFn:
    """A `PickFn` sampling row b with `params[b]` (seed resolved once, here)."""
    resolved = [with_seed(p) for p in params]
    t = sampling_tensors(resolved, device)
    seeds = torch.tensor([p.seed for p in resolved], dtype=torch.long, device=device)

    def pick(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        probs = logits_to_probs(logits, t["temperature"], t["top_k"], t["top_p"])  # [B, V]
        pos, stream = RoundKeys.sample(positions)
        noise = exponential_noise(seeds, pos, probs.shape[-1], device, stream=stream)
        return sample_from_probs(probs, noise)

    return pick


def _argmax_pick(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def _greedy_group(
    model: NativeCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: list[int],
    step_fn: StepFn | None,
    mm_inputs: list[dict | None],
    pick: PickFn = _argmax_pick,
) -> list[list[int]]:
    device = model.embed_tokens.weight.device
    B = len(prompts)
    lens = [len(p) for p in prompts]
    too_long = [n for n in lens if n > model.max_seq_len]
    if too_long:
        raise ValueError(f"prompt of {too_long[0]} tokens exceeds max_seq_len={model.max_seq_len}")
    # New tokens each request may emit: its total length stays <= max_seq_len.
    budget = [min(max_new_tokens, model.max_seq_len - n) for n in lens]
    steps = max(budget)
    if steps == 0:
        return [[] for _ in prompts]

    T = max(lens)
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.full((B, T), -1, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        pos[b, : len(p)] = torch.arange(len(p))
    rows = torch.arange(B, device=device)
    lens_t = torch.tensor(lens, device=device)
    budget_t = torch.tensor(budget, device=device)
    last = (lens_t - 1)[:, None]  # [B, 1] slot of each prompt's last token
    ids, pos = ids.to(device), pos.to(device)
    inputs, rope = model.prefill_plan(ids, pos, rows, mm_inputs).chunk(slice(None))
    logits = model(inputs, Slots(rows, pos, rope), logit_index=last).logits
    tok = pick(logits[:, -1], lens_t)  # [B]: the token at position len(prompt)
    eos_t = torch.tensor(eos, device=device, dtype=torch.long)
    done = torch.isin(tok, eos_t) | (budget_t <= 1)
    generated = [tok]
    for s in range(1, steps):
        # Feed token index lens+s-1 (emitted last step) at that position; finished rows are
        # padding slots, so they write nothing and stay within max_seq_len.
        feed_pos = torch.where(done, -1, lens_t + s - 1)[:, None]  # [B, 1]
        if step_fn is None:
            # The bound on live positions is known on the host: no per-step sync or check;
            # bucketed so attention shapes change only at powers of two.
            attn_len = attn_bucket(min(T + s, model.max_seq_len), model.max_seq_len)
            logits = model(tok[:, None], Slots(rows, feed_pos, attn_len=attn_len)).logits
        else:
            logits = step_fn(tok[:, None], feed_pos, rows)
        tok = pick(logits[:, -1], lens_t + s)
        generated.append(tok)
        done = done | torch.isin(tok, eos_t) | (budget_t <= s + 1)
        if eos and bool(done.all()):  # one sync per step, only when stopping on eos
            break
    table = torch.stack(generated, dim=1).tolist()  # [B, steps]
    out = []
    for b in range(B):
        toks = table[b][: budget[b]]
        for i, t in enumerate(toks):
            if t in eos:
                toks = toks[: i + 1]
                break
        out.append(toks)
    return out


__all__ = [
    "TARGET_MODELS",
    "LlamaForCausalLM",
    "NativeCausalLM",
    "NativeConfig",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "greedy_generate",
    "load_native_config",
    "load_native_target",
    "load_weights",
    "sample_generate",
]
