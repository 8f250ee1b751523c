"""Drafter kinds, one package each (`<kind>/config.py`, `module.py`, `proposer.py` and its
`DrafterSpec` in `__init__.py`). `draftinfer.registry.load_kinds` imports every package here;
each registers itself. Nothing outside a kind's own folder names it."""
