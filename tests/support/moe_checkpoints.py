"""Tiny MoE target checkpoints on disk for the runner's parity tests: transformers' random
init re-drawn so every piece of the architecture matters, and the gpt-oss MXFP4 layout.

- `save_moe_target(config, path)`: `save_pretrained` of a random model of `config`
  (`tests.support.moe_models`), then: router weights drawn wide (decisive routes: no top-k
  near-tie that fp32 rounding could flip between two correct implementations), attention
  sinks of order 1, biases non-zero (transformers' init leaves the experts' and attention
  biases at zero), gpt-oss gate/up weights large enough that the +-`swiglu_limit` clamps bite.
- `quantize_mxfp4(w)`: the OCP MX rule (shared exponent `floor(log2(max|v|)) - 2` per 32 inputs,
  E2M1 codes, low nibble first) for weights that are exactly representable, else an error;
  `representable_experts(shape)` draws such weights (E2M1 values times per-group powers of two).
- `write_mxfp4_checkpoint(src, dst)`: the released gpt-oss layout of a bf16-layout checkpoint
  (`*_blocks` / `*_scales` instead of the expert matrices, biases kept, the config's
  `quantization_config`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.support.tiny_models import save_tiny_target

# E2M1 code -> value (the format, written here from the OCP MX description, not imported).
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def save_moe_target(config, path: Path, seed: int = 0) -> Path:
    """A random target of `config` saved at `path`, its weights re-drawn (module docstring)."""
    from safetensors.torch import load_file, save_file

    save_tiny_target(config, path, seed)
    file = path / "model.safetensors"
    sd = load_file(str(file))
    g = torch.Generator().manual_seed(seed + 1)

    def draw(t: torch.Tensor, std: float) -> torch.Tensor:
        return torch.randn(t.shape, generator=g) * std

    for name, t in sd.items():
        if name.endswith(("mlp.router.weight", "mlp.gate.weight")):
            sd[name] = draw(t, 1.0)
        elif name.endswith("self_attn.sinks"):
            sd[name] = draw(t, 1.0)
        elif name.endswith("bias"):
            sd[name] = draw(t, 0.2)
        elif name.endswith("experts.gate_up_proj"):  # gpt-oss: h = x @ W of std ~4 > 7 at times
            sd[name] = draw(t, 0.5)
    save_file(sd, str(file), metadata={"format": "pt"})
    return path


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w `[E, in, out]` (HF's bf16 layout) -> (blocks `[E, out, in/32, 16]` uint8, scales
    `[E, out, in/32]` uint8). Each group of 32 inputs of one output shares the exponent
    `floor(log2(max|v|)) - 2` (the largest E2M1 magnitude, 6, is 1.5 * 2**2); every value
    divided by it must be an E2M1 value exactly (else `ValueError`: not representable)."""
    E, n_in, n_out = w.shape
    v = w.transpose(1, 2).double().reshape(E, n_out, n_in // 32, 32)
    top = v.abs().amax(-1)  # [E, out, G]
    exp = torch.where(top > 0, torch.floor(torch.log2(top.clamp(min=1e-300))) - 2, 0)
    scaled = v / torch.pow(2.0, exp)[..., None]
    lut = torch.tensor(E2M1[:8], dtype=torch.float64)
    code = (scaled.abs()[..., None] == lut).double().argmax(-1)  # magnitude code 0..7
    if not torch.equal(lut[code], scaled.abs()):
        raise ValueError("weights are not exactly representable in MXFP4")
    code = code + 8 * torch.signbit(scaled).long()  # -0.0 is code 8
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)  # low nibble first
    scales = (exp + 127).to(torch.uint8)
    return blocks, scales


def representable_experts(shape: tuple[int, int, int], seed: int) -> torch.Tensor:
    """`[E, in, out]` weights exactly representable in MXFP4 (and in bf16): per group of 32
    inputs of one output, E2M1 values times a random power of two 2**-9 .. 2**-3."""
    E, n_in, n_out = shape
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (E, n_out, n_in // 32, 32), generator=g)
    exps = torch.randint(-9, -2, (E, n_out, n_in // 32, 1), generator=g).double()
    values = torch.tensor(E2M1, dtype=torch.float64)[codes] * torch.pow(2.0, exps)
    return values.reshape(E, n_out, n_in).transpose(1, 2).float().contiguous()


def write_mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the gpt-oss checkpoint `src` in the released MXFP4 layout (module docstring);
    the expert matrices of `src` must be representable (`representable_experts`)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in sd.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[f"{name}_blocks"], out[f"{name}_scales"] = quantize_mxfp4(t)
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def set_experts(path: Path, seed: int) -> None:
    """Replace the gpt-oss checkpoint's expert matrices at `path` by representable ones."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    sd = load_file(str(file))
    for i, name in enumerate(sorted(sd)):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            sd[name] = representable_experts(tuple(sd[name].shape), seed + i)
    save_file(sd, str(file), metadata={"format": "pt"})


def with_released_mtp_layer(src: Path, dst: Path, layers: int = 1) -> Path:
    """A copy of target checkpoint `src` at `dst` in the layout DeepSeek-V3 and GLM release
    (REFERENCES part D, C4 and D): `layers` MTP layers past the last decoder layer,
    `model.layers.{L+k}.{enorm,hnorm,eh_proj,shared_head.norm}` plus a whole decoder block under
    the same prefix (a copy of the last layer's tensors), and `num_nextn_predict_layers` in the
    config. They belong to a drafter: a target loader must skip them."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    sd = load_file(str(file))
    cfg = json.loads((dst / "config.json").read_text())
    L, H = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    last = f"model.layers.{L - 1}."
    for k in range(layers):
        prefix = f"model.layers.{L + k}."
        for name in [n for n in sd if n.startswith(last)]:
            sd[prefix + name[len(last) :]] = sd[name].clone()
        for name, shape in (
            ("enorm.weight", (H,)),
            ("hnorm.weight", (H,)),
            ("eh_proj.weight", (H, 2 * H)),
            ("shared_head.norm.weight", (H,)),
        ):
            sd[prefix + name] = torch.ones(shape)
    save_file(sd, str(file), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
