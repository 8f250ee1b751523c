"""The EAGLE-3 checkpoint in vllm-project/speculators' layout (the `speculators/` folder of an
export), for `Eagle3DraftModel` / `PEagleDraftModel.from_pretrained(<export>/speculators)`.

What speculators 0.9.0 reads, checked in its source (`speculators/config.py`,
`speculators/model.py`, `speculators/models/eagle3/{config,core,model_definitions}.py`,
`speculators/models/peagle/{config,core}.py`):

- `config.json` must carry `speculators_model_type` (`eagle3`, or `peagle` for a parallel
  drafter); without it `from_pretrained` only auto-converts DFlash checkpoints. Fields:
  `transformer_layer_config` (a transformers config dict; its `model_type` picks the decoder
  classes, `llama` here, and its `head_dim`, rope fields and `vocab_size` = the target's
  vocabulary), `draft_vocab_size`, `norm_before_residual`, `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids` (distinct, within `[0, L]`), and `speculators_config`
  with `verifier.name_or_path` (a hub id or local directory: speculators reads the verifier's
  `config.json` and its `embed_tokens` / `lm_head` / `model.norm` weights from there) and
  `verifier.architectures` (required by its `VerifierConfig`).
- tensors: `fc.weight`, `layers.{i}.*` (layer 0 with `hidden_norm` and 2H-wide q/k/v; no
  `midlayer.*` alias), `norm.weight`, `lm_head.weight` (kept from the checkpoint when
  present), and `d2t` / `t2d` only when the draft vocabulary is smaller than the target's
  (otherwise the model has no such buffers). P-EAGLE adds `mask_hidden` `[1, 1, 3H]` and
  reads `mask_token_id` from the top level of the config.
- `embed_tokens.weight`, the target's input embedding, is written too. speculators means to
  fetch it from the verifier when a checkpoint lacks it (`load_verifier_weights` fills it
  when it is still NaN), but under transformers 5 `from_pretrained` builds the model on the
  meta device, so the NaN marker never reaches the materialized tensor and the embedding is
  left as uninitialized memory (seen with transformers 5.23; speculators' own checkpoints
  always carry the tensor, so its tests do not meet this). Storing it makes the load exact.

The main export keeps the vLLM / SGLang layout (`config.json` without `speculators_model_type`,
`midlayer.*` for one layer), so this layout is a separate folder with its own config and
weights (docs/training.md, "Export format").
"""

from __future__ import annotations

from typing import Any

import torch

from draftinfer.files.errors import CheckpointError

# Fields of the drafter's config.json that speculators reads from `transformer_layer_config`.
_LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "hidden_act",
    "attention_bias",
    "model_type",
)


def speculators_config(
    arch, verifier: str, verifier_architectures: list[str], k: int
) -> dict[str, Any]:
    """`config.json` of the speculators folder for an EAGLE-3-family architecture `arch`
    (its class names the speculators type and architecture); `k` = drafts per round."""
    hf = arch.to_hf()
    return {
        "architectures": [arch.speculators_architecture],
        "speculators_model_type": arch.speculators_type,
        "transformer_layer_config": {key: hf[key] for key in _LAYER_KEYS},
        "draft_vocab_size": arch.draft_vocab_size,
        "norm_before_residual": arch.norm_before_residual,
        "target_hidden_size": arch.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(arch.aux_layer_ids),
        "speculators_config": {
            "algorithm": arch.speculators_type,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(verifier_architectures),
            },
        },
    }


def speculators_tensors(module, input_embeddings: torch.Tensor) -> dict[str, torch.Tensor]:
    """The drafter's tensors under speculators' names: module names (`layers.{i}.*`) plus the
    target's input embedding `[V, H]`, without the vocabulary maps when the draft vocabulary
    is the full one (speculators then has none)."""
    want = tuple(module.embed_tokens.weight.shape)
    if tuple(input_embeddings.shape) != want:
        raise CheckpointError(
            f"target embedding {tuple(input_embeddings.shape)} does not fit the drafter "
            f"(vocab {want[0]}, hidden {want[1]})"
        )
    sd = module.trainable_state_dict()
    if module.config.draft_vocab_size == module.config.vocab_size:
        sd = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    return {"embed_tokens.weight": input_embeddings, **sd}
