"""On-disk format of the offline feature cache: segments, storage dtypes (fp8 with per-row
scales), shard plans, bytes per token. The files are written, listed, checked and resumed by
`drafttrain.trainer.shards` (the layout every sharded output of the project shares).

A cache directory:

    DIR/manifest.json                 # fingerprint, layout, per-split sizes and fingerprints,
                                      # one entry per finished shard: its split, samples [a, b),
                                      # tokens, bytes, sha256 (`drafttrain.trainer.shards`)
    DIR/train/shard_00000.safetensors # the training split, contiguous sample ranges
    DIR/eval/shard_00000.safetensors  # the rows held-out evaluation runs (if data.eval_split)

Per token the cache stores `S` *segments*, each `H` wide: the drafter's `FeatureSpec`
features in their order (layer-input taps, then the final hidden if the spec has one), then
the *head input* unless the spec's final hidden already is it. The head input is the
target's final hidden state (`pre_norm` by default, or the spec's own `post_norm`) from
which the target's logits are recomputed at read time (`drafttrain.cache.reader.TargetHead`);
storing logits instead would cost `V` values per token (128256 for Llama-3) instead of `H`.
So eagle3 / ptd store 3 taps + pre-norm (S = 4), mtp stores its final hidden (S = 1).

A shard holds samples `[a, b)` of its split (positions in the split's row list),
concatenated along tokens (`N` tokens, `n = b - a` samples):

    hidden    [N, S*H]  storage dtype: bfloat16, float32 or float8_e4m3fn
    scale     [N, S]    float32, float8 only: segment s of token t = hidden[t, s] * scale[t, s]
    rope_pos  [A, N]    int32: the target's RoPE positions (A = 1, or 3 for M-RoPE)
    offsets   [n + 1]   int64: sample i holds tokens offsets[i]:offsets[i+1]
    rows      [n]       int64: the samples' dataset rows (what training batches carry as
                        `index`)

fp8 scales: one fp32 scale per token *per segment* (`amax / 448`, the largest finite
`float8_e4m3fn`), because the taps differ by orders of magnitude (the embedding-level tap
vs the residual stream near the last layer); one scale per token would flush the small
segment to zero. With 3 mantissa bits the rounding error is at most `2^-4 |x|` for values in
the normal range and at most `2^-10 * scale` below it (`tests/train/test_cache.py` pins this).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from draftinfer.models.target import FeatureSpec
from drafttrain.jobs.errors import ConfigError, DataError
from drafttrain.trainer.shards import ManifestFormat, first_difference

# Version 2: the manifest layout of `drafttrain.trainer.shards` (one list of finished shards, each with
# its split); version 1 listed them per split.
FORMAT = ManifestFormat(
    "drafttrain-feature-cache",
    2,
    "feature-cache",
    DataError,
    hint="write the cache again with `python -m drafttrain.cache` (same settings)",
)
SPLITS = ("train", "eval")
STORAGE = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def storage_dtype(name: str) -> torch.dtype:
    if name not in STORAGE:
        raise ConfigError(f"cache.dtype must be one of {sorted(STORAGE)}, got {name!r}")
    return STORAGE[name]


def feature_name(layer_input: int | None = None, final_hidden: str | None = None) -> str:
    return f"layer_input.{layer_input}" if final_hidden is None else f"final_hidden.{final_hidden}"


def spec_names(spec: FeatureSpec) -> list[str]:
    """The names of `spec`'s features, in the order the target concatenates them."""
    names = [feature_name(j) for j in spec.layer_inputs]
    return names + ([feature_name(final_hidden=spec.final_hidden)] if spec.final_hidden else [])


@dataclass(frozen=True)
class Layout:
    """What one token of the cache holds (the manifest's `layout`)."""

    segments: tuple[str, ...]  # feature names, H wide each; the last one is the head input
    head_input: str  # "pre_norm" | "post_norm": how logits are recomputed from the last segment
    hidden_size: int
    rope_axes: int
    dtype: str  # a key of STORAGE

    @classmethod
    def for_features(
        cls, spec: FeatureSpec, hidden_size: int, rope_axes: int, dtype: str
    ) -> tuple[Layout, FeatureSpec]:
        """The layout for a drafter's `spec`, and the spec the writer asks the target for
        (the drafter's, plus the pre-norm final hidden when it has no final hidden)."""
        storage_dtype(dtype)
        ask = spec.with_head_input()
        layout = cls(tuple(spec_names(ask)), ask.final_hidden, hidden_size, rope_axes, dtype)
        return layout, ask

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        return cls(**{**d, "segments": tuple(d["segments"])})

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "segments": list(self.segments)}

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    def columns(self, spec: FeatureSpec, where: str = "the feature cache") -> list[int]:
        """Segment index of each of `spec`'s features; a one-line `ConfigError` naming the
        first feature the cache (`where`) does not hold."""
        out = []
        for name in spec_names(spec):
            if name not in self.segments:
                raise ConfigError(
                    f"the drafter consumes the target's {name}, which {where} does not hold "
                    f"(it holds {', '.join(self.segments)})"
                )
            out.append(self.segments.index(name))
        return out


def bytes_per_token(
    hidden_size: int, num_segments: int, dtype: str, rope_axes: int = 1
) -> dict[str, int]:
    """Exact bytes the per-token tensors of a shard take (`hidden`, `scale`, `rope_pos`), and
    their sum under `total`. Per-sample tensors (`offsets`, `rows`: 16 bytes a sample) and the
    safetensors header come on top (the CLI prints the measured bytes per token as well)."""
    itemsize = torch.empty(0, dtype=storage_dtype(dtype)).element_size()
    out = {
        "hidden": num_segments * hidden_size * itemsize,
        "scale": num_segments * 4 if dtype == "float8" else 0,
        "rope_pos": rope_axes * 4,
    }
    out["total"] = sum(out.values())
    return out


# ---- fp8 with one scale per token per segment -------------------------------------------
def encode(x: torch.Tensor, num_segments: int, dtype: str) -> dict[str, torch.Tensor]:
    """x `[N, S*H]` (any float dtype) -> {"hidden": `[N, S*H]` storage dtype} plus, for
    float8, {"scale": `[N, S]` fp32} with `x ~= hidden * scale` per segment."""
    sd = storage_dtype(dtype)
    if dtype != "float8":
        return {"hidden": x.to(sd)}
    N = x.shape[0]
    seg = x.float().reshape(N, num_segments, -1)  # [N, S, H]
    amax = seg.abs().amax(dim=-1)  # [N, S]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (seg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(sd)
    return {"hidden": q.reshape(N, -1), "scale": scale}


def decode(
    hidden: torch.Tensor, scale: torch.Tensor | None, num_segments: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of `encode`: hidden `[..., S*H]`, scale `[..., S]` or None -> `[..., S*H]`
    in `out_dtype`."""
    if scale is None:
        return hidden.to(out_dtype)
    seg = hidden.float().unflatten(-1, (num_segments, -1)) * scale[..., None]
    return seg.flatten(-2).to(out_dtype)


# ---- shard plans -----------------------------------------------------------------------
def plan_shards(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Contiguous `[a, b)` ranges over samples with at most `shard_tokens` tokens each (a
    longer sample is a shard of its own). A pure function of the lengths, so a resumed
    write cuts the same shards."""
    if shard_tokens < 1:
        raise ConfigError(f"cache.shard_tokens must be >= 1, got {shard_tokens}")
    plan, a, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > a and tokens + n > shard_tokens:
            plan.append((a, i))
            a, tokens = i, 0
        tokens += n
    if a < len(lengths):
        plan.append((a, len(lengths)))
    return plan


def shard_name(split: str, index: int) -> str:
    return f"{split}/shard_{index:05d}.safetensors"


def mismatch(want: dict[str, Any], have: dict[str, Any]) -> str | None:
    """The first setting of `want` the cache's manifest (`have`) does not share, as `key is A
    here but B in the cache` (None when all match)."""
    diff = first_difference(want, have)
    if diff is None:
        return None
    key, a, b = diff
    return f"{key} is {a!r} here but {None if b == '<unset>' else b!r} in the cache"
