"""The optimizer loop and what it is applied with from outside the model code: checkpoints,
the optimizer, loggers, data parallel, compile / activation checkpointing, sharded outputs."""
