"""Parallel drafting (`ptd`, P-EAGLE style) on the EAGLE-3 architecture.

A learned `mask_hidden` (stored at the *aux* width `[1, 1, 3 * target_hidden]`, i.e. before
`fc`) and a mask token id fill K-1 extra slots after the last committed row, so ONE drafter
forward yields K drafts: the last committed row (depth 0) gives draft 1, mask slot `m` at
position `p_last + m` gives draft `m + 1` (conventions 3 and 9). A mask slot attends to the
committed context and to the lower mask slots of its own rollout.

Everything else (layers, norms, vocabulary maps, the serving layout) is the EAGLE-3 drafter's:
this module only adds the mask parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from draftinfer.kinds.eagle3.module import Eagle3Drafter
from draftinfer.kinds.ptd.config import PTDConfig


class PTDDrafter(Eagle3Drafter):
    def __init__(self, config: PTDConfig):
        super().__init__(config)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, 3 * config.target_hidden_size))
        nn.init.normal_(self.mask_hidden, std=0.02)

    def mask_feature(self) -> torch.Tensor:
        """The carried feature of every mask slot: `fc(mask_hidden)` `[H]`."""
        return self.fc(self.mask_hidden)[0, 0]
