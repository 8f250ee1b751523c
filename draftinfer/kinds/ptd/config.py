"""Parallel-drafting (`ptd`, P-EAGLE / PTD) architecture: the EAGLE-3 layout plus the mask
token id (under every name vLLM and speculators read), `parallel_drafting: true` and the K it
was trained for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from draftinfer.files.checkfields import require, require_any
from draftinfer.kinds.eagle3.config import Eagle3Config


@dataclass
class PTDConfig(Eagle3Config):
    kind: ClassVar[str] = "ptd"
    speculators_type: ClassVar[str] = "peagle"
    speculators_architecture: ClassVar[str] = "PEagleSpeculator"

    num_hidden_layers: int = 2
    # Token id the mask slots consume (a reserved id of the target vocabulary).
    mask_token_id: int = 0
    # K the drafter was trained for: one forward yields up to this many drafts.
    parallel_k: int = 4

    def to_hf(self) -> dict[str, Any]:
        d = super().to_hf()
        # vLLM reads the mask token from `pard_token` / `ptd_token_id` (and newer versions
        # from `mask_token_id`); speculators' P-EAGLE uses `mask_token_id`.
        d.update(
            parallel_drafting=True,
            pard_token=self.mask_token_id,
            ptd_token_id=self.mask_token_id,
            mask_token_id=self.mask_token_id,
            parallel_k=self.parallel_k,
        )
        return d

    @classmethod
    def hf_fields(cls, d: dict[str, Any], where: str) -> dict[str, Any]:
        fields = super().hf_fields(d, where)
        fields["mask_token_id"] = int(
            require_any(d, ("ptd_token_id", "pard_token", "mask_token_id"), where)
        )
        fields["parallel_k"] = int(require(d, "parallel_k", where))
        return fields
