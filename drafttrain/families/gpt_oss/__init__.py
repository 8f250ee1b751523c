"""The gpt-oss target family on the training side: transformers' own `GptOssForCausalLM`
(attention sinks, sliding windows on the even layers, YaRN, top-k-then-softmax MoE) behind the
text target interface, with

- **eager attention, always** (`ATTN_IMPLEMENTATION`, applied in `target_config`, so every job
  that loads the target through transformers, the frozen target and regeneration's HF backend,
  gets it): transformers has no SDPA path for the sinks (`GptOssPreTrainedModel._supports_sdpa
  = False`: `from_pretrained(attn_implementation="sdpa")` raises) and its flash kernels are Hub
  downloads; eager is the reference the runner's native target is tested against (DESIGN 3.14);
- **the harmony chat format** with a pinned date (`harmony.py`): a hub tokenizer whose template
  stamps today's date renders with the pinned harmony template instead, so tokenized data and
  cached features stay the same from one day to the next; the loss mask covers the assistant's
  channels and their headers (`drafttrain.data.chat`, harmony's `<|return|>` / `<|end|>`);
  a regenerated answer is split at the channels into `thinking` (analysis) and `content`
  (final), which the template renders back as the target wrote them.

The taps need nothing of their own: a forward pre-hook on decoder layer `j` reads the residual
stream entering it (convention 2), whatever the layer's attention type, which is what vLLM's
`GptOssModel` captures for EAGLE-3 aux id `j` (REFERENCES B2).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from drafttrain.families.causal_lm import CausalLMTrainFamily
from drafttrain.families.gpt_oss.harmony import PINNED_DATE, pinned_tokenizer, split_channels
from drafttrain.registry import register_train_family

if TYPE_CHECKING:  # annotations only
    from drafttrain.jobs.config import TargetConfig

# The one statement of it: whatever `target.attn_implementation` says (module docstring).
ATTN_IMPLEMENTATION = "eager"


class GptOssTrainFamily(CausalLMTrainFamily):
    name = "gpt_oss"

    def target_config(self, cfg: TargetConfig) -> TargetConfig:
        return replace(cfg, attn_implementation=ATTN_IMPLEMENTATION)

    def chat_tokenizer(self, tokenizer):
        return pinned_tokenizer(tokenizer)

    def data(self, target_name: str, tokenizer):
        return super().data(target_name, self.chat_tokenizer(tokenizer))

    def assistant_message(self, text: str) -> dict[str, Any]:
        return {"role": "assistant", **split_channels(text)}

    def card_notes(self, spec, arch) -> list[str]:
        notes = [
            "Target family gpt-oss: trained on harmony-format chat (system message dated "
            f"{PINNED_DATE}, `Reasoning: low`); the loss covers everything the target generates "
            "after `<|start|>assistant`: the analysis and final channels, their "
            "`<|channel|>`/`<|message|>` headers and the closing `<|end|>` / `<|return|>`.",
            "The drafter attends with plain full attention (no sinks, no sliding window) and "
            "rotates with the target's own `rope_scaling` (YaRN), which `config.json` carries.",
        ]
        if "layer_inputs" in spec.needs:
            notes.append(
                "Target taps are layer inputs (the residual stream entering a decoder layer), "
                "vLLM's reading of EAGLE-3 aux ids on `GptOssForCausalLM` (default "
                "`(2, L//2, L-3)`: 20b (2, 12, 21), 120b (2, 18, 33)). SpecForge's gpt-oss "
                "recipes name [1, 11, 21] / [1, 17, 33] in SGLang's reading (outputs of those "
                "layers), i.e. taps (2, 12, 22) / (2, 18, 34)."
            )
        return notes


register_train_family(GptOssTrainFamily())
