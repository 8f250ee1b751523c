"""Helpers of the training-step benchmark tests (`draftbench/train_step.py` and its peers):
the trainable-parameter count of a block drafter written out from its architecture, so that
our dflash row and speculators' DFlash row are checked against the same independent number."""

from __future__ import annotations


def dflash_trainable(h: int, inter: int, heads: int, kv: int, hd: int, layers: int, taps: int):
    """What a DFlash drafter trains (the embedding and head are the target's, frozen):
    fc [H, taps * H] + hidden_norm [H] + per layer (q/k/v/o, q/k norms [hd], gate/up/down,
    input/post-attention norms) + the final norm [H]."""
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd
    layer = attn + 3 * h * inter + 2 * h
    return taps * h * h + h + layers * layer + h
