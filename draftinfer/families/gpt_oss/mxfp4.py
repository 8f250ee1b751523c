"""MXFP4 expert weights of the released gpt-oss checkpoints, dequantized exactly.

The files hold each expert matrix as `{name}_blocks [E, rows, G, 16]` uint8 and
`{name}_scales [E, rows, G]` uint8, rows being output features (the transposed, `(out, in)`
layout): every byte packs two FP4 (E2M1) values, the low nibble first; every group of 32 values
along the input axis shares one E8M0 scale `2 ** (scale - 127)` (OCP MX; REFERENCES D A4,
transformers `integrations/mxfp4.py`). Dequantized, a matrix is `[E, rows, G * 32]`,
transposed to `[E, in, out]`: the bf16 layout of HF's `GptOssExperts` (`x @ W`).

    w = dequantize_mxfp4(blocks, scales, torch.bfloat16)  # [E, in, out]

Exact: an E2M1 value has at most two significant bits and a power-of-two scale only moves the
exponent, so `value * 2 ** (scale - 127)` is exact in fp32 and, where it is a normal number,
in bf16 (the same exponent range); transformers' dequantizer computes the same fp32 product
(`ldexp` with an fp32 power of two) before its cast. A scale byte of 255 is NaN in the MX
format (transformers would write inf or NaN): a one-line `CheckpointError`.
"""

from __future__ import annotations

import torch

from draftinfer.files.errors import CheckpointError

# E2M1 code -> value: sign bit 3, exponent bits 2..1, mantissa bit 0.
FP4_VALUES = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
SCALE_BIAS = 127
BLOCK = 32  # values per scale: 16 bytes of two nibbles


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [E, rows, G, 16] uint8
    scales: torch.Tensor,  # [E, rows, G] uint8
    dtype: torch.dtype,
) -> torch.Tensor:
    """-> `[E, G * 32, rows]` in `dtype` (the `x @ W` layout of the `rows` outputs)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
            f"(blocks [E, rows, G, {BLOCK // 2}], scales [E, rows, G])"
        )
    if bool((scales == 255).any()):  # load time, once per tensor: a host sync is fine here
        raise CheckpointError("MXFP4 scale byte 255 (NaN in the MX format) in the checkpoint")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]  # [E, rows, G, 16]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [E, rows, G, 32], low nibble first
    scale = torch.exp2(scales.float() - SCALE_BIAS)  # exact powers of two in fp32
    out = (values * scale[..., None]).flatten(-2)  # [E, rows, G * 32]
    return out.transpose(1, 2).to(dtype).contiguous()
