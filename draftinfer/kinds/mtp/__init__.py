"""Multi-layer MTP (`mtp`): N distinct modules, registered as the drafter kind `mtp`.

Tensor layout (DESIGN section 4; checked against vLLM's `deepseek_mtp.py` loader and
transformers' `MtpModel` conversion mapping): module k of a target with L decoder layers is
`model.layers.{L+k}.*`:

- `enorm`, `hnorm`, `eh_proj` (`[H, 2H]`, embedding first), `shared_head.norm` (the module's
  final norm) and the block's own keys (`self_attn.*`, `mlp.*`, `input_layernorm`,
  `post_attention_layernorm`) directly under the prefix (vLLM inserts `mtp_block.`);
- `shared_head.head` (a copy of the target's `lm_head`, which vLLM's DeepSeek MTP loads per
  module) and, for the first module, `embed_tokens` (vLLM lifts it to the shared embedding).
  draftinfer ignores both copies and uses the target's own weights.

The same files are the standalone draft directory engines load as `speculative_config.model`
(the target family's `config.json` with `num_nextn_predict_layers = N`) and what
`python -m drafttrain.stitch` writes into a copy of the target.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from draftinfer.errors import CheckpointError
from draftinfer.kinds.mtp.config import MTPConfig
from draftinfer.kinds.mtp.module import MTPDrafter
from draftinfer.kinds.mtp.proposer import MTPProposer
from draftinfer.registry import DrafterSpec, copy_shared_weights, register_drafter

log = logging.getLogger(__name__)
_OWN = re.compile(r"^layers\.(\d+)\.(enorm|hnorm|eh_proj|norm|block)\.(.*)$")


class MTPSpec(DrafterSpec):
    name = "mtp"
    config_class = MTPConfig
    module_class = MTPDrafter
    proposer_class = MTPProposer
    mode = "multi-token prediction"
    needs = frozenset({"final_hidden"})
    handles = frozenset({"multimodal_window", "mrope_positions"})

    def conventions(self, arch) -> dict[str, Any]:
        # Our MTP fields (n_predict, mtp_chain, mtp_carry, mtp_feature_tap, ...) travel under
        # `"drafttrain"`: `MTPConfig.from_hf` reads them back from there.
        return {**super().conventions(arch), **arch.ours()}

    # -- serving layout ----------------------------------------------------------------------
    def serving_state_dict(self, module) -> dict[str, torch.Tensor]:
        L = module.config.target_num_layers
        out = {}
        for name, t in module.trainable_state_dict().items():
            m = _OWN.match(name)
            k, part, rest = int(m.group(1)), m.group(2), m.group(3)
            prefix = f"model.layers.{L + k}."
            if part == "block":
                out[prefix + rest] = t
            elif part == "norm":
                out[prefix + "shared_head.norm." + rest] = t
            else:
                out[prefix + f"{part}.{rest}"] = t
        for k in range(module.config.n_predict):
            out[f"model.layers.{L + k}.shared_head.head.weight"] = module.lm_head.weight
        out[f"model.layers.{L}.embed_tokens.weight"] = module.embed_tokens.weight
        return out

    def wants_tensor(self, arch, name: str) -> bool:
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        return m is not None and int(m.group(1)) >= arch.target_num_layers

    def from_serving_names(self, arch, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        L = arch.target_num_layers
        out = {}
        pat = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
        for name, t in tensors.items():
            m = pat.match(name)
            if m is None or int(m.group(1)) < L:
                out[name] = t  # reported as unexpected by validate_state_dict
                continue
            k, rest = int(m.group(1)) - L, m.group(2)
            if rest.startswith(("shared_head.head.", "embed_tokens.")):
                continue  # engine copies of the target's head / embedding
            if rest.startswith("shared_head.norm."):
                out[f"layers.{k}.norm.{rest[len('shared_head.norm.') :]}"] = t
            elif rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
                out[f"layers.{k}.{rest}"] = t
            else:
                out[f"layers.{k}.block.{rest}"] = t
        return out

    def attach_shared(self, module, shared: dict[str, torch.Tensor]) -> None:
        roles = {"input_embeddings": module.embed_tokens.weight}
        copy_shared_weights(
            {**roles, "output_embeddings": module.lm_head.weight}, shared, "MTP drafter"
        )

    def stitch(self, export_dir, arch, target_dir, out_dir):
        from draftinfer.kinds.mtp.stitch import stitch

        return stitch(self, export_dir, arch, target_dir, out_dir)

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
        if k > N:
            log.warning("k=%d > %d MTP modules: modules are reused (step %% %d)", k, N, N)

    def validate_state_dict(self, arch, tensors, module, where: str) -> None:
        found = sorted({int(m.group(1)) for n in tensors if (m := _OWN.match(n))})
        if found != list(range(arch.n_predict)):
            L = arch.target_num_layers
            missing = [f"model.layers.{L + k}" for k in range(arch.n_predict) if k not in found]
            raise CheckpointError(
                f"{where}: n_predict is {arch.n_predict} but the weights hold {len(found)} MTP "
                f"module(s)" + (f" (missing {', '.join(missing)})" if missing else "")
            )
        super().validate_state_dict(arch, tensors, module, where)

    def serving_hint(self, arch, k: int, target: str, drafter: str) -> str:
        N, L = arch.n_predict, arch.target_num_layers
        spec_cfg = f'{{"method": "mtp", "model": "{drafter}", "num_speculative_tokens": {N}}}'
        return (
            "vLLM:\n\n```bash\n"
            f"vllm serve {target} --speculative-config '{spec_cfg}'\n```\n\n"
            "This works for the families vLLM runs MTP for (DeepSeek-V3, "
            "GLM-4.5, MiMo, Qwen3-Next, Step-3.5, ...; keys as `deepseek_mtp.py` loads them). "
            "`num_speculative_tokens` must be a multiple of N (engines pick module `step % N`); "
            "vLLM serves only the first MiMo-V2 MTP layer. SGLang chains modules only for "
            "Step-3.5; its DeepSeek NextN loader reads one module renumbered `model.layers.0` "
            "in a one-layer config, a variant this export does not write. transformers' "
            f"`MtpModel` and vLLM with no draft model load the modules from the target: "
            f"`python -m drafttrain.stitch {drafter} {target} <out>`. "
            + (
                f"This target ({arch.architecture}) is served by `draftinfer`."
                if arch.block == "native"
                else f"`draftinfer` does not run {arch.architecture} targets (block: hf)."
            )
            + f"\n\nmtp_chain {arch.mtp_chain}, mtp_carry {arch.mtp_carry}, mtp_feature_tap "
            f"{arch.mtp_feature_tap}; modules at `model.layers.{L}.*` to "
            f"`model.layers.{L + N - 1}.*`."
        )


register_drafter(MTPSpec())

__all__ = ["MTPConfig", "MTPDrafter", "MTPProposer", "MTPSpec"]
