"""Training objectives by drafter kind (same names as `draftinfer.drafters.DRAFTERS`)."""

from drafttrain.objectives.eagle3 import Eagle3Objective
from drafttrain.objectives.ptd import PTDObjective

OBJECTIVES: dict[str, type] = {"eagle3": Eagle3Objective, "ptd": PTDObjective}

__all__ = ["OBJECTIVES", "Eagle3Objective", "PTDObjective"]
