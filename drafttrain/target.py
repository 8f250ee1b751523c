"""The frozen target: load any HF causal LM and capture what drafter training needs.

Aux taps (DESIGN 3.2): tap `j` is the hidden state *entering* decoder layer `j` exactly as
that layer receives it, captured by a forward pre-hook, so only the tapped layers' inputs
are kept (never every layer's hidden states). For text models this equals HF's
`output_hidden_states[j]`; for Qwen3-VL it differs by the DeepStack add, which is why we
hook instead of reading `hidden_states`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from draftinfer.paths import resolve_path
from drafttrain.config import TargetConfig
from drafttrain.errors import TargetError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise TargetError(f"target.dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default taps: low, middle and high layers (2, L//2, L-3)."""
    return [2, num_layers // 2, num_layers - 3]


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _is_hub_id(path: str) -> bool:
    """`org/name` with no leading `.`, `/` or `~`: something `from_pretrained` may fetch."""
    return bool(_HUB_ID.match(path))


def resolve_target_path(name_or_path: str) -> str:
    """`zoo:` shorthand resolved; a one-line `TargetError` for a local path that is missing."""
    path = resolve_path(name_or_path)
    if not Path(path).expanduser().exists() and not _is_hub_id(path):
        raise TargetError(
            f"target not found: {name_or_path!r} is neither a local directory "
            "nor a hub id (org/name)"
        )
    return path


def load_target_model(cfg: TargetConfig, device: torch.device) -> nn.Module:
    """`from_pretrained` in eval mode with grads off; a one-line `TargetError` on failure."""
    from transformers import AutoModelForCausalLM

    path = resolve_target_path(cfg.name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=resolve_dtype(cfg.dtype, device),
            trust_remote_code=cfg.trust_remote_code,
            revision=cfg.revision,
            attn_implementation=cfg.attn_implementation,
        )
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"cannot load target {cfg.name_or_path!r}: {first}") from None
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of an HF causal LM (Llama, Qwen2/3, Mistral, ...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TargetError(f"target {type(model).__name__} has no decoder `layers`; unsupported")
    return layers


@dataclass
class TargetBatchOutput:
    aux: torch.Tensor  # [B, T, n_taps * H] taps concatenated in `aux_layer_ids` order
    logits: torch.Tensor  # [B, T, V] full-vocabulary target logits (fp32)


class FrozenTarget:
    """Frozen target + aux-tap capture. Call it on a padded batch."""

    def __init__(self, cfg: TargetConfig, device: torch.device, aux_layer_ids: list[int] | None):
        self.cfg = cfg
        self.device = device
        self.model = load_target_model(cfg, device)
        self.config = self.model.config
        self.layers = decoder_layers(self.model)
        self.num_layers = len(self.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.aux_layer_ids = (
            list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(self.num_layers)
        )
        bad = [j for j in self.aux_layer_ids if not 0 <= j < self.num_layers]
        if bad:
            raise TargetError(
                f"aux_layer_ids {bad} out of range for a target with "
                f"{self.num_layers} decoder layers"
            )

    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def output_embeddings(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def final_norm_weight(self) -> torch.Tensor | None:
        norm = getattr(self.model.get_decoder(), "norm", None)
        return None if norm is None else norm.weight

    @torch.no_grad()
    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        layer_ids: list[int] | None = None,
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Run the target; return ({j: input of layer j `[B, T, H]`}, logits `[B, T, V]`)."""
        layer_ids = self.aux_layer_ids if layer_ids is None else layer_ids
        taps: dict[int, torch.Tensor] = {}
        handles = []
        for j in set(layer_ids):

            def hook(_mod, args, kwargs, j=j):
                hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                taps[j] = hs

            handles.append(self.layers[j].register_forward_pre_hook(hook, with_kwargs=True))
        try:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return taps, out.logits.float()

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TargetBatchOutput:
        taps, logits = self.capture(input_ids, attention_mask)
        aux = torch.cat([taps[j] for j in self.aux_layer_ids], dim=-1)
        return TargetBatchOutput(aux=aux, logits=logits)
