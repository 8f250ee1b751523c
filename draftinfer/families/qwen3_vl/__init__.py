"""The Qwen3-VL target family (vision tower, DeepStack, interleaved M-RoPE): the native model
(`model.py`), image+text conversations through the target's processor (`processor.py`), and
the family's registration. A drafter of this family sees `[3, N]` positions and rows whose
consumed token is an image placeholder, whose input embedding is the vision tower's
(`draftinfer.conventions.window.TokenEmbeds`)."""

from __future__ import annotations

from pathlib import Path

from draftinfer.families.qwen3_vl.model import Qwen3VLForConditionalGeneration
from draftinfer.files.errors import DataError
from draftinfer.registry import FamilySpec, register_family


class Qwen3VLFamily(FamilySpec):
    name = "qwen3_vl"
    models = {"Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration}
    requires = frozenset({"multimodal_window", "mrope_positions"})
    takes_images = True

    def decoder_config(self, config):
        # The language model's sizes sit under `text_config`; the top level is the wrapper's.
        return {**config, **(config.get("text_config") or {})}

    def prompt_encoder(self, target_path: str):
        from draftinfer.families.qwen3_vl.processor import ProcessorPromptEncoder

        return ProcessorPromptEncoder(target_path)

    def render_prompts(self, named, target_path: str, max_len: int, base_dir: Path | None):
        """Each conversation through the processor with the generation prompt (image parts
        allowed); a prompt longer than `max_len` is a one-line `DataError` naming it (cutting
        it could split an image)."""
        encoder = self.prompt_encoder(target_path)
        out = []
        for name, conv in named:
            prompt = encoder.encode(conv, name, base_dir=base_dir)
            if len(prompt.ids) > max_len:
                raise DataError(
                    f"{name}: prompt of {len(prompt.ids)} tokens (image tokens included) does "
                    f"not fit max_model_len (at most {max_len})"
                )
            out.append(prompt)
        return out, encoder.tokenizer


register_family(Qwen3VLFamily())

__all__ = ["Qwen3VLFamily", "Qwen3VLForConditionalGeneration"]
