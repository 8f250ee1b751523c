"""Block drafters (`dflash`: DFlash, with DFlash2's conv and candidate selector, JetSpec's
causal block, DSpark's anchor-slot layout, Markov head and confidence head, and LiLiCorr's
candidate lattice as options): config, module, proposer and the serving adapters, registered as
the drafter kind `dflash`."""

from __future__ import annotations

import torch

from draftinfer.files.errors import CheckpointError
from draftinfer.kinds.dflash.config import DFlashConfig
from draftinfer.kinds.dflash.module import DFlashDrafter
from draftinfer.kinds.dflash.proposer import DFlashProposer
from draftinfer.kinds.dflash.speculators import speculators_config, speculators_tensors
from draftinfer.registry import DrafterSpec, copy_shared_weights, register_drafter


class DFlashSpec(DrafterSpec):
    name = "dflash"
    config_class = DFlashConfig
    module_class = DFlashDrafter
    proposer_class = DFlashProposer
    mode = "block drafting"
    # The context's own norm (top level; EAGLE-3's `hidden_norm` lives inside layer 0).
    mode_tensors = frozenset({"hidden_norm.weight"})
    parallel_drafting = True  # one forward drafts the whole block
    needs = frozenset({"layer_inputs"})
    # M-RoPE: context rows at the target's `[3, N]` positions, block slot s at the anchor's
    # + s on every axis (`draftinfer.conventions.positions.block_positions`, training and runner alike).
    # Multimodal windows: a context row is the target's features of its token only (an image
    # row's taps, DeepStack included, as the layers receive them), and a block embeds the
    # anchor (a committed, so text, token) and mask tokens: no row consumes a placeholder.
    handles = frozenset({"multimodal_window", "mrope_positions"})

    def conventions(self, arch) -> dict[str, str]:
        # Convention 2 (our taps are layer inputs; the checkpoint's `target_layer_ids` are
        # those minus 1) and 13 (block slot s of the anchor at p_anchor + s).
        return {
            **super().conventions(arch),
            "aux_tap": "layer_input",
            "block_convention": "anchor_then_mask",
        }

    def hf_config(self, arch) -> dict:
        # The z-lab layout is what vLLM's `dspark` loads: the vanilla Markov head only.
        if arch.markov_rank and arch.markov_head_type != "vanilla":
            raise CheckpointError(
                f"markov_head_type {arch.markov_head_type!r} has no z-lab / vLLM `dspark` layout "
                "(vLLM serves the vanilla Markov head only; speculators' `dspark` layout holds it)"
            )
        return super().hf_config(arch)

    def attach_shared(self, module, shared: dict[str, torch.Tensor]) -> None:
        roles = {"input_embeddings": module.embed_tokens.weight}
        copy_shared_weights(
            {**roles, "output_embeddings": module.lm_head.weight}, shared, "block drafter"
        )

    def check_fit(self, arch, info) -> None:
        if info.num_layers != arch.num_target_layers:
            raise CheckpointError(
                f"block drafter made for a target of {arch.num_target_layers} layers "
                f"(num_target_layers); this target has {info.num_layers}"
            )
        super().check_fit(arch, info)

    def check_k(self, arch, k: int) -> None:
        if k > arch.max_drafts:
            raise CheckpointError(
                f"k={k} exceeds the {arch.max_drafts} drafts of this drafter's block "
                f"(block_size {arch.block_size}, sample_from_anchor {arch.sample_from_anchor})"
            )

    def speculators_layout(
        self, module, verifier, verifier_architectures, k, input_embeddings, output_embeddings=None
    ):
        config = speculators_config(module.config, verifier, verifier_architectures, k)
        if config is None or output_embeddings is None:
            return None
        return config, speculators_tensors(module, input_embeddings(), output_embeddings())

    def serving_hint(self, arch, k: int, target: str, drafter: str) -> str:
        B = arch.block_size
        method = "dspark" if arch.dspark else "dflash"
        spec_cfg = f'{{"method": "{method}", "model": "{drafter}", "num_speculative_tokens": {k}}}'
        notes = [
            f"Block size {B} (K = {arch.max_drafts} drafts per round at most), mask token "
            f"{arch.mask_token_id}; `dflash_config.target_layer_ids` {arch.target_layer_ids} "
            f"name the *outputs* of those target layers (HF `hidden_states[t + 1]`), and "
            f"`eagle_aux_hidden_state_layer_ids` {list(arch.tap_layer_ids)} the same layers as "
            "vLLM capture slots (vLLM older than #40727 misreads the first: check your version)."
        ]
        if arch.lilicorr:
            conv = " with DFlash2's conv" if arch.conv_kernel_size else ""
            notes.append(
                f"LiLiCorr{conv} (`LiLiCorrDraftModel`, `dflash_config.projector_type: "
                f"lilicorr`, lattice over each slot's top-{arch.lilicorr_top_k}, a "
                f"{arch.lilicorr_layers}-layer correlator of width {arch.lilicorr_rank}): **no "
                "merged engine serves this checkpoint.** ModelOpt (NVIDIA/Model-Optimizer#2342) "
                "trains LiLiCorr; serving is open in SGLang (#37462), vLLM (#57934) and "
                "vllm-ascend (#17147), and the correlator's tensors here "
                "(`lattice_correlator.*`) are this project's names, not those PRs'; an engine "
                "that loads `DFlashDraftModel` / `DFlash2DraftModel` refuses this architecture. "
                "Our runner serves it, lossless (verification is unchanged)."
            )
        elif arch.dflash2:
            notes.append(
                "DFlash2 (`DFlash2DraftModel`): vLLM needs an unquantized target `lm_head` (the "
                "selector takes a top-k over the full vocabulary)."
            )
        if arch.dspark:
            notes.append(
                f"DSpark options: sample_from_anchor {arch.sample_from_anchor}, Markov head "
                f"{arch.markov_head_type} rank {arch.markov_rank}, confidence head "
                f"{arch.confidence_head}. vLLM serves it as `method: dspark`; this export "
                "writes the z-lab layout plus those fields, and speculators' `dspark` layout "
                "in `speculators/` (vLLM serves `vanilla` heads only)."
            )
        if arch.causal_block:
            notes.append("Causal block (JetSpec, `dflash_config.causal: true`): vLLM only.")
        if arch.rope_scaling and "mrope_section" in arch.rope_scaling:
            notes.append(
                "M-RoPE drafter (a Qwen3-VL target): context rows at the target's `[3, N]` "
                "positions, block slot s at the anchor's position + s on all three axes. vLLM "
                "refuses it as written (no parallel drafting with M-RoPE); see the notes below "
                "for what it does without `mrope_section` and how to measure that."
            )
        if "sliding_attention" in arch.layer_types and "full_attention" in arch.layer_types:
            notes.append(
                "Sliding and full layers mixed: vLLM needs its model runner V2 "
                "(`VLLM_USE_V2_MODEL_RUNNER=1`). No `speculators/` folder is written for window "
                "layers: speculators windows them otherwise, and vLLM's reading of that layout "
                "(#47745) would make the full layers causal."
            )
        if arch.lilicorr:  # no engine command to give: say so first
            return (
                "No merged serving engine loads LiLiCorr yet. This project's runner:\n\n"
                f"```bash\npython -m draftinfer drafter={drafter} k={k}\n```\n\n"
                + "\n\n".join(notes)
            )
        return (
            "vLLM:\n\n```bash\n"
            f"vllm serve {target} --speculative-config '{spec_cfg}'\n```\n\n"
            "SGLang:\n\n```bash\n"
            f"python -m sglang.launch_server --model-path {target} "
            f"--speculative-algorithm DFLASH --speculative-draft-model-path {drafter} "
            f"--speculative-num-draft-tokens {B}\n```\n\n" + "\n\n".join(notes)
        )


register_drafter(DFlashSpec())

__all__ = ["DFlashConfig", "DFlashDrafter", "DFlashProposer", "DFlashSpec"]
