"""Multi-layer MTP (`mtp`): N distinct modules, registered as the drafter kind `mtp`.

Tensor layouts (DESIGN section 4; `layouts.py`, selected by the config's `layout`):
`deepseek`, module k of a target with L decoder layers at `model.layers.{L+k}.*` (checked
against vLLM's `deepseek_mtp.py` loader and transformers' `MtpModel` conversion mapping), or
`mrv2`, Inkling's `model.mtp.layers.{k}.*` with a shared `model.mtp.chain_norm` (vLLM Model
Runner V2's multi-module contract; checked by an independent loader in the tests).

The same files are the standalone draft directory engines load as `speculative_config.model`
(the target family's `config.json` with `num_nextn_predict_layers = N`) and what
`python -m drafttrain.stitch` writes into a copy of the target.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from draftinfer.files.errors import CheckpointError, ConfigError
from draftinfer.kinds.mtp.config import _NOT_ARCH, MTPConfig
from draftinfer.kinds.mtp.layouts import OWN_NAME, layout_of
from draftinfer.kinds.mtp.module import MTPDrafter
from draftinfer.kinds.mtp.proposer import MTPProposer
from draftinfer.registry import DrafterSpec, copy_shared_weights, register_drafter

log = logging.getLogger(__name__)


class MTPSpec(DrafterSpec):
    name = "mtp"
    config_class = MTPConfig
    module_class = MTPDrafter
    proposer_class = MTPProposer
    mode = "multi-token prediction"
    # Each module is a decoder block of the target's layer shape (initialised from its last
    # layer by default) that the runner builds for the family (`drafter_block`): the dense
    # Llama block, or the family's own native layer (`MTPConfig.own_layer`).
    needs = frozenset({"final_hidden", "drafter_block"})
    handles = frozenset({"multimodal_window", "mrope_positions"})

    def needs_for(self, arch) -> frozenset[str]:
        """`block: hf` builds each module's block from the target's own transformers decoder
        layer class (MLA, routed experts and all), so it needs no block of the runner's; so
        does a training config (no `block`: training takes `hf` where the runner builds no
        block for the family, `drafttrain.kinds.mtp`). None (any drafter of the kind): `needs`."""
        if arch is not None and getattr(arch, "block", "hf") == "hf":
            return self.needs - {"drafter_block"}
        return self.needs

    def released_arch(self, config, family):
        """The MTP layers a checkpoint of `family` ships (`FamilySpec.released_mtp`: how many
        its config.json counts, what they consume and carry), as this kind's architecture with
        the runner's native block (the family's own layer): what `drafter=native` serves."""
        own = family.released_mtp
        if own is None:
            return None
        n = int(config.get(own["count_key"]) or 0)
        if n < 1:
            return None
        fields = {k: v for k, v in own.items() if k != "count_key"}
        target = {k: v for k, v in config.items() if k not in _NOT_ARCH and k != own["count_key"]}
        try:
            return MTPConfig(n_predict=n, target_config=target, block="native", **fields)
        except ConfigError as e:
            raise CheckpointError(f"the target's own MTP layers: {e}") from None

    def conventions(self, arch) -> dict[str, Any]:
        # Our MTP fields (n_predict, mtp_chain, mtp_carry, mtp_feature_tap, ...) travel under
        # `"drafttrain"`: `MTPConfig.from_hf` reads them back from there.
        return {**super().conventions(arch), **arch.ours()}

    # -- serving layout (`layouts.py`: one adapter per `layout`) ------------------------------
    def serving_state_dict(self, module) -> dict[str, torch.Tensor]:
        return layout_of(module.config).to_serving(module)

    def wants_tensor(self, arch, name: str) -> bool:
        return layout_of(arch).wants(arch, name)

    def from_serving_names(self, arch, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return layout_of(arch).from_serving(arch, tensors)

    def attach_shared(self, module, shared: dict[str, torch.Tensor]) -> None:
        roles = {"input_embeddings": module.embed_tokens.weight}
        copy_shared_weights(
            {**roles, "output_embeddings": module.lm_head.weight}, shared, "MTP drafter"
        )

    def stitch(self, export_dir, arch, target_dir, out_dir, replace: bool = False):
        from draftinfer.kinds.mtp.stitch import stitch

        return stitch(self, export_dir, arch, target_dir, out_dir, replace)

    # -- checks ------------------------------------------------------------------------------
    def check_fit(self, arch, info) -> None:
        problems = []
        if info.architecture and info.architecture != arch.architecture:
            problems.append(
                f"architecture {info.architecture} (the checkpoint's is {arch.architecture})"
            )
        if info.hidden_size != arch.hidden_size:
            problems.append(f"hidden size {info.hidden_size} (checkpoint {arch.hidden_size})")
        if info.num_layers != arch.target_num_layers:
            problems.append(f"{info.num_layers} layers (checkpoint {arch.target_num_layers})")
        if info.vocab_size != arch.vocab_size:
            problems.append(f"vocabulary {info.vocab_size} (checkpoint {arch.vocab_size})")
        if problems:
            raise CheckpointError(
                "MTP checkpoint does not match the target: target has " + "; ".join(problems)
            )
        super().check_fit(arch, info)

    def check_k(self, arch, k: int) -> None:
        N = arch.n_predict
        if k % N:
            raise CheckpointError(
                f"k={k} is not a multiple of the {N} MTP modules (engines pick module step % N)"
            )
        if k > N and arch.layout == "mrv2":
            raise CheckpointError(
                f"k={k} > {N} modules: the mrv2 layout (vLLM MRv2's multi-module MTP) drafts "
                f"token m with module m, at most {N} per round"
            )
        if k > N:
            log.warning("k=%d > %d MTP modules: modules are reused (step %% %d)", k, N, N)

    def validate_state_dict(self, arch, tensors, module, where: str) -> None:
        found = sorted({int(m.group(1)) for n in tensors if (m := OWN_NAME.match(n))})
        if found != list(range(arch.n_predict)):
            prefix = layout_of(arch).module_prefix
            missing = [prefix(arch, k) for k in range(arch.n_predict) if k not in found]
            raise CheckpointError(
                f"{where}: n_predict is {arch.n_predict} but the weights hold {len(found)} MTP "
                f"module(s)" + (f" (missing {', '.join(missing)})" if missing else "")
            )
        super().validate_state_dict(arch, tensors, module, where)

    def serving_hint(self, arch, k: int, target: str, drafter: str) -> str:
        N = arch.n_predict
        first, last = (layout_of(arch).module_prefix(arch, j) for j in (0, N - 1))
        spec_cfg = f'{{"method": "mtp", "model": "{drafter}", "num_speculative_tokens": {N}}}'
        if arch.layout == "mrv2":
            engines = (
                "Layout `mrv2` (Inkling's: `model.mtp.layers.{i}.{hidden_norm, embed_norm, "
                "input_proj, transformer_block.*}`, hidden-first concat, one shared "
                "`model.mtp.chain_norm`; `mtp_config` in config.json). It is the layout vLLM "
                "Model Runner V2's `MultiModuleMTPSpeculator` serves (chosen when `method` is "
                "`mtp` and `min(num_nextn_predict_layers, num_speculative_tokens) > 1`; step m "
                "runs module m over the window shifted left by m+1 at the window's own "
                "positions, exactly what these modules were trained on). Its one in-tree user "
                "is Inkling (`inkling_mtp`). `num_speculative_tokens` at most N."
            )
        else:
            engines = (
                "Layout `deepseek` (`model.layers.{L+k}.*` as vLLM's `deepseek_mtp.py` and "
                "transformers' `MtpModel` load them): vLLM serves it for the families it runs "
                "MTP for (DeepSeek-V3, GLM-4.5, MiMo, Qwen3-Next, Step-3.5, ...); "
                "`num_speculative_tokens` must be a multiple of N (engines pick module "
                "`step % N`); vLLM serves only the first MiMo-V2 MTP layer. SGLang chains "
                "modules only for Step-3.5; its DeepSeek NextN loader reads one module "
                "renumbered `model.layers.0` in a one-layer config, a variant this export does "
                "not write. transformers' `MtpModel` and vLLM with no draft model load the "
                f"modules from the target: `python -m drafttrain.stitch {drafter} {target} <out>`."
            )
        registration = (
            f"For a {arch.architecture} target vLLM has no MTP architecture: it registers MTP "
            "only as a target's *own* architecture (`SpeculativeConfig.hf_config_override` "
            "maps the target's `model_type` to `*_mtp`), and there is none for Llama or Qwen3. "
            "Serving these modules in vLLM needs an out-of-tree registration (a plugin): a "
            "model class registered with `ModelRegistry.register_model`, that builds N modules "
            "of this layout around the target family's decoder layer, takes the target's "
            "embedding and lm_head, picks module `spec_step_idx % N` and loads the names above; "
            "plus an `hf_config_override` entry mapping the target's `model_type` to it with "
            "`n_predict = num_nextn_predict_layers`. Then: "
            f"`vllm serve {target} --speculative-config '{spec_cfg}'`."
        )
        runner = (
            f"This target ({arch.architecture}) is served by `draftinfer` as is."
            if arch.block == "native"
            else f"`draftinfer` does not run these modules (block: hf, {arch.architecture}'s "
            "own transformers layers)."
        )
        return (
            f"{engines}\n\n{registration}\n\n{runner}\n\n"
            f"layout {arch.layout}, mtp_chain {arch.mtp_chain}, mtp_carry {arch.mtp_carry}, "
            f"mtp_feature_tap {arch.mtp_feature_tap}; modules at `{first}.*` to `{last}.*`."
        )


register_drafter(MTPSpec())

__all__ = ["MTPConfig", "MTPDrafter", "MTPProposer", "MTPSpec"]
