"""Errors a user can cause in training. Each carries a one-line message naming the problem."""

from draftinfer.errors import CheckpointError, ConfigError, DraftError

DraftTrainError = DraftError


class DataError(DraftError):
    """The dataset or tokenizer cannot give what training needs."""


class TargetError(DraftError):
    """The target model cannot be loaded or does not fit the drafter."""


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DraftError",
    "DraftTrainError",
    "TargetError",
]
