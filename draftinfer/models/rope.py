"""Rotary position embeddings shared by the native targets and every drafter kind.

Rotary embeddings read only RoPE positions (`Slots.rope_pos`), never the KV-cache index
(DESIGN 2.1 seam 3). Positions are tensors `[..., N]`, or `[3, ..., N]` for M-RoPE targets.

Supported `rope_type`s: `default`, `linear`, `llama3`, `yarn` (gpt-oss: `truncate: false`, the
attention factor multiplying cos and sin), each optionally with *interleaved M-RoPE*
(`mrope_section`, Qwen3-VL): the `head_dim // 2` frequencies are split over three
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
# Keys a rope_type may carry besides its required ones (transformers' defaults apply when absent).
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
    params, where = _hf_rope_params(config)
    # How much of a head rotates is the target attention's (`partial_rotary_factor`), not the
    # frequencies': the caller reads it (`partial_rotary_factor`) and builds the rotary over
    # that many dimensions; a drafter keeps its own whole-head RoPE (DESIGN 14).
    params.pop("partial_rotary_factor", None)
    if params.get("rope_type", params.get("type")) == "yarn":
        # transformers' `standardize_rope_params`: the pretraining length defaults to the
        # model's own.
        default = getattr(config, "max_position_embeddings", None)
        if default is not None:
            params.setdefault("original_max_position_embeddings", default)
    return parse_rope(params, head_dim, where)


def _hf_rope_params(config: Any) -> tuple[dict[str, Any], str]:
    """The rope dict of an HF config (transformers 5 `rope_parameters`, or 4's `rope_scaling`
    plus `rope_theta`) and where it was read, for messages."""
    name = type(config).__name__
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params), f"{name}.rope_parameters"
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", float(getattr(config, "rope_theta", 10000.0)))
    return params, f"{name}.rope_scaling"


def partial_rotary_factor(config: Any) -> float:
    """The fraction of each head RoPE rotates in an HF config (`partial_rotary_factor` in
    `rope_parameters`, or a top-level attribute as transformers 4 spelled it; 1.0 when absent):
    GLM-4.5/4.6 rotate the first half (HF `apply_rotary_pos_emb`: `rotary_dim = cos.shape[-1]`,
    the rotary built over `int(head_dim * factor)` dimensions)."""
    params, _ = _hf_rope_params(config)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return 1.0 if factor is None else float(factor)


def rope_axes(scaling: dict[str, Any] | None) -> int:
    """Number of position axes the rotary reads: 3 for M-RoPE, else 1."""
    return 3 if scaling and "mrope_section" in scaling else 1


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` fp32 for default, linear, llama3 and yarn RoPE,
    computed in fp32 the way transformers computes them (so the rotary matches the target's bit
    for bit)."""
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


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (transformers' `_compute_yarn_parameters`, expression for expression): frequencies
    whose wavelength fits the pretraining context `beta_fast` times keep their value, those that
    fit fewer than `beta_slow` times are divided by `factor`, a linear ramp over the dimension
    index blends the two in between. `truncate` (default true) floors/ceils the ramp's ends;
    gpt-oss sets it false."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the pretraining context.
        return (head_dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a zero-width ramp
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the frequency, 0: divide it by `factor`
    return (interpolation * (1 - keep) + extrapolation * keep).float()


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor multiplying cos and sin (YaRN's attention scaling; 1 for the other types):
    `attention_factor` if given, else `0.1 * mscale * ln(factor) + 1` ratios as transformers
    computes it (gpt-oss: `0.1 ln 32 + 1 = 1.3466`)."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all))
    return mscale_of(factor)


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
    `[..., N]` for plain RoPE and `[3, ..., N]` (T, H, W rows) for M-RoPE. Both carry the rope
    type's attention factor (YaRN), as transformers' rotaries do.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.attention_factor = rope_attention_factor(scaling)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        section = (scaling or {}).get("mrope_section")
        axis = mrope_axis_of_freq(head_dim, section) if section else None
        self.register_buffer("freq_axis", axis, persistent=False)

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
    """x `[B, T, heads, D]`, cos/sin `[B, T, R]` or `[T, R]` -> rotated x (dtype kept).

    `R = D`: the whole head rotates. `R < D` (partial rotary, GLM-4.5's half head): the first
    `R` dimensions rotate (NeoX halves within them), the other `D - R` pass through, as HF's
    `apply_rotary_pos_emb` does when its rotary is narrower than the head."""
    rotary = cos.shape[-1]
    if rotary > x.shape[-1]:
        raise ValueError(f"rotary of {rotary} dimensions for heads of {x.shape[-1]}")
    if rotary < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = x.float() * cos + _rotate_half(x.float()) * sin
    return out.to(x.dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs `(x0, x1), (x2, x3), ...` (GPT-J layout; DeepSeek's MLA with
    `rope_interleave`), written de-interleaved: `[x_even * c - x_odd * s, x_odd * c + x_even *
    s]` with `c, s` the first half of `cos, sin` (HF `apply_rotary_pos_emb_interleave`; the same
    permutation on queries and keys leaves their products unchanged). Shapes as `apply_rope`."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
