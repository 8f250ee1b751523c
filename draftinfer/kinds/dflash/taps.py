"""Which target hidden states a block drafter reads, in our numbering and in DFlash's
(convention 13): the one mapping between the two.

- **Our tap `j`** (convention 2, every kind): the hidden state *entering* target decoder layer
  `j`, as that layer receives it (0 = the embeddings). For a text target it is HF's
  `output_hidden_states[j]`.
- **DFlash's `target_layer_ids` entry `t`** (z-lab `extract_context_feature`, SGLang, the
  `dflash_config` of every DFlash checkpoint): "the output of decoder layer `t`", read as
  `output_hidden_states[t + 1]`.
- **vLLM's capture slot** (`eagle_aux_hidden_state_layer_ids`, speculators'
  `aux_hidden_state_layer_ids`): the hidden state captured *before* layer `k` runs, i.e. the
  input of layer `k`: our numbering.

So `j = t + 1`. The last layer's output (`t = L - 1`) is not captured inside any engine's
layer loop (sglang #32204) and is never a tap; `t >= 0` (DFlash cannot name the embeddings).
vLLM read `target_layer_ids` as capture slots until #40727, feeding every drafter the layer
before the one it was trained on: `tests/kinds/test_dflash_taps.py` pins this mapping against HF
`output_hidden_states` and an independent reader of the exported files.
"""

from __future__ import annotations

from draftinfer.files.errors import ConfigError

# HF `output_hidden_states` index of DFlash's "output of layer t" is t + TAP_OFFSET, and so is
# our tap (the input of the next layer).
TAP_OFFSET = 1


def tap_of_dflash_id(t: int) -> int:
    """DFlash `target_layer_ids` entry (output of layer t) -> our tap (input of layer t + 1)."""
    return int(t) + TAP_OFFSET


def dflash_id_of_tap(j: int) -> int:
    """Our tap (input of layer j) -> DFlash `target_layer_ids` entry (output of layer j - 1)."""
    return int(j) - TAP_OFFSET


def check_dflash_ids(ids: list[int], num_target_layers: int, where: str = "target_layer_ids"):
    """One-line `ConfigError` unless `ids` are distinct DFlash ids in `0 .. L - 2`."""
    ids = [int(t) for t in ids]
    if not ids:
        raise ConfigError(f"{where} is empty: a block drafter reads at least one target layer")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{where} {ids} repeats a layer")
    bad = [t for t in ids if not 0 <= t <= num_target_layers - 2]
    if bad:
        raise ConfigError(
            f"{where} {ids}: {bad} outside 0..{num_target_layers - 2} (DFlash ids name the "
            f"output of layer t; the last layer, {num_target_layers - 1}, is never tapped)"
        )
    return ids


def default_dflash_ids(num_target_layers: int, n: int) -> list[int]:
    """z-lab's `build_target_layer_ids(L, n)` (also SpecForge's and SGLang's): `[L // 2]` for
    one tap, else `n` ids spread evenly from 1 to `L - 3` and rounded (Qwen3-8B, L = 36, n = 5:
    [1, 9, 17, 25, 33]; Llama-3.1-8B, L = 32: [1, 8, 15, 22, 29])."""
    if n < 1:
        raise ConfigError(f"a block drafter needs at least one target layer, got {n}")
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end - start + 1 < n:
        raise ConfigError(
            f"a target with {num_target_layers} layers has no {n} distinct DFlash taps in "
            f"1..{end}; set drafter.target_layer_ids"
        )
    span = end - start
    return [int(round(start + i * span / (n - 1))) for i in range(n)]
