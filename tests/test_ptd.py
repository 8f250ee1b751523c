"""Parallel drafting (`ptd`): train/serve parity (S9), mode/weights consistency (S8), the
attention pattern, drop-token sampling, and lossless greedy decoding (T1) for K in {1, 3, 7}
and batch in {1, 4, 16}."""

from __future__ import annotations

import json

import pytest
import torch

from draftinfer.checkpoint import load_drafter, write_drafter
from draftinfer.drafters.ptd import PTDConfig, PTDDrafter
from draftinfer.engine import Request, SpecDecoder
from draftinfer.errors import CheckpointError
from draftinfer.models import greedy_generate
from draftinfer.proposers import Eagle3ChainProposer, ParallelProposer
from draftinfer.reference import reference_generate
from draftinfer.sampling import SamplingParams
from drafttrain.config import PTDTrainConfig
from drafttrain.objectives.ptd import PTDObjective, ptd_dense_mask, sample_slots
from tests.test_spec_decode import prompts
from tests.test_ttt import SMALL, randomized, small_drafter


def small_ptd(k: int = 5, seed: int = 0) -> PTDDrafter:
    torch.manual_seed(seed)
    return randomized(PTDDrafter(PTDConfig(**SMALL, mask_token_id=96, parallel_k=k)))


@pytest.mark.parametrize("anchor", [0, 4, 9])
def test_s9_parallel_forward_equals_training_forward(anchor):
    K = 5
    d = small_ptd(K)
    T = 14
    torch.manual_seed(2)
    ids = torch.randint(0, 97, (1, T))
    aux = torch.randn(1, T, 96)
    pos = torch.arange(T)[None]  # cache index == position for text targets
    obj = PTDObjective(d, PTDTrainConfig(parallel_k=K), "eager")
    with torch.no_grad():
        logits, anc, dep = obj.forward_slots(
            ids, aux, pos, [torch.full((K - 1,), anchor)], [torch.arange(1, K)]
        )
    train_logits = torch.cat([logits[0, anchor : anchor + 1], logits[0, T : T + K - 1]])
    # Runner: the committed rows 0..anchor (t_{i+1}, f_i, pos_i), then ONE parallel forward.
    prop = ParallelProposer(
        d, max_batch=2, max_seq_len=64, device=torch.device("cpu"), dtype=torch.float32
    )
    seen = []

    def record(lg, step):
        seen.append(lg.clone())
        return lg.argmax(-1), None

    n = anchor + 1
    prop.propose(
        torch.tensor([1]), ids[:, 1 : n + 1], aux[:, :n], pos[:, :n], torch.tensor([K]), K, record
    )
    serve_logits = torch.cat(seen)
    torch.testing.assert_close(serve_logits, train_logits, rtol=1e-5, atol=1e-5)


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


def test_s8_mode_and_weights_consistency(tmp_path):
    ptd, chain = small_ptd(), small_drafter()
    cpu = torch.device("cpu")
    with pytest.raises(CheckpointError, match="cannot run in chain mode"):
        Eagle3ChainProposer(ptd, 1, 32, cpu, torch.float32)
    with pytest.raises(CheckpointError, match="cannot run in parallel mode"):
        ParallelProposer(chain, 1, 32, cpu, torch.float32)
    write_drafter(tmp_path / "p", ptd, {"target": "t"}, dtype=torch.float32)
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    assert cfg["parallel_drafting"] is True
    assert cfg["ptd_token_id"] == cfg["pard_token"] == cfg["mask_token_id"] == 96
    assert cfg["parallel_k"] == 5
    loaded, _ = load_drafter(tmp_path / "p")
    assert loaded.mask_hidden.shape == (1, 1, 96)
    torch.testing.assert_close(loaded.mask_hidden, ptd.mask_hidden)
    # A mask_hidden checkpoint whose config claims chain drafting is refused.
    cfg["drafttrain"]["drafter_kind"] = "eagle3"
    (tmp_path / "p" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has mask_hidden"):
        load_drafter(tmp_path / "p")
    # A parallel config without mask_hidden is refused.
    write_drafter(tmp_path / "c", chain, {"target": "t"}, dtype=torch.float32)
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["drafttrain"]["drafter_kind"] = "ptd"
    cfg["ptd_token_id"] = 3
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="needs mask_hidden"):
        load_drafter(tmp_path / "c")


def test_k_beyond_trained_is_refused():
    d = small_ptd(k=3)
    prop = ParallelProposer(d, 1, 32, torch.device("cpu"), torch.float32)
    with pytest.raises(CheckpointError, match="exceeds the K=3"):
        prop.propose(
            torch.tensor([0]),
            torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, 2, 96),
            torch.arange(2)[None],
            torch.tensor([4]),
            4,
        )


@pytest.fixture(scope="module")
def ptd_env(train_env, tmp_path_factory):
    from tests.tiny_models import train_tiny_export

    target, drafter, meta, _ = train_tiny_export(
        "ptd_eagle3", train_env, tmp_path_factory.mktemp("ptd_run"), 6, "drafter.parallel_k=7"
    )
    assert meta["parallel_k"] == 7 and drafter.parallel
    return {"model": target, "drafter": drafter}


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_t1_ptd_greedy_equals_plain_greedy(ptd_env, k, batch):
    ps = prompts(batch, seed=k * 10 + batch)
    plain = greedy_generate(ptd_env["model"], ps, 10)
    dec = SpecDecoder(
        ptd_env["model"], ptd_env["drafter"], k, max_batch=min(batch, 8), max_model_len=160
    )
    outs = dec.generate([Request(p, max_tokens=10) for p in ps])[0]
    assert [o.token_ids for o in outs] == plain
    assert all(sum(o.proposed) > 0 for o in outs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ptd_fast_path_equals_reference(ptd_env, temperature):
    ps = prompts(3, seed=21)
    reqs = [
        Request(p, SamplingParams(temperature, seed=i), max_tokens=10) for i, p in enumerate(ps)
    ]
    dec = SpecDecoder(ptd_env["model"], ptd_env["drafter"], 4, max_batch=3, max_model_len=160)
    fast = dec.generate(reqs)[0]
    ref = reference_generate(ptd_env["model"], ptd_env["drafter"], reqs, 4, 160)
    for f, r in zip(fast, ref):
        assert f.token_ids == r.token_ids and f.accepted == r.accepted


def test_ptd_near_max_model_len(ptd_env):
    max_len = 36
    ps = [p[: max_len - 5] for p in prompts(3, seed=22, lo=28, hi=33)]
    dec = SpecDecoder(ptd_env["model"], ptd_env["drafter"], 7, max_batch=3, max_model_len=max_len)
    outs = dec.generate([Request(p, max_tokens=50) for p in ps])[0]
    plain = greedy_generate(ptd_env["model"], ps, 50)
    for p, o, g in zip(ps, outs, plain):
        assert len(p) + len(o.token_ids) == max_len and o.finish_reason == "length"
        assert o.token_ids == g[: max_len - len(p)]
