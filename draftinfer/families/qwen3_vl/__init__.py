"""The Qwen3-VL target family (vision tower, DeepStack, interleaved M-RoPE): the native model
(`model.py`), image+text conversations through the target's processor (`processor.py`), and
the family's registration. A drafter of this family sees `[3, N]` positions and rows whose
consumed token is an image placeholder, whose input embedding is the vision tower's
(`draftinfer.window.TokenEmbeds`)."""

from __future__ import annotations

from pathlib import Path

from draftinfer.errors import DataError
from draftinfer.families import FamilySpec, register_family
from draftinfer.families.qwen3_vl.model import Qwen3VLForConditionalGeneration


class Qwen3VLFamily(FamilySpec):
    name = "qwen3_vl"
    models = {"Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration}
    requires = frozenset({"multimodal_window", "mrope_positions"})

    def render_prompts(self, named, target_path: str, max_len: int, base_dir: Path | None):
        """Each conversation through the processor with the generation prompt (image parts
        allowed); a prompt longer than `max_len` is a one-line `DataError` naming it (cutting
        it could split an image)."""
        from draftinfer.families.qwen3_vl.processor import conversation_inputs, load_processor
        from draftinfer.prompts import Prompt

        processor = load_processor(target_path)
        out = []
        for name, conv in named:
            enc = conversation_inputs(
                processor, conv, add_generation_prompt=True, base_dir=base_dir, sample=name
            )
            ids = [int(t) for t in enc.pop("input_ids")]
            if len(ids) > max_len:
                raise DataError(
                    f"{name}: prompt of {len(ids)} tokens (image tokens included) does not fit "
                    f"max_model_len (at most {max_len})"
                )
            mm = enc if enc["pixel_values"] is not None else None
            out.append(Prompt(ids, mm, name))
        return out, processor.tokenizer


register_family(Qwen3VLFamily())

__all__ = ["Qwen3VLFamily", "Qwen3VLForConditionalGeneration"]
