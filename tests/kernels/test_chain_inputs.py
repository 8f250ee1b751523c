"""Chain-drafter input preparation kernel == torch reference == a loop oracle, on random
ragged rounds (CPU: Triton interpreter; CUDA: compiled)."""

from __future__ import annotations

import random

import pytest
import torch
from draftkernels.runtime import use_triton

from tests.support.utils import import_kernel_module, kernel_test_device, poison_empty  # noqa: F401

ci = import_kernel_module("draftkernels.chain_inputs")
DEVICE = kernel_test_device()


def oracle(out, acc, lens):
    """Row-by-row: first-pass rows = the emitted tokens at L-1+j; pending = last emitted."""
    B, W = len(out), len(out[0])
    ids = [[0] * W for _ in range(B)]
    pos = [[-1] * W for _ in range(B)]
    for b in range(B):
        for j in range(acc[b] + 1):
            ids[b][j] = out[b][j]
            pos[b][j] = lens[b] - 1 + j
    return ids, pos, [lens[b] + acc[b] + 1 for b in range(B)], [out[b][acc[b]] for b in range(B)]


def random_round(rng: random.Random, B: int, K: int):
    acc = [rng.randint(0, K) for _ in range(B)]
    lens = [rng.randint(2, 500) for _ in range(B)]
    out = [[rng.randrange(0, 1000) if j <= acc[b] else -1 for j in range(K + 1)] for b in range(B)]
    return out, acc, lens


@pytest.mark.parametrize("B", [1, 3, 7, 16])
@pytest.mark.parametrize("K", [1, 2, 5, 8])
def test_kernel_and_reference_match_oracle(B, K, poison_empty):  # noqa: F811
    rng = random.Random(B * 100 + K)
    for _ in range(3):
        out, acc, lens = random_round(rng, B, K)
        want = oracle(out, acc, lens)
        args = (
            torch.tensor(out, device=DEVICE),
            torch.tensor(acc, device=DEVICE),
            torch.tensor(lens, device=DEVICE),
        )
        for fn in (ci.prepare_chain_inputs, ci.prepare_chain_inputs_ref):
            got = fn(*args)
            assert [t.tolist() for t in got] == list(want), fn.__name__


def test_the_kernel_runs_here():
    assert use_triton(torch.device(DEVICE)), "kernel would fall back to the reference"


def test_rejects_bad_inputs():
    out = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="num_accepted must have dtype"):
        ci.prepare_chain_inputs(
            out, torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        ci.prepare_chain_inputs(
            out, torch.zeros(2, dtype=torch.long), torch.ones(3, dtype=torch.long)
        )
