"""Parallel drafting (`ptd`, P-EAGLE style) on the EAGLE-3 architecture.

A learned `mask_hidden` (stored at the *aux* width `[1, 1, 3 * target_hidden]`, i.e. before
`fc`) and a mask token id fill K-1 extra slots after the last committed row, so ONE drafter
forward yields K drafts: the last committed row (depth 0) gives draft 1, mask slot `m` at
position `p_last + m` gives draft `m + 1` (conventions 3 and 9). A mask slot attends to the
committed context and to the lower mask slots of its own rollout.

Everything else (layers, norms, vocabulary maps, the serving layout) is the EAGLE-3 drafter's:
this module only adds the mask parameters and the config fields engines read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from draftinfer.drafters.eagle3 import Eagle3Config, Eagle3Drafter


@dataclass
class PTDConfig(Eagle3Config):
    kind: ClassVar[str] = "ptd"

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

    speculators_type: ClassVar[str] = "peagle"
    speculators_architecture: ClassVar[str] = "PEagleSpeculator"

    def speculators_config(self, verifier: str, k: int) -> dict[str, Any]:
        return {**super().speculators_config(verifier, k), "mask_token_id": self.mask_token_id}

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> PTDConfig:
        c = super().from_hf(d)
        token = next(
            (d[k] for k in ("ptd_token_id", "pard_token", "mask_token_id") if d.get(k) is not None),
            None,
        )
        if token is None:
            from draftinfer.errors import CheckpointError

            raise CheckpointError(
                "parallel drafter config has no ptd_token_id / pard_token / mask_token_id"
            )
        c.mask_token_id = int(token)
        c.parallel_k = int(d.get("parallel_k", 4))
        return c


class PTDDrafter(Eagle3Drafter):
    config_class = PTDConfig
    parallel = True  # one forward yields K drafts; refuses chain mode

    def __init__(self, config: PTDConfig):
        super().__init__(config)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, 3 * config.target_hidden_size))
        nn.init.normal_(self.mask_hidden, std=0.02)

    def mask_feature(self) -> torch.Tensor:
        """The carried feature of every mask slot: `fc(mask_hidden)` `[H]`."""
        return self.fc(self.mask_hidden)[0, 0]
