"""User-facing errors shared by training and inference. Each has a one-line message that
names the problem; the CLIs print it without a traceback."""


class DraftError(ValueError):
    """Base class for bad input: configs, files, data, checkpoints."""


class ConfigError(DraftError):
    """A config value is wrong or inconsistent with the target."""


class CheckpointError(DraftError):
    """A checkpoint on disk is missing, corrupted, or of the wrong kind or size."""


class DataError(DraftError):
    """The dataset or tokenizer cannot give what training (or the runner's prompts) need."""
