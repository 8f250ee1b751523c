"""Shared test support: every fixture builder and helper the tests use lives here, never in a
`test_*.py` module (a test module imports `tests.support.*`, never another test module;
`tests/contracts/test_seams.py` checks this).

- `tiny_models`, `tiny_tokenizers`: tiny random targets of the real architectures saved to disk,
  tokenizers with real chat templates, tiny training environments and recipes;
- `kind_factories`: small random drafters of any registered kind, built by the kind's own
  `TrainSpec.init_drafter`; `eagle3_small`: EAGLE-3 drafters built from an architecture config;
- `presets`: composing the training config tree as `python -m drafttrain` does;
- `prompts`: zoo and random prompts; `sampling_harness`: the statistical sampling harness (T2);
- `vl_fixtures`, `vl_data_fixtures`: the tiny Qwen3-VL target, its processor and image chat data;
- `utils`: the tolerance policy per dtype, NaN-poisoned `torch.empty`, kernel-test devices.

Layout of `tests/` (by area; cost tiers are marks: default = CPU fast, `slow` = CPU
integration, `gpu` / `multi_gpu` = CUDA): `contracts/` (seams and engine-facing contracts),
`kernels/`, `infer/` (runner), `kinds/` (the catalogue over the kind registry and per-kind
tests), `train/` (training, data, cache, regeneration, export, CLI), `families/` (target
families: Qwen3-VL), `jobs/` (whole jobs on the zoo targets, third-party loaders), `gpu/`.
"""
