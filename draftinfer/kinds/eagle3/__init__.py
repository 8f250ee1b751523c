"""EAGLE-3 (chain drafting): config, module, proposer and the serving adapters, registered
as the drafter kind `eagle3`."""

from __future__ import annotations

import torch

from draftinfer.conventions.vocab import check_maps
from draftinfer.files.errors import CheckpointError
from draftinfer.kinds.eagle3.config import Eagle3Config
from draftinfer.kinds.eagle3.module import Eagle3Drafter
from draftinfer.kinds.eagle3.proposer import Eagle3ChainProposer
from draftinfer.kinds.eagle3.speculators import speculators_config, speculators_tensors
from draftinfer.registry import DrafterSpec, register_drafter


class Eagle3Spec(DrafterSpec):
    name = "eagle3"
    config_class = Eagle3Config
    module_class = Eagle3Drafter
    proposer_class = Eagle3ChainProposer
    mode = "chain drafting"
    needs = frozenset({"layer_inputs"})
    handles = frozenset({"multimodal_window", "mrope_positions"})

    def conventions(self, arch) -> dict[str, str]:
        # Convention 2: tap j = the hidden state entering decoder layer j.
        return {**super().conventions(arch), "aux_tap": "layer_input"}

    def attach_shared(self, module, shared: dict[str, torch.Tensor]) -> None:
        emb = shared.get("input_embeddings")
        want = tuple(module.embed_tokens.weight.shape)
        if emb is None or tuple(emb.shape) != want:
            got = None if emb is None else tuple(emb.shape)
            raise CheckpointError(
                f"target embedding {got} does not fit the drafter (vocab {want[0]}, hidden "
                f"{want[1]})"
            )
        with torch.no_grad():
            module.embed_tokens.weight.copy_(emb)

    def validate_state_dict(self, arch, tensors, module, where: str) -> None:
        super().validate_state_dict(arch, tensors, module, where)
        problem = check_maps(tensors["d2t"], tensors["t2d"], arch.vocab_size)
        if problem:
            raise CheckpointError(f"{where}: {problem}")

    def serving_state_dict(self, module) -> dict[str, torch.Tensor]:
        """Tensor names engines load: a single layer is `midlayer.*` (the EAGLE-3 release
        layout SGLang and vLLM both read); stacks use `layers.N.*` (vLLM)."""
        sd = module.trainable_state_dict()
        if module.config.num_hidden_layers == 1:
            sd = {
                ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
                for k, v in sd.items()
            }
        return sd

    def from_serving_names(self, arch, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v
            for k, v in tensors.items()
        }

    def speculators_layout(
        self, module, verifier, verifier_architectures, k, input_embeddings, output_embeddings=None
    ):
        """vllm-project/speculators' `Eagle3Speculator` layout (`speculators.py` says what its
        loader reads)."""
        arch = module.config
        return (
            speculators_config(arch, verifier, verifier_architectures, k),
            speculators_tensors(module, input_embeddings()),
        )

    def serving_hint(self, arch, k: int, target: str, drafter: str) -> str:
        spec_cfg = f'{{"method": "eagle3", "model": "{drafter}", "num_speculative_tokens": {k}}}'
        return (
            "vLLM:\n\n```bash\n"
            f"vllm serve {target} --speculative-config '{spec_cfg}'\n```\n\n"
            "SGLang:\n\n```bash\n"
            f"python -m sglang.launch_server --model-path {target} "
            f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {drafter} "
            f"--speculative-num-steps {k} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {k + 1}\n```\n\n"
            f"Aux taps (inputs of target layers): {list(arch.aux_layer_ids)}; draft vocabulary "
            f"{arch.draft_vocab_size} of {arch.vocab_size}."
        )


register_drafter(Eagle3Spec())

__all__ = ["Eagle3ChainProposer", "Eagle3Config", "Eagle3Drafter", "Eagle3Spec"]
