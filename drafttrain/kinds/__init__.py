"""Training side of each drafter kind, one package each (`<kind>/config.py`, `objective.py`
and its `TrainSpec` in `__init__.py`). `drafttrain.registry.load_train_kinds` imports every
package here; each registers itself. Nothing outside a kind's own folder names it."""
