"""Helpers of the block-drafter tests (`tests/kinds/test_dflash_*.py`): drafters of each option, one
round of drafting read through the proposer, and the engines' documented rules for reading a
DFlash checkpoint's taps (REFERENCES A3), written here independently of
`draftinfer.kinds.dflash` (the K1 oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from draftinfer.decoding.proposer import FirstPass
from draftinfer.models.target import TargetOutput
from draftinfer.registry import drafter_spec
from tests.support.kind_factories import small_drafter

# Train-config overrides of each option of the kind (K2 and the parity tests run them all).
VARIANTS = {
    "dflash": {},
    "dflash2": {"dflash2": True, "conv_group_size": 8, "selector_top_k": 6, "selector_rank": 5},
    "causal": {"causal_block": True},
    # DSpark: anchor slot drafts, Markov head (randomized below its zero init by the tests that
    # need a non-trivial bias: `randomize_heads`), confidence head.
    "dspark": {"dspark": True, "markov_rank": 5},
    # LiLiCorr: the lattice over each slot's top-6, a two-layer correlator of width 8 (its
    # successor map randomized past its zero init by `randomize_heads`), alone and with
    # DFlash2's conv.
    "lilicorr": {"lilicorr": True, "lilicorr_top_k": 6, "lilicorr_rank": 8, "lilicorr_heads": 2},
    "lilicorr_conv": {
        "lilicorr": True,
        "lilicorr_conv": True,
        "conv_group_size": 8,
        "lilicorr_top_k": 6,
        "lilicorr_rank": 8,
        "lilicorr_heads": 2,
    },
    "sliding": {
        "num_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 6,
    },
}


def variant_drafter(name: str, rope: str = "1d", seed: int = 0, **extra):
    """A randomized small drafter of option `name` (`VARIANTS`); a Markov head is randomized
    past its zero init, so its bias changes the drafts."""
    return randomize_heads(small_drafter("dflash", rope, seed, **{**VARIANTS[name], **extra}))


@torch.no_grad()
def randomize_heads(d, seed: int = 7):
    """`markov_w2` and LiLiCorr's `successor` (zero at init: each starts as plain DFlash)
    drawn at a scale that moves the drafts, so tests of the Markov bias or of the lattice's
    transitions are not tests of a zero."""
    g = torch.Generator().manual_seed(seed)
    if getattr(d, "markov_head", None) is not None:
        w = d.markov_head.markov_w2.weight
        w.copy_(torch.randn(w.shape, generator=g) * 20.0)
    if getattr(d, "lattice_correlator", None) is not None:
        w = d.lattice_correlator.successor.weight
        w.copy_(torch.randn(w.shape, generator=g) * 0.5)
    return d


def runner_logits(
    d, ids, feats, pos, anchor: int, k: int, choose_ids=None, proposer: list | None = None
) -> torch.Tensor:
    """The runner's draft logits `[k, V]` after committing rows 0..anchor (row i consumes
    `ids[i + 1]` with `feats[i]` at `pos[..., i]`), the chooser fed `choose_ids [k]` (default:
    the teacher-forced `ids[anchor + 2 + step]`); the proposer is appended to `proposer` (its
    `confidence` after the round)."""
    prop = drafter_spec("dflash").proposer_class(d, 2, 64, torch.device("cpu"), torch.float32)
    n = anchor + 1
    fp = FirstPass(
        torch.tensor([1]), ids[:, 1 : n + 1], feats[:, :n], torch.arange(n)[None], pos[..., :n]
    )
    seen = []

    def teacher(logits, step):
        seen.append(logits.clone())
        if choose_ids is not None:
            return choose_ids[step : step + 1], None
        return ids[:, anchor + 2 + step], None

    prop.propose(prop.admit(fp), torch.tensor([k]), k, teacher)
    if proposer is not None:
        proposer.append(prop)
    return torch.cat(seen)


# ---- the engines' reading rules (REFERENCES A3), independent of our loader ------------------
def read_export(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every tensor of an export, read with json and safetensors only."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return config, tensors


def vllm_capture_slots(config: dict) -> list[int]:
    """vLLM `get_eagle3_aux_layers_from_config`: `eagle_aux_hidden_state_layer_ids` as is,
    else `dflash_config.target_layer_ids` + 1, else top-level `target_layer_ids` + 1. Slot k is
    captured before layer k runs (`hidden + residual`, HF `hidden_states[k]`)."""
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        return list(config["eagle_aux_hidden_state_layer_ids"])
    dc = config.get("dflash_config") or {}
    if dc.get("target_layer_ids") is not None:
        return [t + 1 for t in dc["target_layer_ids"]]
    return [t + 1 for t in config["target_layer_ids"]]


def sglang_capture_slots(config: dict) -> list[int]:
    """SGLang `dflash_utils`: `dflash_config.target_layer_ids` (else top level), + 1 ("SGLang
    captures before layer i"), each checked `0 <= t < num_target_layers`."""
    dc = config.get("dflash_config") or {}
    ids = dc.get("target_layer_ids", config.get("target_layer_ids"))
    L = config["num_target_layers"]
    assert all(0 <= t < L for t in ids), ids
    return [t + 1 for t in ids]


def vllm_before_40727_slots(config: dict) -> list[int]:
    """vLLM before #40727: `target_layer_ids` used as capture slots (one layer early)."""
    return list((config.get("dflash_config") or {})["target_layer_ids"])


def batch_and_target(d, T=14, seed=0):
    """A random one-row training batch (loss on rows 5..T-1) and target output (logits,
    features of the drafter's tap width, positions) for drafter `d`."""
    g = torch.Generator().manual_seed(seed)
    V = d.config.vocab_size
    ids = torch.randint(0, V, (1, T), generator=g)
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, 5:] = 1
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(1, T, dtype=torch.long),
        "loss_mask": loss_mask,
    }
    F_ = d.config.features.width(d.config.hidden_size)
    logits = 3 * torch.randn(1, T, V, generator=g)
    tgt = TargetOutput(logits, torch.randn(1, T, F_, generator=g), torch.arange(T)[None], None)
    return batch, tgt
