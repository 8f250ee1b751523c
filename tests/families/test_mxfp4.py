"""gpt-oss MXFP4 experts (`draftinfer.families.gpt_oss.mxfp4`), bit for bit:

- against an oracle written from the format description alone (OCP MX: E2M1 codes, two per
  byte low nibble first, one E8M0 scale `2 ** (s - 127)` per 32 values along the input axis,
  rows = outputs), element by element in Python floats, for random bytes and every scale byte
  but 255 (NaN in the format: a one-line error);
- against transformers' own dequantizer (`integrations.mxfp4.convert_moe_packed_tensors`);
- end to end: a tiny gpt-oss whose expert weights are exactly representable, written in the
  released MXFP4 layout (`*_blocks`, `*_scales`, biases by name, `quantization_config`), loads
  into the native model with every weight bitwise equal to the same checkpoint in the bf16
  layout, in bf16 and in fp32, and so computes the same logits.
"""

from __future__ import annotations

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.families.gpt_oss.mxfp4 import dequantize_mxfp4
from draftinfer.files.errors import CheckpointError
from draftinfer.files.loading import load_native_target
from tests.support.moe_checkpoints import (
    E2M1,
    quantize_mxfp4,
    representable_experts,
    save_moe_target,
    set_experts,
    write_mxfp4_checkpoint,
)
from tests.support.moe_models import gpt_oss_config

DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so -0.0 != +0.0 and NaN == NaN of the same payload)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def oracle(blocks: torch.Tensor, scales: torch.Tensor) -> list:
    """`out[e][i][r]` in Python floats from the format description: input feature `i` of output
    row `r` is value `i % 32` of group `i // 32`; value `2j` is byte `j`'s low nibble, `2j + 1`
    its high nibble; a nibble's bit 3 is the sign, bits 2..1 the exponent (bias 1), bit 0 the
    mantissa; the group's scale byte `s` multiplies by `2 ** (s - 127)`."""

    def e2m1(nibble: int) -> float:
        sign = -1.0 if nibble & 8 else 1.0
        exp, man = (nibble >> 1) & 3, nibble & 1
        mag = man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1)  # subnormal at 0
        return sign * mag

    E, rows, G, _ = blocks.shape
    out = [[[0.0] * rows for _ in range(G * 32)] for _ in range(E)]
    b, s = blocks.tolist(), scales.tolist()
    for e in range(E):
        for r in range(rows):
            for gi in range(G):
                for j in range(16):
                    byte = b[e][r][gi][j]
                    for half, nibble in enumerate((byte & 0xF, byte >> 4)):
                        value = e2m1(nibble) * 2.0 ** (s[e][r][gi] - 127)
                        out[e][gi * 32 + 2 * j + half][r] = value
    return out


def random_packed(E, rows, G, seed, scale_range=(0, 255)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, rows, G, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(*scale_range, (E, rows, G), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_the_oracle_reads_e2m1_as_the_table_says():
    assert [float(v) for v in E2M1] == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0
    ]  # fmt: skip
    blocks = torch.tensor([[[[0x10 * hi + lo for lo, hi in zip(range(0, 16, 2), range(1, 16, 2))]
                             + [0] * 8]]], dtype=torch.uint8)  # fmt: skip
    scales = torch.full((1, 1, 1), 127, dtype=torch.uint8)
    got = [row[0] for row in oracle(blocks, scales)[0][:16]]
    assert got == E2M1 and str(got[8]) == "-0.0"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_equals_the_format_oracle_bitwise(dtype):
    # Scales 0..254 for bf16/fp32 (their exponent range holds every product exactly); fp16's
    # range is narrower, so its scales stay where every product is a normal fp16 number.
    scale_range = (115, 130) if dtype == torch.float16 else (0, 255)
    blocks, scales = random_packed(2, 3, 2, seed=0, scale_range=scale_range)
    blocks[0, 0, 0, :] = torch.arange(0, 256, 16, dtype=torch.uint8)  # every high nibble
    if dtype != torch.float16:
        scales[0, :, 0] = torch.tensor([0, 254, 127], dtype=torch.uint8)  # extreme scales
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == (2, 64, 3) and got.dtype == dtype  # [E, in, out]
    want = torch.tensor(oracle(blocks, scales), dtype=torch.float64).to(dtype)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dequantize_equals_transformers_bitwise(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_packed(4, 24, 3, seed=1)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == want.shape and torch.equal(bits(got), bits(want))


def test_bad_blocks_and_scales_are_one_line_errors():
    blocks, scales = random_packed(1, 2, 2, seed=2)
    scales[0, 1, 1] = 255
    with pytest.raises(CheckpointError, match="scale byte 255"):
        dequantize_mxfp4(blocks, scales, torch.bfloat16)
    with pytest.raises(CheckpointError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[:, :, :1], torch.bfloat16)
    with pytest.raises(CheckpointError, match="must be uint8"):
        dequantize_mxfp4(blocks.int(), scales, torch.bfloat16)


def test_quantizer_round_trips_representable_weights():
    """The test quantizer (tests.support) inverts the dequantizer on representable weights."""
    w = representable_experts((3, 64, 8), seed=3)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2)
    assert torch.equal(bits(dequantize_mxfp4(blocks, scales, torch.float32)), bits(w))
    with pytest.raises(ValueError, match="not exactly representable"):
        quantize_mxfp4(w + 1e-3)


@pytest.fixture(scope="module")
def bf16_and_mxfp4_dirs(tmp_path_factory):
    """The same tiny gpt-oss (H 64, I 32: gate/up inputs in 2 groups of 32, down's in 1) in
    the bf16 layout and in the released MXFP4 layout."""
    root = tmp_path_factory.mktemp("mxfp4")
    plain = save_moe_target(gpt_oss_config(), root / "bf16")
    set_experts(plain, seed=4)
    return plain, write_mxfp4_checkpoint(plain, root / "mxfp4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mxfp4_checkpoint_loads_bitwise_equal(bf16_and_mxfp4_dirs, dtype):
    from safetensors import safe_open

    plain, packed = bf16_and_mxfp4_dirs
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    assert "model.layers.0.mlp.experts.down_proj_scales" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in names
    a = load_native_target(plain, "cpu", dtype, 1, 32)
    b = load_native_target(packed, "cpu", dtype, 1, 32)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(bits(sa[k]), bits(sb[k])), k
    w = sb["model.layers.1.mlp.experts.down_proj"]
    assert w.dtype == dtype and w.abs().max() > 0
    ids = torch.randint(3, 500, (1, 20), generator=torch.Generator().manual_seed(5))
    slots = Slots(torch.tensor([0]), torch.arange(20)[None])
    assert torch.equal(a(ids, slots).logits, b(ids, slots).logits)


def test_transformers_reads_the_written_layout_as_we_do(bf16_and_mxfp4_dirs):
    """transformers' own loader (its MXFP4 quantizer, dequantizing on the CPU) reads the MXFP4
    checkpoint the tests write into the same expert weights as the native loader: the layout
    is the released one, not one our dequantizer and our writer merely agree on."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    _, packed = bf16_and_mxfp4_dirs
    hf = AutoModelForCausalLM.from_pretrained(
        str(packed),
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True),
    )
    ours = dict(load_native_target(packed, "cpu", torch.float32, 1, 32).named_parameters())
    for name, p in hf.named_parameters():
        assert torch.equal(bits(ours[name]), bits(p.detach().float())), name
