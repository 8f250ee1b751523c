"""Errors a user can cause in training. Each carries a one-line message naming the problem."""

from draftinfer.files.errors import CheckpointError, ConfigError, DataError, DraftError

DraftTrainError = DraftError


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
