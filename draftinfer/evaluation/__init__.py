"""The runner's jobs: `python -m draftinfer` (`run`: held-out prompts; `suite_run`: the
acceptance suites), their config schema, prompts and chat data, reports and metrics' tables."""
