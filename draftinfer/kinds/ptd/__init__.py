"""Parallel drafting (`ptd`): the EAGLE-3 kind plus `mask_hidden`, one forward per round,
registered as the drafter kind `ptd`."""

from __future__ import annotations

from draftinfer.files.errors import CheckpointError
from draftinfer.kinds.eagle3 import Eagle3Spec
from draftinfer.kinds.ptd.config import PTDConfig
from draftinfer.kinds.ptd.module import PTDDrafter
from draftinfer.kinds.ptd.proposer import ParallelProposer
from draftinfer.registry import register_drafter


class PTDSpec(Eagle3Spec):
    name = "ptd"
    config_class = PTDConfig
    module_class = PTDDrafter
    proposer_class = ParallelProposer
    mode = "parallel drafting"
    parallel_drafting = True
    mode_tensors = frozenset({"mask_hidden"})

    def check_k(self, arch, k: int) -> None:
        if k > arch.parallel_k:
            raise CheckpointError(
                f"k={k} exceeds the K={arch.parallel_k} this parallel drafter was trained for"
            )

    def speculators_layout(
        self, module, verifier, verifier_architectures, k, input_embeddings, output_embeddings=None
    ):
        """speculators' P-EAGLE (`PEagleSpeculator`) layout: the EAGLE-3 one plus `mask_hidden`
        (a module tensor) and `mask_token_id` at the top level of its config."""
        config, tensors = super().speculators_layout(
            module, verifier, verifier_architectures, k, input_embeddings
        )
        return {**config, "mask_token_id": module.config.mask_token_id}, tensors

    def serving_hint(self, arch, k: int, target: str, drafter: str) -> str:
        K = arch.parallel_k
        spec_cfg = (
            f'{{"method": "eagle3", "model": "{drafter}", "num_speculative_tokens": {K}, '
            '"parallel_drafting": true}'
        )
        return (
            "vLLM:\n\n```bash\n"
            f"vllm serve {target} --speculative-config '{spec_cfg}'\n```\n\n"
            f"Mask token {arch.mask_token_id}. SGLang serves EAGLE-3 chain drafting only.\n\n"
            f"Aux taps (inputs of target layers): {list(arch.aux_layer_ids)}; draft vocabulary "
            f"{arch.draft_vocab_size} of {arch.vocab_size}; trained for K={K}."
        )


register_drafter(PTDSpec())

__all__ = ["PTDConfig", "PTDDrafter", "PTDSpec", "ParallelProposer"]
