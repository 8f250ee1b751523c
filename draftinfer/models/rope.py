"""Rotary position embeddings shared by the native targets and every drafter kind.

Rotary embeddings read only RoPE positions (`Slots.rope_pos`), never the KV-cache index
(DESIGN 2.1 seam 3). Positions are tensors `[..., N]`, or `[3, ..., N]` for M-RoPE targets.

Supported `rope_type`s: `default`, `linear`, `llama3`, `yarn` (gpt-oss: its inverse frequencies
and the `attention_factor` that scales cos and sin, as transformers' `_compute_yarn_parameters`),
each optionally with *interleaved M-RoPE* (`mrope_section`, Qwen3-VL): the `head_dim // 2` frequencies are split over three
position axes (T, H, W) by interleaving, H at frequency indices 1, 4, 7, ... (`mrope_section[1]`
of them), W at 2, 5, 8, ... (`mrope_section[2]`), T everywhere else. Where all three axes are
equal (text tokens) M-RoPE equals plain RoPE.

Config parsing is strict: a key this module does not implement is a one-line `ConfigError`
naming it, never silently dropped (a dropped `mrope_section` or yarn `factor` would give a
drafter that rotates differently from its target).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from draftinfer.files.errors import ConfigError

# Keys each rope_type reads (besides `rope_type` and `rope_theta`).
_TYPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset({"factor", "original_max_position_embeddings"}),
}
# Keys a rope_type may have besides those it needs (transformers' defaults when absent).
_OPTIONAL_KEYS: dict[str, frozenset[str]] = {
    "yarn": frozenset(
        {"beta_fast", "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim"}
    ),
}
_MROPE_KEYS = frozenset({"mrope_section", "mrope_interleaved"})


def parse_rope(params: dict[str, Any] | None, head_dim: int, where: str = "config"):
    """Validate a rope dict (`rope_parameters` of transformers 5, or `rope_scaling` plus
    `rope_theta` of transformers 4) -> `(theta, scaling)`.

    `scaling` is None for plain RoPE, else a dict with `rope_type` and that type's keys (and
    `mrope_section` for M-RoPE). Raises `ConfigError` naming the first unknown key, unknown
    rope_type, missing key or an `mrope_section` that does not fill `head_dim // 2`.
    """
    params = dict(params or {})
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in _TYPE_KEYS:
        raise ConfigError(
            f"{where}: unsupported rope_type {rope_type!r} (supported: {', '.join(_TYPE_KEYS)})"
        )
    known = _TYPE_KEYS[rope_type] | _OPTIONAL_KEYS.get(rope_type, frozenset()) | _MROPE_KEYS
    for key in params:
        if key not in known:
            raise ConfigError(
                f"{where}: unknown rope key {key!r} for rope_type {rope_type!r} "
                f"(known: {', '.join(sorted(known))})"
            )
    missing = sorted(_TYPE_KEYS[rope_type] - set(params))
    if missing:
        raise ConfigError(f"{where}: rope_type {rope_type!r} needs {missing[0]!r}")
    if "mrope_section" in params:
        section = [int(s) for s in params["mrope_section"]]
        if len(section) != 3 or sum(section) != head_dim // 2:
            raise ConfigError(
                f"{where}: mrope_section {section} must have 3 entries summing to "
                f"head_dim // 2 = {head_dim // 2}"
            )
        if params.get("mrope_interleaved", True) is not True:
            raise ConfigError(
                f"{where}: chunked M-RoPE (mrope_interleaved false, Qwen2-VL) is not "
                "supported; only interleaved M-RoPE (Qwen3-VL)"
            )
        counts = torch.bincount(mrope_axis_of_freq(head_dim, section), minlength=3).tolist()
        if counts != section:
            raise ConfigError(
                f"{where}: mrope_section {section} does not interleave into head_dim {head_dim}"
            )
        params["mrope_section"] = section
        params["mrope_interleaved"] = True
    elif "mrope_interleaved" in params:
        raise ConfigError(f"{where}: mrope_interleaved without mrope_section")
    if rope_type == "default" and not params:
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def rope_from_hf(config: Any, head_dim: int | None = None):
    """(theta, scaling) of an HF config object, transformers 4 (`rope_theta` / `rope_scaling`)
    or 5 (`rope_parameters`), strictly (see `parse_rope`)."""
    if head_dim is None:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
    name = type(config).__name__
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return parse_rope(params, head_dim, f"{name}.rope_parameters")
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_theta", float(getattr(config, "rope_theta", 10000.0)))
    return parse_rope(scaling, head_dim, f"{name}.rope_scaling")


def rope_axes(scaling: dict[str, Any] | None) -> int:
    """Number of position axes the rotary reads: 3 for M-RoPE, else 1."""
    return 3 if scaling and "mrope_section" in scaling else 1


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` fp32 for default, linear and llama3 RoPE, computed
    in fp32 the way transformers computes them (so the rotary matches the target's bit for bit)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv.float()
    if rope_type == "linear":
        return (inv / float(scaling["factor"])).float()
    if rope_type == "llama3":
        # Llama-3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled).float()
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ConfigError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(_TYPE_KEYS)})")


def _yarn_correction_range(head_dim: int, theta: float, scaling: dict[str, Any]):
    """The frequency indices between which YaRN blends interpolation into extrapolation."""
    original = float(scaling["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = dim_of(float(scaling.get("beta_fast") or 32))
    high = dim_of(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):  # gpt-oss: `truncate: false`
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's inverse frequencies: high frequencies kept, low ones divided by `factor`, a
    linear ramp between (transformers' `_compute_yarn_parameters`, op for op)."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (float(scaling["factor"]) * pos_freqs)
    low, high = _yarn_correction_range(head_dim, theta, scaling)
    if low == high:
        high += 0.001  # as transformers: no singular ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of extrapolation (the unscaled frequency)
    return (interpolation * (1 - keep) + extrapolation * keep).float()


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by: YaRN's `attention_factor` (given, or
    `0.1 ln(factor) + 1`, with DeepSeek's `mscale` / `mscale_all_dim` when both are set), 1.0
    for every other rope_type."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale()


def mrope_axis_of_freq(head_dim: int, section: list[int]) -> torch.Tensor:
    """`[head_dim // 2]` int64: which position axis (0 = T, 1 = H, 2 = W) drives frequency i.
    Interleaved layout: H at 1, 4, 7, ... (section[1] of them), W at 2, 5, 8, ... (section[2])."""
    axis = torch.zeros(head_dim // 2, dtype=torch.long)
    for a, offset in ((1, 1), (2, 2)):
        axis[offset : 3 * section[a] : 3] = a
    return axis


class RotaryEmbedding(nn.Module):
    """cos/sin rows for RoPE positions.

    forward(positions) -> (cos, sin), each `[..., N, head_dim]` fp32, where positions are
    `[..., N]` for plain RoPE and `[3, ..., N]` (T, H, W rows) for M-RoPE.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        section = (scaling or {}).get("mrope_section")
        axis = mrope_axis_of_freq(head_dim, section) if section else None
        self.register_buffer("freq_axis", axis, persistent=False)
        self.attention_factor = rope_attention_factor(scaling)

        self.first_axis_only = False

    @property
    def axes(self) -> int:
        return 1 if self.freq_axis is None else 3

    def read_first_axis(self) -> None:
        """Rotate every frequency by position row 0 (T) alone, as an engine serves a drafter
        whose config has no `mrope_section` (`serve_positions_1d`). Still takes `[3, ..., N]`."""
        if self.freq_axis is None:
            raise ConfigError("this rotary reads 1-D positions already (no mrope_section)")
        self.first_axis_only = True
        self.freq_axis = torch.zeros_like(self.freq_axis)

    def reset_parameters(self, device: torch.device | str) -> None:
        """Recompute the tables (e.g. after building the module on the meta device)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        if self.freq_axis is not None:
            self.freq_axis = mrope_axis_of_freq(self.head_dim, self.scaling["mrope_section"]).to(
                device
            )
            if self.first_axis_only:
                self.freq_axis = torch.zeros_like(self.freq_axis)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions.to(torch.float32)
        if self.freq_axis is None:
            freqs = pos[..., None] * self.inv_freq  # [..., N, D/2]
        else:
            if positions.dim() < 2 or positions.shape[0] != 3:
                raise ValueError(
                    f"M-RoPE positions must be [3, ..., N], got shape {tuple(positions.shape)}"
                )
            # [3, ..., N, D/2]: every axis' angles, then frequency i takes its own axis' row.
            per_axis = pos[..., None] * self.inv_freq
            index = self.freq_axis.expand(1, *per_axis.shape[1:])  # [1, ..., N, D/2]
            freqs = per_axis.gather(0, index)[0]
        emb = torch.cat([freqs, freqs], dim=-1)
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()


POSITION_MODES = ("native", "1d")


def serve_positions_1d(module: nn.Module) -> int:
    """Make a drafter rotate as an engine that strips `mrope_section` serves it: every M-RoPE
    rotary of `module` reads position row 0 (T) for every frequency, i.e. plain RoPE at the T
    row of the positions it is given. This is vLLM's path for a draft model without M-RoPE on
    an M-RoPE target (`vllm/v1/spec_decode/eagle.py`, `_set_positions`: `positions[0]` when
    the target uses M-RoPE and the draft does not; the draft's `uses_mrope` is read from its
    own config). Text rows, whose three rows are equal, rotate exactly as before; image rows
    lose their H/W rows. Returns the number of rotaries changed; a drafter with none (its
    positions are 1-D already; or its layers rotate with transformers' classes, as an MTP
    drafter with `block: hf`) is a one-line `ConfigError`."""
    rotaries = [
        m for m in module.modules() if isinstance(m, RotaryEmbedding) and m.freq_axis is not None
    ]
    if not rotaries:
        raise ConfigError(
            "drafter_positions=1d: the drafter has no M-RoPE rotary of draftinfer's (1-D "
            "positions already, or its layers rotate with another class), nothing to strip"
        )
    for r in rotaries:
        r.read_first_axis()
    return len(rotaries)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, T, heads, D]`, cos/sin `[B, T, D]` or `[T, D]` -> rotated x (dtype kept)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = x.float() * cos + _rotate_half(x.float()) * sin
    return out.to(x.dtype)
