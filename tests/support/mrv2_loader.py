"""An independent reader of an Inkling-style (`mrv2`) MTP checkpoint, written from the engine's
documented names and semantics (REFERENCES C, "Checkpoint layouts" and the KV and position
contract), not from our layout adapter or our drafter module:

- config: `num_nextn_predict_layers = N` at top level and in `mtp_config`, with
  `chain_hidden_post_norm` and `mtp_hidden_states_first`;
- tensors: `model.mtp.layers.{i}.{hidden_norm, embed_norm, input_proj, transformer_block.*}` and
  one `model.mtp.chain_norm`, nothing else (embedding and head are the target's);
- module i: `x = input_proj([hidden_norm(h) ‖ embed_norm(emb)])` (hidden first), the target
  family's decoder layer (transformers' own class), then `chain_norm`, whose output is the
  logits input and, with `chain_hidden_post_norm`, the next module's hidden input;
- step m runs module m at every position p on token `t_{p+m+1}` at RoPE position p.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

BLOCK = "transformer_block."


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class MRv2Reader:
    def __init__(self, path: str | Path):
        import transformers

        path = Path(path)
        self.config = json.loads((path / "config.json").read_text())
        c = self.config
        self.n = int(c["num_nextn_predict_layers"])
        mc = c["mtp_config"]
        if int(mc["num_nextn_predict_layers"]) != self.n:
            raise ValueError("mtp_config.num_nextn_predict_layers != num_nextn_predict_layers")
        self.hidden_first = bool(mc["mtp_hidden_states_first"])
        self.post_norm = bool(mc["chain_hidden_post_norm"])
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        tensors = load_file(str(path / "model.safetensors"))
        expected_parts = {"hidden_norm.weight", "embed_norm.weight", "input_proj.weight"}
        hf = transformers.AutoConfig.for_model(
            **{k: v for k, v in c.items() if k not in ("mtp_config", "drafttrain")}
        )
        hf._attn_implementation = "eager"
        module = importlib.import_module(getattr(transformers, c["architectures"][0]).__module__)
        layer_cls = next(v for k, v in vars(module).items() if k.endswith("DecoderLayer"))
        rotary_cls = next(v for k, v in vars(module).items() if k.endswith("RotaryEmbedding"))
        self.rotary = rotary_cls(hf)
        self.layers = []
        seen = {"model.mtp.chain_norm.weight"}
        for i in range(self.n):
            prefix = f"model.mtp.layers.{i}."
            own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            missing = expected_parts - set(own)
            if missing:
                raise KeyError(f"module {i} lacks {sorted(missing)}")
            block = layer_cls(hf, i).eval()
            block.load_state_dict(
                {k[len(BLOCK) :]: v for k, v in own.items() if k.startswith(BLOCK)}, strict=True
            )
            other = set(own) - expected_parts - {k for k in own if k.startswith(BLOCK)}
            if other:
                raise KeyError(f"module {i} has unexpected tensors {sorted(other)}")
            self.layers.append((own, block))
            seen |= {prefix + k for k in own}
        self.chain_norm = tensors["model.mtp.chain_norm.weight"]
        if set(tensors) != seen:
            raise KeyError(f"unexpected tensors {sorted(set(tensors) - seen)[:4]}")

    @torch.no_grad()
    def module_logits(self, embed_w, head_w, ids, target_hidden, positions):
        """Logits `[T, V]` of steps 0..N-1 over one sequence: ids `[T+N]` (t_0..), the target's
        last hidden state `[T, H]` at positions 0..T-1, positions `[T]` (1-D RoPE)."""
        T = target_hidden.shape[0]
        h = target_hidden
        out = []
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        for m, (own, block) in enumerate(self.layers):
            tok = ids[m + 1 : m + 1 + T]  # position p consumes t_{p+m+1}
            e = _rms(embed_w[tok], own["embed_norm.weight"], self.eps)
            hn = _rms(h, own["hidden_norm.weight"], self.eps)
            x = (
                torch.cat([hn, e] if self.hidden_first else [e, hn], -1)
                @ own["input_proj.weight"].T
            )
            x = x[None]
            pos = positions[None]  # RoPE position p for every module
            y = block(
                x,
                attention_mask=causal,
                position_embeddings=self.rotary(x, pos),
                position_ids=pos,
            )
            y = (y[0] if isinstance(y, tuple) else y)[0]
            normed = _rms(y, self.chain_norm, self.eps)
            out.append(normed @ head_w.T)
            h = normed if self.post_norm else y
        return out
