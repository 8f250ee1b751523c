"""Target families (DESIGN 2.1): what the runner needs to know about a kind of target, one
`FamilySpec` per family, registered from the family's own folder under `draftinfer/families/`
(as drafter kinds are under `draftinfer/kinds/`), looked up by name or by HF architecture.

A family answers:
- which HF architectures it serves natively (`models`: `config.json` `architectures[0]` ->
  the native `NativeCausalLM` subclass the runner loads);
- what it `provides` a drafter (features: `layer_inputs` taps, the `final_hidden` state) and
  what it `requires` a drafter to handle (`multimodal_window`: rows whose consumed token is an
  encoder embedding; `mrope_positions`: `[3, N]` RoPE positions);
- how the runner turns chat prompts into its inputs (`render_prompts`: token ids, plus the
  family's extra inputs such as pixel values; `prompt_encoder`: the same one conversation at a
  time) and whether those prompts may hold images (`takes_images`: an image suite such as
  MMStar needs it).

A drafter kind declares the other side (`DrafterSpec.needs`, `DrafterSpec.handles`);
`check_pair` refuses a pair that does not fit with a one-line error, before anything is
loaded or written. The training side (`drafttrain.families`) registers the same names.

An architecture no family claims is served by the default family, `causal_lm` (any HF causal
LM trains; the runner loads the architectures `causal_lm` lists natively).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from draftinfer.errors import ConfigError
from draftinfer.registries import NamedRegistry

DEFAULT_FAMILY = "causal_lm"
# The vocabulary of `FamilySpec.provides` / `requires` and `DrafterSpec.needs` / `handles`.
FEATURES = frozenset({"layer_inputs", "final_hidden"})
INPUT_FORMS = frozenset({"multimodal_window", "mrope_positions"})


class FamilySpec:
    """Base spec of a target family; a family subclasses it in its own folder."""

    name: ClassVar[str] = ""
    # HF `architectures[0]` -> native class (`draftinfer.models.decoder.NativeCausalLM`).
    models: ClassVar[dict[str, type]] = {}
    provides: ClassVar[frozenset[str]] = FEATURES
    requires: ClassVar[frozenset[str]] = frozenset()
    # Whether this family's prompts may hold image parts (its prompt encoder reads them).
    takes_images: ClassVar[bool] = False

    def decoder_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The language decoder's fields of a target `config.json` (vocabulary, hidden size,
        layers, positions): the whole config for a text family."""
        return config

    def prompt_encoder(self, target_path: str) -> Any:
        """An encoder of one conversation at a time, its tokenizer (or processor) loaded once:
        `.tokenizer`, and `.encode(conv, name, template_kwargs, base_dir) -> Prompt` (the whole
        prompt, never cut). For runs that render prompts as they go (multi-turn suites)."""
        from draftinfer.prompts import TextPromptEncoder

        return TextPromptEncoder(target_path)

    def render_prompts(
        self, named: list[tuple[str, list[dict]]], target_path: str, max_len: int, base_dir
    ) -> tuple[list[Any], Any]:
        """(prompts, tokenizer): each `(name, conversation)` rendered with the generation
        prompt into a `draftinfer.prompts.Prompt` (token ids and the family's extra inputs)."""
        from draftinfer.prompts import render_text_prompts

        return render_text_prompts(named, target_path, max_len)


class FamilyRegistry(NamedRegistry):
    """Family name -> spec, filled by the packages under `draftinfer.families`."""

    def for_architectures(self, architectures: list[str] | None) -> FamilySpec:
        """The family claiming the first of `architectures` one claims; the default family
        otherwise."""
        self.load()
        for arch in architectures or ():
            for fam in self.values():
                if arch in fam.models:
                    return fam
        return self.spec(DEFAULT_FAMILY)

    def native_class(self, config: dict[str, Any]) -> type:
        """The native class for a parsed `config.json` (by `architectures`, else by
        `model_type`); a one-line `ConfigError` naming what is supported otherwise."""
        models = {a: c for fam in self.load().values() for a, c in fam.models.items()}
        supported = ", ".join(sorted(models))
        archs = config.get("architectures") or []
        for arch in archs:
            if arch in models:
                return models[arch]
        if not archs:
            model_type = config.get("model_type")
            for cls in models.values():
                if model_type in cls.hf_model_types:
                    return cls
            raise ConfigError(
                f"unsupported target: config.json has no `architectures` and model_type "
                f"{model_type!r} is not native (supported: {supported})"
            )
        raise ConfigError(
            f"unsupported target architecture {', '.join(map(str, archs))} "
            f"(native targets supported: {supported})"
        )

    def native_architectures(self) -> list[str]:
        """Every HF architecture the runner loads natively, sorted."""
        self.load()
        return sorted(a for fam in self.values() for a in fam.models)

    def is_native(self, architecture: str) -> bool:
        return architecture in self.native_architectures()


FAMILIES = FamilyRegistry("draftinfer.families", ConfigError, "target family")


def register_family(spec: FamilySpec) -> FamilySpec:
    """Register a family (called from the family's own `__init__.py`, or by a test)."""
    bad = (spec.provides - FEATURES) | (spec.requires - INPUT_FORMS)
    if bad:
        raise ValueError(f"{type(spec).__name__}: unknown capabilities {sorted(bad)}")
    for cls in spec.models.values():
        if cls.family != spec.name:
            raise ValueError(f"{cls.__name__}.family is {cls.family!r}, not {spec.name!r}")
    return FAMILIES.register(spec)


def unregister_family(name: str) -> None:
    FAMILIES.unregister(name)


def family_spec(name: str) -> FamilySpec:
    """The spec registered under `name`; a one-line `ConfigError` when unknown."""
    return FAMILIES.spec(name)


def registered_families() -> list[str]:
    return sorted(FAMILIES.load())


def family_of(name_or_path: str | Path) -> FamilySpec:
    """The family of a target named by hub id, local path or `zoo:` name, from its
    `config.json` alone (no weights, no transformers config class)."""
    from draftinfer.files import read_target_config

    return FAMILIES.for_architectures(read_target_config(name_or_path).get("architectures"))


def check_pair(drafter_spec, family: FamilySpec) -> None:
    """One-line `ConfigError` when a drafter kind and a target family do not fit: the kind needs
    a feature the family does not provide, or the family's inputs take a form the kind does
    not handle."""
    missing = sorted(drafter_spec.needs - family.provides)
    unhandled = sorted(family.requires - drafter_spec.handles)
    if missing or unhandled:
        why = []
        if missing:
            why.append(f"needs {', '.join(missing)}, which the family does not provide")
        if unhandled:
            why.append(f"does not handle {', '.join(unhandled)}")
        raise ConfigError(
            f"drafter kind {drafter_spec.name!r} cannot run on a {family.name!r} target: it "
            + "; it ".join(why)
        )
