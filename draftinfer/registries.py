"""Registries of named variants (STYLE rule 5): drafter kinds (`draftinfer.registry`,
`drafttrain.registry`) and target families (`draftinfer.families`, `drafttrain.families`) are
each a folder per variant that registers itself when its package is imported."""

from __future__ import annotations

import importlib
import pkgutil


class NamedRegistry(dict):
    """Name -> spec (drafter kinds, target families). Filled by the packages under `package`
    (each registers itself when imported; all are imported once, on first lookup) or by
    `register` (tests)."""

    def __init__(self, package: str, error: type[Exception], label: str):
        super().__init__()
        self.package, self.error, self.label = package, error, label
        self._loaded = False

    def register(self, spec):
        if not spec.name:
            raise ValueError(f"{type(spec).__name__} has no name")
        self[spec.name] = spec
        return spec

    def unregister(self, name: str) -> None:
        self.pop(name, None)

    def load(self) -> NamedRegistry:
        if not self._loaded:
            self._loaded = True
            pkg = importlib.import_module(self.package)
            for mod in pkgutil.iter_modules(pkg.__path__):
                importlib.import_module(f"{self.package}.{mod.name}")
        return self

    def spec(self, kind: str):
        """The spec of `kind`; a one-line error (of this registry's class) when unknown."""
        self.load()
        if kind not in self:
            raise self.error(f"unknown {self.label} {kind!r} (known: {sorted(self)})")
        return self[kind]
