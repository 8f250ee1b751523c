"""Target families, one package each (`<family>/__init__.py` registers its `FamilySpec`;
`<family>/model.py` its native model). `draftinfer.registry.FAMILIES` imports every package
here; each registers itself. Nothing outside a family's own folder names it."""
