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


def run_or_exit(job, *args):
    """A command line's call of its job: the result, or a bad-input `DraftError` printed as one
    `error: ...` line on stderr and exit status 2 (no traceback)."""
    import sys

    try:
        return job(*args)
    except DraftError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
