"""The speculators side of `tests/jobs/test_third_party_loaders.py`: a script run by the python
of the speculators virtualenv (`tests.support.speculators_env`), never imported by the tests.

    .ci-venvs/speculators/bin/python tests/support/speculators_side.py KIND FOLDER INPUTS OUT

It loads the folder *as it is* with vllm-project/speculators 0.9.0's own
`from_pretrained(FOLDER)` from a working directory that has nothing to do with it (the export's
recorded verifier, a hub id or the target's absolute path, resolves from anywhere), in fp32, runs its
forward on the inputs our side wrote (`INPUTS`, safetensors) and writes what it computed to
`OUT` (safetensors): the `lm_head` outputs (`logits`; DSpark: the Markov-biased logits and the
confidence logits), every tensor of its state dict
(`state.<name>`) and, for P-EAGLE and DFlash, the anchors (and depths) of its slots. Metadata (versions,
the verifier it resolved, keys it loaded from nowhere) goes into the file's metadata.
Only torch, safetensors and speculators are imported: this runs beside transformers 5.19.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _load(kind: str, folder: str):
    if kind == "eagle3":
        from speculators.models.eagle3 import Eagle3DraftModel as cls
    elif kind == "peagle":
        from speculators.models.peagle import PEagleDraftModel as cls
    elif kind == "dflash":
        from speculators.models.dflash import DFlashDraftModel as cls
    elif kind == "dspark":
        from speculators.models.dspark import DSparkDraftModel as cls
    else:
        raise SystemExit(f"unknown speculators kind {kind!r}")
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    if kind in ("dflash", "dspark"):
        # speculators builds the block mask with `torch.compile(create_block_mask)`; on a CPU
        # (torch 2.13) inductor's C++ for its anchor-block mask_mod fails to compile
        # ("operands to ?: have different types VecMask<int> and VecMask<float>"), so the same
        # `create_block_mask` of the same mask_mod runs uncompiled: the same mask.
        from torch.nn.attention.flex_attention import create_block_mask

        model._create_mask_fn = create_block_mask
    return model


def _capture_lm_head(model) -> list[torch.Tensor]:
    """speculators' forward returns draft tokens and losses; its logits are `lm_head`'s output."""
    seen: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    return seen


def _forward_eagle3(model, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen = _capture_lm_head(model)
    T = x["input_ids"].shape[1]
    with torch.no_grad():
        model(
            hidden_states=x["hidden_states"],
            input_ids=x["input_ids"],
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=x["position_ids"],
            ttt_steps=1,
        )
    return {"logits": seen[0]}


def _forward_peagle(model, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from speculators.losses.eager import kl_div_loss
    from speculators.models.peagle.data import generate_cod_sample_indices

    # P-EAGLE samples (anchor, depth) slots at random (COD sampling); with both keep ratios at 1
    # and a fixed seed the slots are known in advance by drawing them the same way first.
    K = int(x["num_depths"])
    T = x["input_ids"].shape[1]
    cod = {"num_depths": K, "down_sample_ratio": 1.0, "down_sample_ratio_min": 1.0}
    loss_mask = torch.ones(1, T)
    torch.manual_seed(5)
    anchor, depth = generate_cod_sample_indices(T, loss_mask, **cod)
    seen = _capture_lm_head(model)
    torch.manual_seed(5)
    with torch.no_grad():
        model(
            # its own eager loss: the default one is a Triton kernel, which failed on the CPU
            # ("0 active drivers") in a full run
            loss_config={"kl_div": (kl_div_loss, 1.0)},
            hidden_states=x["hidden_states"],
            input_ids=x["input_ids"],
            document_ids=torch.zeros(1, T, dtype=torch.long),
            loss_mask=loss_mask,
            verifier_last_hidden_states=torch.zeros(1, T, int(x["verifier_hidden_size"])),
            **cod,
        )
    return {
        "logits": seen[0],
        "anchor": torch.as_tensor(anchor).long(),
        "depth": torch.as_tensor(depth).long(),
    }


def _forward_dflash(model, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # speculators draws anchors at random among the loss-mask tokens but the last block; with
    # every token in the mask and `max_anchors` equal to that count, every one of them is an
    # anchor (sorted), so the blocks are known in advance.
    from speculators.losses.eager import kl_div_loss

    seen = _capture_lm_head(model)
    # its own eager loss: the default one is a Triton kernel, which needs a GPU
    n = _block_forward(model, x, loss_config={"kl_div": (kl_div_loss, 1.0)})
    return {"logits": seen[0], "anchor": torch.arange(n)}


def _block_forward(model, x: dict[str, torch.Tensor], **extra) -> int:
    """One training forward of a block drafter (DFlash, DSpark) over every anchor but the last
    block's, with a full loss mask and one document; -> the number of anchors."""
    T = x["input_ids"].shape[1]
    n = T - model.block_size
    with torch.no_grad():
        model(
            **extra,
            hidden_states=x["hidden_states"],
            input_ids=x["input_ids"],
            loss_mask=torch.ones(1, T),
            verifier_last_hidden_states=torch.zeros(1, T, int(x["verifier_hidden_size"])),
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=x["position_ids"],
            max_anchors=n,
        )
    return n


def _forward_dspark(model, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DSpark: DFlash's blocks (every anchor but the last block's, as `_forward_dflash`), then its
    Markov bias (from the ground-truth token before each slot) and confidence head; the final
    logits and confidence logits are what it hands its `compute_metrics`, captured there."""
    import speculators.models.dspark.core as core

    seen: dict[str, torch.Tensor] = {}

    def capture(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"] = logits.detach().clone()
        if confidence_logits is not None:
            seen["confidence_logits"] = confidence_logits.detach().clone()
        return torch.zeros(()), {}

    core.compute_metrics = capture
    n = _block_forward(model, x)
    return {**seen, "anchor": torch.arange(n)}


FORWARDS = {
    "eagle3": _forward_eagle3,
    "peagle": _forward_peagle,
    "dflash": _forward_dflash,
    "dspark": _forward_dspark,
}


def main(kind: str, folder: str, inputs: str, out: str) -> None:
    import importlib.metadata

    import transformers

    x = load_file(inputs)
    model = _load(kind, folder)
    result = {}
    if x:  # no inputs: load only
        result = FORWARDS[kind](model, x)
    state = {f"state.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    on_disk = set(load_file(str(Path(folder) / "model.safetensors")))
    cfg = model.config
    meta = {
        "speculators": importlib.metadata.version("speculators"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "verifier": cfg.speculators_config.verifier.name_or_path,
        "mask_token_id": getattr(model, "mask_token_id", None),
        # Model tensors the folder does not hold (filled from the verifier or left at init).
        "not_in_folder": sorted(set(model.state_dict()) - on_disk),
        # Folder tensors the model has no place for (dropped silently by from_pretrained).
        "unused_in_folder": sorted(on_disk - set(model.state_dict())),
    }
    tensors = {**{k: v.contiguous() for k, v in result.items()}, **state}
    save_file(tensors, out, metadata={"info": json.dumps(meta)})
    print(json.dumps(meta))


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    main(sys.argv[1], *(str(Path(a).resolve()) for a in sys.argv[2:]))
