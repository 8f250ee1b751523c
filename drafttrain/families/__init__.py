"""Training side of each target family, one package each (`<family>/__init__.py` registers its
`TrainFamily`). `drafttrain.registry.TRAIN_FAMILIES` imports every package here; each
registers itself. Nothing outside a family's own folder names it."""
