"""Drafter registry: the same names (`eagle3`, `ptd`, `mtp`) in configs, code and
checkpoint metadata (STYLE rule 5)."""

from __future__ import annotations

from draftinfer.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftinfer.drafters.ptd import PTDConfig, PTDDrafter

# kind -> module class (its `config_class` is the architecture dataclass).
DRAFTERS: dict[str, type] = {"eagle3": Eagle3Drafter, "ptd": PTDDrafter}

__all__ = ["DRAFTERS", "Eagle3Config", "Eagle3Drafter", "PTDConfig", "PTDDrafter"]
