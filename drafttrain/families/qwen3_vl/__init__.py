"""The Qwen3-VL target family on the training side: transformers' own
`Qwen3VLForConditionalGeneration` behind the target interface (`target.py`), image+text chat
through its processor (`data.py`), and the serving facts of its drafters' exports."""

from __future__ import annotations

from typing import Any

import torch

from drafttrain.jobs.config import TargetConfig
from drafttrain.registry import TrainFamily, register_train_family

# Where vLLM's behaviour for these drafters was read (docs/training.md, "Exporting a drafter
# of a Qwen3-VL target").
VLLM_SOURCES = {
    "registry": "vllm/model_executor/models/registry.py",
    "eagle_model": "vllm/model_executor/models/llama_eagle3.py",
    "eagle_config": "vllm/transformers_utils/configs/eagle.py",
    "rope": "vllm/model_executor/layers/rotary_embedding/__init__.py",
    "uses_mrope": "vllm/transformers_utils/config.py",
    "proposer": "vllm/v1/spec_decode/eagle.py",
}


class Qwen3VLTrainFamily(TrainFamily):
    name = "qwen3_vl"
    # The offline cache stores text features only: no vision embeddings, no [3, T] positions.
    feature_cache = False
    pipeline_tag = "image-text-to-text"

    def target(self, cfg: TargetConfig, device: torch.device):
        from drafttrain.families.qwen3_vl.target import Qwen3VLFrozenTarget

        return Qwen3VLFrozenTarget(self.target_config(cfg), device)

    def data(self, target_name: str, tokenizer):
        from draftinfer.families.qwen3_vl.processor import load_processor
        from drafttrain.families.qwen3_vl.data import VLChatData

        return VLChatData(load_processor(target_name))

    def rollout_inputs(self, mm_inputs, prompt_len, total_len, device):
        """The base's, plus `image_rows` (each image's batch row: 0, a one-sequence batch)."""
        out = super().rollout_inputs(mm_inputs, prompt_len, total_len, device)
        if "image_grid_thw" in out:
            out["image_rows"] = torch.zeros(
                out["image_grid_thw"].shape[0], dtype=torch.long, device=device
            )
        return out

    def export_fields(self, target_config: Any) -> dict[str, Any]:
        # SpecForge's VL drafter configs name the target family this way; engines ignore it.
        return {"target_model_type": target_config.model_type}

    def card_notes(self, spec, arch) -> list[str]:
        taps = "layer_inputs" in spec.needs  # a drafter over aux taps (EAGLE-3, P-EAGLE, DFlash)
        # vLLM keeps an `eagle3` draft whose architecture starts or ends with `Eagle3`
        # (`VLLM_SOURCES["eagle_config"]`): the notes on its EAGLE-3 class apply to those only.
        archs = spec.hf_config(arch).get("architectures") or []
        eagle = any(a.startswith("Eagle3") or a.endswith("Eagle3") for a in archs)
        notes = [
            "Target family Qwen3-VL: the drafter was trained on the target's own `[3, N]` "
            "interleaved M-RoPE positions"
            + (
                ", with DeepStack-inclusive aux taps (the input each tapped decoder layer receives)"
                if taps
                else ""
            )
            + " and, where its rows consume an image token, that token's vision embedding."
        ]
        if taps:
            notes.append(
                "`config.json` carries the target's `mrope_section` with `mrope_interleaved: "
                "true` under `rope_scaling` and `rope_parameters`: vLLM gives a draft model "
                "3-D positions only when the *draft* config declares M-RoPE "
                f"(`uses_mrope`, `{VLLM_SOURCES['proposer']}`), and its M-RoPE rotary defaults "
                f"to the non-interleaved (Qwen2-VL) layout (`{VLLM_SOURCES['rope']}`)."
            )
        if eagle:
            notes.append(
                "vLLM loads `LlamaForCausalLMEagle3` and `Eagle3Qwen3vlForCausalLM` with the same "
                f"class, `Eagle3LlamaForCausalLM` (`{VLLM_SOURCES['registry']}`)."
            )
        if not taps:
            notes.append(
                "vLLM and SGLang load next-token (MTP) modules only as part of a target "
                "architecture that ships them, and no Qwen3-VL architecture does: serve this "
                "drafter with `draftinfer`."
            )
        if spec.parallel_drafting:
            notes.append(
                "vLLM refuses parallel drafting with an M-RoPE drafter (`_raise_if_mrope`: "
                '"Speculative Decoding with draft models or parallel drafting does not support '
                f'M-RoPE yet", `{VLLM_SOURCES["proposer"]}`); serve it with `draftinfer`. With '
                "`mrope_section` removed from `config.json` vLLM serves it as a text-only draft "
                '(it warns "Proceeding with text-only speculative decoding") with 1-D '
                "positions, row T of the target's M-RoPE positions (`_set_positions`: "
                "`positions[0]`): `python -m draftinfer drafter=<this dir> "
                "drafter_positions=1d` measures the acceptance that costs on your prompts."
            )
        return notes


register_train_family(Qwen3VLTrainFamily())
