"""The one home of configuration (installed as the package `draftconf`, data only): the Hydra
trees of `python -m drafttrain` (`drafttrain/`: presets and one group per axis) and of
`python -m draftinfer` (`draftinfer/`: runner, eval and suite presets), and the multi-GPU
launchers' files (`launch/`: accelerate and DeepSpeed). Found through the installed package
(`draftinfer.files.paths.conf_dir`), never through the current directory."""
