"""Parallel drafting (`ptd`) specifics: the training attention pattern, drop-token sampling,
the export fields, K beyond the trained K, and the draft cap near `max_model_len`. T1, S1, S2,
S8 and S9 run for every kind in `tests/test_kinds.py`."""

from __future__ import annotations

import json

import pytest
import torch

from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.proposer import FirstPass
from draftinfer.files.checkpoint import load_drafter, write_drafter
from draftinfer.files.errors import CheckpointError
from draftinfer.kinds.ptd import ParallelProposer, PTDConfig, PTDDrafter
from drafttrain.kinds.ptd.objective import ptd_dense_mask, sample_slots
from tests.support.eagle3_small import SMALL, randomized
from tests.support.prompts import zoo_prompts


def small_ptd(k: int = 5, seed: int = 0) -> PTDDrafter:
    torch.manual_seed(seed)
    return randomized(PTDDrafter(PTDConfig(**SMALL, mask_token_id=96, parallel_k=k)))


def test_attention_pattern():
    # 4 rows, then slots (anchor 2, depth 1), (anchor 2, depth 2), (anchor 0, depth 1), pad.
    P = 1 << 30
    anchor = torch.tensor([[0, 1, 2, 3, 2, 2, 0, P]])
    depth = torch.tensor([[0, 0, 0, 0, 1, 2, 1, P]])
    m = ptd_dense_mask(anchor, depth)[0].int().tolist()
    assert m[3][:4] == [1, 1, 1, 1] and m[1][:4] == [1, 1, 0, 0]  # causal rows
    assert m[1][4:] == [0, 0, 0, 0]  # rows never see slots
    assert m[4] == [1, 1, 1, 0, 1, 0, 0, 0]  # depth 1 of anchor 2: rows <= 2 and itself
    assert m[5] == [1, 1, 1, 0, 1, 1, 0, 0]  # depth 2 also sees depth 1 of its rollout
    assert m[6] == [1, 0, 0, 0, 0, 0, 1, 0]  # another anchor's rollout is invisible
    assert [row[7] for row in m[:7]] == [0] * 7  # padding is invisible


def test_drop_token_sampling_is_conditional_and_bounded():
    torch.manual_seed(0)
    cand = torch.arange(100)
    a, d = sample_slots(cand, k=6, keep_ratio=0.5, keep_floor=0.1, max_slots=10_000)
    kept = {(int(x), int(y)) for x, y in zip(a, d)}
    for x, y in kept:  # every kept slot has its whole lower rollout
        assert all((x, dd) in kept for dd in range(1, y))
    counts = [int((d == k).sum()) for k in range(1, 6)]
    assert counts[0] > counts[-1] and min(counts) >= 10  # decays, floored at 10% of anchors
    a2, _ = sample_slots(cand, k=8, keep_ratio=1.0, keep_floor=0.0, max_slots=150)
    assert a2.numel() == 150


def test_slot_budget_trains_every_depth_at_long_sequences():
    """The 8B preset's budget (4096 slots, K=8) at seq 8192: a binding budget is spread over
    the depths (every depth keeps slots, fewer the deeper), nested and never over budget;
    uniform over anchors, not the sequence's first rows."""
    torch.manual_seed(0)
    cand = torch.arange(0, 8192, 2)  # half the rows are assistant tokens
    for k in (4, 8):
        a, d = sample_slots(cand, k=k, keep_ratio=0.8, keep_floor=0.05, max_slots=4096)
        counts = [int((d == j).sum()) for j in range(1, k)]
        assert a.numel() <= 4096 and min(counts) > 0, counts
        assert counts == sorted(counts, reverse=True)
        kept = {(int(x), int(y)) for x, y in zip(a, d)}
        assert all((x, y - 1) in kept for x, y in kept if y > 1)
        deepest = a[d == k - 1].float()
        assert deepest.mean() > 2048  # spread over the sequence, not a prefix of it


def test_parallel_export_fields(tmp_path):
    """The mask token under every name vLLM and speculators read, the trained K, and
    `mask_hidden` at the pre-fc aux width; a parallel checkpoint missing its K is refused."""
    ptd = small_ptd()
    write_drafter(tmp_path / "p", ptd, {"target": "t"}, dtype=torch.float32)
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    assert cfg["parallel_drafting"] is True
    assert cfg["ptd_token_id"] == cfg["pard_token"] == cfg["mask_token_id"] == 96
    assert cfg["parallel_k"] == 5
    loaded, _ = load_drafter(tmp_path / "p", {"input_embeddings": ptd.embed_tokens.weight})
    assert loaded.mask_hidden.shape == (1, 1, 96)
    torch.testing.assert_close(loaded.mask_hidden, ptd.mask_hidden)
    # Chain mode is refused for a mask_hidden checkpoint (no silent fallback) ...
    cfg["drafttrain"]["drafter_kind"] = "eagle3"
    (tmp_path / "p" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has mask_hidden .* cannot run in chain drafting"):
        load_drafter(tmp_path / "p", {"input_embeddings": ptd.embed_tokens.weight})
    # ... and K is never defaulted.
    cfg["drafttrain"]["drafter_kind"] = "ptd"
    del cfg["parallel_k"]
    (tmp_path / "p" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing field 'parallel_k'"):
        load_drafter(tmp_path / "p", {"input_embeddings": ptd.embed_tokens.weight})


def test_k_beyond_trained_is_refused():
    d = small_ptd(k=3)
    prop = ParallelProposer(d, 1, 32, torch.device("cpu"), torch.float32)
    fp = FirstPass(
        torch.tensor([0]),
        torch.zeros(1, 2, dtype=torch.long),
        torch.zeros(1, 2, 96),
        torch.arange(2)[None],
        torch.arange(2)[None],
    )
    with pytest.raises(CheckpointError, match="exceeds the K=3"):
        prop.propose(fp, torch.tensor([4]), 4)


def test_ptd_near_max_model_len(kind_env):
    env = kind_env("ptd")
    max_len = 64
    ps = [p[-(max_len - 5) :] for p in zoo_prompts(3, seed=22)]
    dec = SpecDecoder(env["target"], env["drafter"], 7, max_batch=3, max_model_len=max_len)
    outs = dec.generate([Request(p, max_tokens=50) for p in ps])[0]
    plain = greedy_generate(env["target"], ps, 50)
    for p, o, g in zip(ps, outs, plain):
        assert len(p) + len(o.token_ids) == max_len and o.finish_reason == "length"
        assert o.token_ids == g[: max_len - len(p)]
