"""The jobs: `python -m drafttrain`'s train -> export -> verify (`job`), the training step
(`train`), the setup every job shares, the config schema, the runner's AL during training,
and the errors a user can cause."""
