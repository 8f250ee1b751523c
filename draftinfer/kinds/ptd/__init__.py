"""Parallel drafting (`ptd`): the EAGLE-3 kind plus `mask_hidden`, one forward per round,
registered as the drafter kind `ptd`."""

from __future__ import annotations

from draftinfer.errors import CheckpointError
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
    mode_tensors = frozenset({"mask_hidden"})

    def check_k(self, arch, k: int) -> None:
        if k > arch.parallel_k:
            raise CheckpointError(
                f"k={k} exceeds the K={arch.parallel_k} this parallel drafter was trained for"
            )

    def serving_hint(self, arch, k: int) -> str:
        return (
            'vLLM: `--speculative-config \'{"method": "eagle3", "model": "<this dir>", '
            f'"num_speculative_tokens": {arch.parallel_k}, "parallel_drafting": true}}\'` '
            f"(mask token {arch.mask_token_id}). SGLang serves EAGLE-3 chain drafting only.\n\n"
            f"Aux taps (inputs of target layers): {list(arch.aux_layer_ids)}; draft vocabulary "
            f"{arch.draft_vocab_size} of {arch.vocab_size}; trained for K={arch.parallel_k}."
        )


register_drafter(PTDSpec())

__all__ = ["PTDConfig", "PTDDrafter", "PTDSpec", "ParallelProposer"]
