"""The block drafter in vllm-project/speculators' layout (the export's `speculators/` folder).

What speculators reads, from its source (`src/speculators/models/dflash/{config,core,dflash2}.py`
on main, read 2026-09; REFERENCES A3). speculators 0.9.0's own `DFlashDraftModel.from_pretrained`
loads a plain DFlash folder as written and its blocks give our runner's logits
(`tests/jobs/test_third_party_loaders.py`); the DFlash2 layout is not loaded by any test.

- `config.json`: `speculators_model_type` `dflash` (`dflash2` with the conv and the selector),
  `architectures` (`DFlashSpeculator` / `DFlash2DraftModel`), `transformer_layer_config` (a
  Qwen3 config dict: its `num_hidden_layers` is the *draft* layer count, its `vocab_size` the
  target's), `draft_vocab_size`, `block_size`, `target_hidden_size`,
  `aux_hidden_state_layer_ids` in vLLM's *slot* numbering (= DFlash `t + 1` = our taps),
  `mask_token_id`, `sliding_window_non_causal` (false: sliding layers causal in the block,
  as ours), `sample_from_anchor` (false: the anchor slot does not draft), `speculators_config`
  (greedy proposals of `block_size - 1` tokens, the verifier's name and architectures);
  DFlash2 adds `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`.
- DSpark (`speculators_model_type` `dspark`, `architectures` `DSparkSpeculator`, speculators
  0.9.0 `models/dspark/`): `sample_from_anchor`, `markov_rank` (0: no Markov head),
  `markov_head_type` (`vanilla` / `gated`), `enable_confidence_head`,
  `confidence_head_with_markov`, all written explicitly (its defaults are all "on"); tensors
  `markov_head.markov_w1.weight [V, r]`, `markov_head.markov_w2.weight [V, r]`,
  `markov_head.gate_proj.{weight,bias}` (gated), `confidence_head.proj.{weight,bias}`: our
  module's names. speculators 0.9.0's `DSparkDraftModel.from_pretrained` loads it and its
  forward gives our logits and confidences (`tests/kinds/test_dflash_speculators_dspark.py`).
- tensors: the z-lab names (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`), plus
  `embed_tokens.weight` and `lm_head.weight` (the target's; speculators reloads them from the
  verifier, storing them makes the load exact whatever its meta-device handling does). The
  vocabulary is never pruned, so there are no `d2t` / `t2d`. speculators' `CandidateSelector`
  holds its codebooks as `nn.Embedding`s: `candidate_selector.{predecessor,successor}_codebook.weight`.

A causal block (the JetSpec option) has no speculators field (its full-attention layers are
always bidirectional), so such a drafter has no speculators layout. Neither has a drafter with
sliding-window layers: speculators 0.9.0 reads a window otherwise than we train and vLLM serves
it (`models/dflash/attention.py`: a context key is in the window iff `k >= anchor - W`, and the
block's own keys are never windowed; ours and vLLM's: `q - k < W` from the query's own
position, REFERENCES A1), so its logits differ wherever the window bites (measured: up to 0.33
on the small sliding drafter with W = 6 < B = 16; equal with W = 40); and vLLM's conversion
of this layout (#47745, fix #56692 open) turns `sliding_window_non_causal: false` into a global
`dflash_config.causal: true` that makes the full-attention layers causal too. The z-lab layout
at the export's root carries such drafters per layer. LiLiCorr has no speculators algorithm at
all, so a LiLiCorr drafter has no speculators layout either.
"""

from __future__ import annotations

from typing import Any

import torch

from draftinfer.files.errors import CheckpointError

_LAYER_KEYS = (
    "model_type",
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
)


def speculators_config(
    arch, verifier: str, verifier_architectures: list[str], k: int
) -> dict[str, Any] | None:
    """The speculators `config.json` of architecture `arch` (None for a causal block,
    sliding-window layers or LiLiCorr, which speculators has no algorithm for: module
    docstring)."""
    if arch.causal_block or "sliding_attention" in arch.layer_types or arch.lilicorr:
        return None
    hf = arch.to_hf()
    algorithm = "dflash2" if arch.dflash2 else arch.speculators_type
    d = {
        "architectures": ["DFlash2DraftModel" if arch.dflash2 else arch.speculators_architecture],
        "speculators_model_type": algorithm,
        "transformer_layer_config": {key: hf[key] for key in _LAYER_KEYS},
        "draft_vocab_size": arch.vocab_size,
        "block_size": arch.block_size,
        "target_hidden_size": arch.hidden_size,
        "aux_hidden_state_layer_ids": list(arch.tap_layer_ids),
        "mask_token_id": arch.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(verifier_architectures),
            },
        },
    }
    if arch.dspark:
        # speculators' `dspark` (`DSparkSpeculatorConfig`, `DSparkDraftModel`): the DFlash
        # fields plus the Markov and confidence heads, each flag written (its defaults are
        # DSpark's: anchor slot drafting, rank 256, both heads on, confidence with Markov).
        d.update(
            architectures=["DSparkSpeculator"],
            speculators_model_type="dspark",
            sample_from_anchor=arch.sample_from_anchor,
            markov_rank=arch.markov_rank,
            markov_head_type=arch.markov_head_type,
            enable_confidence_head=arch.confidence_head,
            confidence_head_with_markov=arch.confidence_head_with_markov,
        )
        d["speculators_config"]["algorithm"] = "dspark"
    if arch.dflash2:
        d.update(
            conv_kernel_size=arch.conv_kernel_size,
            conv_group_size=arch.conv_group_size,
            selector_rank=arch.selector_rank,
            selector_top_k=arch.selector_top_k,
        )
    return d


def speculators_tensors(
    module, input_embeddings: torch.Tensor, output_embeddings: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The drafter's tensors under speculators' names plus the target's embedding and head."""
    V, H = module.config.vocab_size, module.config.hidden_size
    for name, t in (("embedding", input_embeddings), ("head", output_embeddings)):
        if tuple(t.shape) != (V, H):
            raise CheckpointError(
                f"target {name} {tuple(t.shape)} does not fit the drafter (vocab {V}, hidden {H})"
            )
    sd = {}
    for name, t in module.trainable_state_dict().items():
        if name.startswith("candidate_selector.") and name.endswith("_codebook"):
            name += ".weight"
        sd[name] = t
    return {"embed_tokens.weight": input_embeddings, "lm_head.weight": output_embeddings, **sd}
