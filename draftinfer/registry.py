"""The registries of the runner (STYLE rule 5), in one module: named variants, each a folder
that registers itself when its package is imported.

## Named registries
Registries of named variants (STYLE rule 5): drafter kinds (`draftinfer.registry`,
`drafttrain.registry`) and target families (`draftinfer.families`, `drafttrain.families`) are
each a folder per variant that registers itself when its package is imported.

## Target families
Target families (DESIGN 2.1): what the runner needs to know about a kind of target, one
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


## Drafter kinds
Drafter kinds (DESIGN 2.1 seam 1): one `DrafterSpec` per kind, registered from the kind's
own files under `draftinfer/kinds/<kind>/`, looked up by name (the same name in configs,
code and checkpoint metadata, STYLE rule 5).

Shared code (checkpoint I/O, the engine, the reference loop, the runner, training, export)
asks the spec, never a kind name or a kind-specific attribute. A new kind is new files plus
`register_drafter(MySpec())`; nothing shared is edited.

A spec answers:
- what the kind *is*: `config_class` (architecture dataclass: `kind`, `features`,
  `to_dict`, `to_hf`, `from_hf`), `module_class` (the `nn.Module` training and the runner
  share), `proposer_class` (how the runner drafts with it);
- how it is *served*: `serving_state_dict` / `from_serving_names` (tensor names engines
  load), `hf_config` (config.json fields engines read), `speculators_layout`,
  `serving_hint` (launch lines for the model card);
- what it *checks*: `check_fit(arch, target_info)` (drafter made for this target),
  `validate_state_dict(arch, tensors, where)` (tensor names and shapes, drafting-mode
  tensors: S8), `conventions(arch)` (the conventions a checkpoint records and is checked
  against at load).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from draftinfer.files.errors import CheckpointError, ConfigError


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


# --- target families ----------------------------------------------------------------------


DEFAULT_FAMILY = "causal_lm"
# The vocabulary of `FamilySpec.provides` / `requires` and `DrafterSpec.needs` / `handles`.
# `dense_decoder_layer`: the target's decoder layer is a dense (Llama-shaped) block a drafter
# may copy or mirror (an MTP module is such a block, initialised from the target's last layer);
# a family whose layers route tokens to experts does not provide it.
# `drafter_block`: the runner builds a drafter's decoder block for this family (an MTP module's:
# the dense Llama block where the family provides `dense_decoder_layer`, else the family's own
# native layer, `NativeCausalLM.decoder_layer(cfg, index)`, with its own cache, as DeepSeek's
# MTP layer is a whole decoder layer of the target).
FEATURES = frozenset({"layer_inputs", "final_hidden", "dense_decoder_layer", "drafter_block"})
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
    # The multi-token-prediction layers this family's checkpoints may ship (DESIGN convention
    # 15), as their semantics: `count_key` (the config.json field holding their number), and
    # the drafter fields that serve them as released (`layout`, `mtp_feature_tap`, `mtp_chain`,
    # `mtp_carry`, `mask_pos0_embedding`); None: its checkpoints ship none.
    released_mtp: ClassVar[dict[str, Any] | None] = None
    # How a loaded native target of this family is sharded over a process group in place
    # (`plan(model, group)`, `draftinfer.models.tensor_parallel`; the runner's `tp=N`); None:
    # the family has no tensor-parallel plan and `tp > 1` is refused.
    tensor_parallel: ClassVar[Callable[[Any, Any], None] | None] = None

    def decoder_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The language decoder's fields of a target `config.json` (vocabulary, hidden size,
        layers, positions): the whole config for a text family."""
        return config

    def prompt_encoder(self, target_path: str) -> Any:
        """An encoder of one conversation at a time, its tokenizer (or processor) loaded once:
        `.tokenizer`, and `.encode(conv, name, template_kwargs, base_dir) -> Prompt` (the whole
        prompt, never cut). For runs that render prompts as they go (multi-turn suites)."""
        from draftinfer.evaluation.prompts import TextPromptEncoder

        return TextPromptEncoder(target_path)

    def render_prompts(
        self, named: list[tuple[str, list[dict]]], target_path: str, max_len: int, base_dir
    ) -> tuple[list[Any], Any]:
        """(prompts, tokenizer): each `(name, conversation)` rendered with the generation
        prompt into a `draftinfer.evaluation.prompts.Prompt` (token ids and the family's extra inputs)."""
        from draftinfer.evaluation.prompts import render_text_prompts

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
    from draftinfer.files.target_dir import read_target_config

    return FAMILIES.for_architectures(read_target_config(name_or_path).get("architectures"))


def check_pair(drafter_spec, family: FamilySpec, arch: Any | None = None) -> None:
    """One-line `ConfigError` when a drafter kind and a target family do not fit: the kind (with
    configuration `arch`, when given: `DrafterSpec.needs_for`) needs a feature the family does
    not provide, or the family's inputs take a form the kind does not handle."""
    missing = sorted(drafter_spec.needs_for(arch) - family.provides)
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


# --- drafter kinds ------------------------------------------------------------------------


# Conventions every kind shares (DESIGN section 3); kinds add their own in `conventions()`.
BASE_CONVENTIONS: dict[str, str] = {
    # Convention 1: row i consumes (t_{i+1}, f_i) at pos_i; token 0 has no pair.
    "first_token_convention": "drop",
    # Conventions 1 and 4: row i at draft step k sits at the target position of token i, + k.
    "position_convention": "target_pos_plus_step",
}


class DrafterSpec:
    """Base spec; a kind subclasses it (and may subclass another kind's spec)."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type]
    module_class: ClassVar[type]
    proposer_class: ClassVar[type]
    # Tensors that only this kind's drafting mode has (e.g. a parallel drafter's mask
    # parameters): a checkpoint holding them cannot run as a kind that lacks them (S8).
    mode_tensors: ClassVar[frozenset[str]] = frozenset()
    mode: ClassVar[str] = ""  # how it drafts, for messages: "chain drafting", ...
    # Whether one drafter forward yields several drafts (serving facts differ, e.g. vLLM
    # refuses parallel drafting with M-RoPE drafters).
    parallel_drafting: ClassVar[bool] = False
    # What the kind consumes of a target (`draftinfer.registry.FEATURES`) and the target input
    # forms it copes with (`draftinfer.registry.INPUT_FORMS`); a family whose inputs take a
    # form the kind does not handle is refused (`draftinfer.registry.check_pair`).
    needs: ClassVar[frozenset[str]] = frozenset()
    handles: ClassVar[frozenset[str]] = frozenset()

    def needs_for(self, arch: Any | None) -> frozenset[str]:
        """What a drafter of this kind with configuration `arch` (a runtime or training
        config; None: any) consumes of a target: `needs` unless a kind's option changes it."""
        return self.needs

    def released_arch(self, config: dict[str, Any], family: FamilySpec) -> Any | None:
        """The architecture config of the drafter of this kind that a target checkpoint ships
        in its own files (`config`: its parsed config.json; `family`: the family serving it),
        or None when it ships none (`draftinfer.files.checkpoint.released_drafter`)."""
        return None

    # -- construction ---------------------------------------------------------------------
    def build(self, arch: Any) -> torch.nn.Module:
        return self.module_class(arch)

    def hf_config(self, arch: Any) -> dict[str, Any]:
        """The engine-facing `config.json` fields (ours go under `"drafttrain"`)."""
        return arch.to_hf()

    def arch_from_hf(self, config: dict[str, Any], where: str) -> Any:
        """Parse `config.json`; a missing field is a one-line `CheckpointError` naming it."""
        return self.config_class.from_hf(config, where)

    def attach_shared(self, module: torch.nn.Module, shared: dict[str, torch.Tensor]) -> None:
        """Copy the target weights this kind shares (`"input_embeddings"`,
        `"output_embeddings"`) into `module`; a one-line `CheckpointError` when they do not
        fit. Checkpoints never hold them (engines share the target's)."""
        raise NotImplementedError

    # -- serving layout -------------------------------------------------------------------
    def serving_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return module.trainable_state_dict()

    def wants_tensor(self, arch: Any, name: str) -> bool:
        """Whether a checkpoint tensor (serving name) belongs to this drafter; a kind stored
        inside a target checkpoint (stitched MTP modules) claims only its own."""
        return True

    def from_serving_names(
        self, arch: Any, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return dict(tensors)

    def speculators_layout(
        self,
        module: torch.nn.Module,
        verifier: str,
        verifier_architectures: list[str],
        k: int,
        input_embeddings: Callable[[], torch.Tensor],
        output_embeddings: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """The checkpoint in vllm-project/speculators' layout: (its `config.json`, tensors under
        its names), written to the export's `speculators/` folder; None if the kind has none.
        `verifier` is the target's name as recorded, `k` the drafts per round, and
        `input_embeddings()` / `output_embeddings()` read the target's input embedding and
        output head `[V, H]` (only if needed)."""
        return None

    def serving_hint(self, arch: Any, k: int, target: str, drafter: str) -> str:
        """Markdown for the model card: the launch commands engines serve this export with,
        for `target` (hub id or path) and the drafter at `drafter` (hub id or path), `k` drafts
        per round."""
        return ""

    def stitch(self, export_dir, arch: Any, target_dir, out_dir, replace: bool = False):
        """Write this drafter into a copy of its target checkpoint (engines that load the
        drafter from the target; `replace`: in place of the drafter layers the target ships).
        Kinds that are not part of a target refuse."""
        raise CheckpointError(
            f"a {self.name!r} drafter is not stored inside its target; serve its export directory"
        )

    # -- checks -----------------------------------------------------------------------------
    def conventions(self, arch: Any) -> dict[str, Any]:
        return dict(BASE_CONVENTIONS)

    def check_fit(self, arch: Any, info: Any) -> None:
        """One-line `CheckpointError` when the drafter was not made for a target with these
        facts (`draftinfer.models.target.TargetInfo`)."""
        if arch.vocab_size != info.vocab_size:
            raise CheckpointError(
                f"drafter vocabulary {arch.vocab_size} does not match the target's "
                f"{info.vocab_size}"
            )
        if arch.target_hidden_size != info.hidden_size:
            raise CheckpointError(
                f"drafter expects target hidden size {arch.target_hidden_size}, "
                f"target has {info.hidden_size}"
            )
        bad = [j for j in arch.features.layer_inputs if not 0 <= j < info.num_layers]
        if bad:
            raise CheckpointError(
                f"drafter taps target layers {bad}; the target has {info.num_layers} layers"
            )
        if info.family:
            check_pair(self, family_spec(info.family), arch)
        if arch.max_position_embeddings < info.max_position_embeddings:
            raise CheckpointError(
                f"drafter max_position_embeddings {arch.max_position_embeddings} is shorter "
                f"than the target's {info.max_position_embeddings} (engines would corrupt RoPE "
                "past it)"
            )

    def check_k(self, arch: Any, k: int) -> None:
        """One-line `CheckpointError` when this drafter cannot draft `k` tokens per round."""

    def validate_state_dict(
        self, arch: Any, tensors: dict[str, torch.Tensor], module: torch.nn.Module, where: str
    ) -> None:
        """Tensors (module names) against `module`'s own: drafting-mode tensors first (S8),
        then missing / unexpected names, then shapes."""
        own = module.trainable_state_dict()
        for other in DRAFTERS.values():
            foreign = sorted((other.mode_tensors - self.mode_tensors) & set(tensors))
            if foreign and other.name != self.name:
                raise CheckpointError(
                    f"{where} has {', '.join(foreign)} ({other.mode} of a {other.name!r} "
                    f"drafter) but config.json says drafter_kind {self.name!r}; it cannot run "
                    f"in {self.mode} mode"
                )
        for name in sorted(self.mode_tensors - set(tensors)):
            raise CheckpointError(
                f"{where}: drafter_kind {self.name!r} ({self.mode}) needs {name}, which the "
                "checkpoint lacks"
            )
        missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise CheckpointError(
                f"{where}: tensors do not match a {self.name} drafter "
                f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
            )
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise CheckpointError(
                    f"{where}: tensor {name} has shape {tuple(t.shape)}, config implies "
                    f"{tuple(own[name].shape)}"
                )


def copy_shared_weights(
    params: dict[str, torch.nn.Parameter], shared: dict[str, torch.Tensor], drafter: str
) -> None:
    """`DrafterSpec.attach_shared` for a drafter whose parameters `params` (role ->
    parameter, roles `"input_embeddings"` / `"output_embeddings"`) are copies of the target's:
    each copied from `shared`, a one-line `CheckpointError` when one is missing or misfits."""
    for role, param in params.items():
        t = shared.get(role)
        if t is None or tuple(t.shape) != tuple(param.shape):
            got = None if t is None else tuple(t.shape)
            raise CheckpointError(
                f"target {role.replace('_', ' ')} {got} do not fit the {drafter} "
                f"{tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(t)


DRAFTERS = NamedRegistry("draftinfer.kinds", CheckpointError, "drafter_kind")


def register_drafter(spec: DrafterSpec) -> DrafterSpec:
    """Register a kind (called from the kind's own `__init__.py`, or by a test)."""
    if spec.config_class.kind != spec.name:
        raise ValueError(
            f"{type(spec).__name__}: config kind {spec.config_class.kind!r} != {spec.name!r}"
        )
    return DRAFTERS.register(spec)


def unregister_drafter(name: str) -> None:
    DRAFTERS.unregister(name)


def load_kinds() -> dict[str, DrafterSpec]:
    """Import every package under `draftinfer/kinds/` once; each registers itself."""
    return DRAFTERS.load()


def drafter_spec(kind: str) -> DrafterSpec:
    """The spec registered under `kind`; a one-line `CheckpointError` for an unknown kind."""
    return DRAFTERS.spec(kind)


def spec_of(drafter: torch.nn.Module) -> DrafterSpec:
    """The spec of a drafter module (by its config's kind)."""
    return drafter_spec(drafter.config.kind)


def registered_kinds() -> list[str]:
    return sorted(load_kinds())
