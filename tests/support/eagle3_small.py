"""Small random EAGLE-3 drafters built directly from an architecture config (unit tests of
the eagle3 module and the TTT unroll; `kind_factories` builds drafters of any kind instead)."""

from __future__ import annotations

import torch

from draftinfer.kinds.eagle3 import Eagle3Config, Eagle3Drafter
from tests.support.kind_factories import randomized

# Shapes shared by the small random drafters of the unit tests.
SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=97,
    draft_vocab_size=61,
    target_hidden_size=32,
    aux_layer_ids=[1, 2, 3],
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)


def small_drafter(layers: int = 1, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    return randomized(Eagle3Drafter(Eagle3Config(**SMALL, num_hidden_layers=layers)))
