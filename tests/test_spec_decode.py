"""Speculative decoding on a tiny target (CPU, fp32): losslessness (T1, T4, T5), drafter
state (S1, S2, S3, S5), length/termination (L1-L4), batching (B1) and reference parity.

The target is a tiny random-init Llama-3-shaped model; the drafter is a briefly trained
EAGLE-3 export of it. Acceptance-length floors on a *trained* target live in
`tests/test_zoo_e2e.py`; here every test still asserts that drafting happened (rounds with
proposals) so "lossless because nothing was drafted" cannot pass.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from draftinfer.checkpoint import load_drafter
from draftinfer.engine import Request, SpecDecoder
from draftinfer.metrics import acceptance_length
from draftinfer.models import greedy_generate, load_native_target
from draftinfer.reference import reference_generate
from draftinfer.sampling import SamplingParams


@pytest.fixture(scope="module")
def env(train_env, tmp_path_factory):
    from tests.tiny_models import train_tiny_export

    target, drafter, _, export = train_tiny_export(
        "eagle3", train_env, tmp_path_factory.mktemp("spec_run"), 8, "drafter.ttt_steps=2"
    )
    return {
        "model": target,
        "drafter": drafter,
        "export": export,
        "target_dir": train_env["target"],
        "data": train_env["data"],
    }


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 400) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def spec(env, reqs, k=3, max_batch=16, max_model_len=160, verify="onehot", **kw):
    dec = SpecDecoder(
        env["model"],
        env["drafter"],
        k,
        max_batch=max_batch,
        max_model_len=max_model_len,
        verify=verify,
        **kw,
    )
    return dec.generate(reqs)[0]


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_t1_greedy_equals_plain_greedy(env, k, batch):
    ps = prompts(batch, seed=k * 100 + batch)
    plain = greedy_generate(env["model"], ps, 12)
    outs = spec(env, [Request(p, max_tokens=12) for p in ps], k=k, max_batch=min(batch, 8))
    assert [o.token_ids for o in outs] == plain
    assert all(sum(o.proposed) > 0 for o in outs)


@pytest.mark.parametrize("verify", ["onehot", "full"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fast_path_equals_reference_loop(env, verify, temperature):
    ps = prompts(3, seed=7)
    reqs = [
        Request(p, SamplingParams(temperature, top_k=50, top_p=0.9, seed=i), max_tokens=10)
        for i, p in enumerate(ps)
    ]
    fast = spec(env, reqs, k=3, verify=verify)
    ref = reference_generate(env["model"], env["drafter"], reqs, 3, 160, verify)
    for f, r in zip(fast, ref):
        assert f.token_ids == r.token_ids
        assert f.accepted == r.accepted and f.proposed == r.proposed


def test_t4_seeded_output_independent_of_batch(env):
    ps = prompts(6, seed=3)
    reqs = [Request(p, SamplingParams(1.0, seed=100 + i), max_tokens=10) for i, p in enumerate(ps)]
    full = spec(env, reqs, max_batch=6)
    solo = [spec(env, [r], max_batch=1)[0] for r in reqs]
    reordered = spec(env, reqs[::-1], max_batch=4)[::-1]
    for a, b, c in zip(full, solo, reordered):
        assert a.token_ids == b.token_ids == c.token_ids


def test_t5_mixed_greedy_and_sampling_batch(env):
    ps = prompts(6, seed=4)
    greedy = [Request(p, max_tokens=10) for p in ps]
    mixed = [
        r if i % 2 == 0 else replace(r, sampling=SamplingParams(1.0, seed=i))
        for i, r in enumerate(greedy)
    ]
    g = spec(env, greedy)
    m = spec(env, mixed)
    for i in range(0, 6, 2):
        assert m[i].token_ids == g[i].token_ids
    assert all(0 <= t < env["model"].config.vocab_size for o in m for t in o.token_ids)


def test_b1_heterogeneous_batch_equals_solo(env):
    ps = prompts(5, seed=5, lo=2, hi=40)
    reqs = [Request(p, max_tokens=m) for p, m in zip(ps, [3, 17, 9, 1, 12])]
    batched = spec(env, reqs, max_batch=3)  # requests finish at different times; rows reused
    for r, b in zip(reqs, batched):
        assert spec(env, [r], max_batch=1)[0].token_ids == b.token_ids
        assert len(b.token_ids) == r.max_tokens


def test_l1_stops_exactly_at_max_model_len(env):
    max_len = 40
    ps = [p[: max_len - 6] for p in prompts(4, seed=6, lo=25, hi=34)]
    outs = spec(env, [Request(p, max_tokens=100) for p in ps], k=7, max_model_len=max_len)
    plain = greedy_generate(env["model"], ps, 100)
    for p, o, g in zip(ps, outs, plain):
        assert len(p) + len(o.token_ids) == max_len
        assert o.finish_reason == "length"
        assert o.token_ids == g[: max_len - len(p)]
        assert max(o.proposed[-2:]) < 7  # drafts were capped near the limit, not wrapped


def test_l2_context_past_drafter_max_position_embeddings(env, tmp_path):
    import json
    import shutil

    short = tmp_path / "short"
    shutil.copytree(env["export"], short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (short / "config.json").write_text(json.dumps(cfg))
    d_short, _ = load_drafter(short, embed_tokens=env["model"].embed_tokens.weight)
    ps = prompts(3, seed=8, lo=30, hi=40)  # every position is past 16
    reqs = [Request(p, max_tokens=10) for p in ps]
    a = spec(env, reqs)
    b = SpecDecoder(env["model"], d_short, 3, max_batch=4, max_model_len=160).generate(reqs)[0]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accepted for o in a] == [o.accepted for o in b]


def test_l3_eos_inside_accepted_run(env):
    ps = prompts(4, seed=9)
    plain = greedy_generate(env["model"], ps, 16)
    for p, g in zip(ps, plain):
        stop = g[5]
        cut = g.index(stop) + 1
        out = spec(env, [Request(p, max_tokens=16, stop_token_ids=(stop,))], k=7)[0]
        assert out.token_ids == g[:cut] and out.finish_reason == "stop"


def test_l3_stop_string(env):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(env["target_dir"])
    p = prompts(1, seed=10)[0]
    g = greedy_generate(env["model"], [p], 16)[0]
    text = tokenizer.decode(g, skip_special_tokens=False)
    stop = text[len(tokenizer.decode(g[:4], skip_special_tokens=False)) :][:3]
    assert stop
    out = spec(env, [Request(p, max_tokens=16, stop_strings=(stop,))], k=7, tokenizer=tokenizer)[0]
    assert out.finish_reason == "stop"
    assert stop in tokenizer.decode(out.token_ids, skip_special_tokens=False)
    assert stop not in tokenizer.decode(out.token_ids[:-1], skip_special_tokens=False)
    assert out.token_ids == g[: len(out.token_ids)]
    assert stop not in out.text


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 8])
def test_l4_exactly_max_tokens(env, max_tokens):
    ps = prompts(3, seed=11)
    outs = spec(env, [Request(p, max_tokens=max_tokens) for p in ps], k=7)
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in outs)


def test_s1_first_pass_pairing(env, monkeypatch):
    """First-pass drafter rows are (t_{i+1}, f_i, pos_i) with the target's own features."""
    seen = []
    dec = SpecDecoder(env["model"], env["drafter"], 3, max_batch=2, max_model_len=160)
    orig = dec.proposer.propose

    def spy(rows, ids, aux, positions, *a, **kw):
        seen.append((ids.clone(), aux.clone(), positions.clone()))
        return orig(rows, ids, aux, positions, *a, **kw)

    monkeypatch.setattr(dec.proposer, "propose", spy)
    p = prompts(1, seed=12, lo=9, hi=9)[0]
    out = dec.generate([Request(p, max_tokens=4)])[0][0]
    ids, aux, pos = seen[0]
    assert torch.equal(ids[0], torch.tensor(p[1:] + [out.token_ids[0]]))
    assert torch.equal(pos[0], torch.arange(len(p)))
    # f_i = the target's aux taps at token i of the prompt, computed independently.
    fresh = load_native_target(env["target_dir"], max_batch=1, max_seq_len=64)
    _, ref_aux = fresh(
        torch.tensor([p]),
        torch.arange(len(p))[None],
        torch.tensor([0]),
        env["drafter"].config.aux_layer_ids,
    )
    torch.testing.assert_close(aux[0], ref_aux[0], rtol=0, atol=0)
    # Round 2's first pass: the committed tokens of round 1 at positions L-1.., never the prompt.
    ids2, _, pos2 = seen[1]
    n = int((pos2[0] >= 0).sum())
    assert pos2[0, 0].item() == len(p)  # L - 1 after the first token
    assert torch.equal(ids2[0, :n], torch.tensor(out.token_ids[1 : n + 1]))


def test_s2_drafter_kv_refreshed_with_target_features(env):
    """After rounds with rejections, drafter KV at committed positions == fresh prefill."""
    from draftinfer.engine import _Slot
    from draftinfer.kv_cache import StaticKVCache

    d = env["drafter"]
    dec = SpecDecoder(env["model"], d, 4, max_batch=1, max_model_len=160)
    p = prompts(1, seed=13, lo=12, hi=12)[0]
    slot = _Slot(0, Request(p, SamplingParams(0.0, seed=0), max_tokens=40), 0, list(p))
    dec._prefill(slot)
    rejected = 0
    for _ in range(6):
        L_before = len(slot.tokens)
        dec._round([slot])
        rejected += slot.proposed[-1] - slot.accepted[-1]
        dec.proposer.propose(
            torch.tensor([0]),
            slot.fp_ids[None],
            slot.fp_aux[None],
            slot.fp_pos[None],
            torch.tensor([0]),
            1,
        )  # the refresh pass
        L = len(slot.tokens)
        # fresh: target features over the committed prefix, drafter prefill with no history
        fresh_t = load_native_target(env["target_dir"], max_batch=1, max_seq_len=160)
        _, aux = fresh_t(
            torch.tensor([slot.tokens[:-1]]),
            torch.arange(L - 1)[None],
            torch.tensor([0]),
            d.config.aux_layer_ids,
        )
        cache = StaticKVCache(
            1, 1, 160, d.config.num_key_value_heads, d.config.head_dim, "cpu", torch.float32
        )
        pos = torch.arange(L - 1)[None]
        d(
            torch.tensor([slot.tokens[1:]]),
            d.project_aux(aux),
            pos,
            cache.bind(pos, torch.tensor([0])),
        )
        torch.testing.assert_close(
            dec.proposer.cache.k[0][0, : L - 1], cache.k[0][0, : L - 1], rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            dec.proposer.cache.v[0][0, : L - 1], cache.v[0][0, : L - 1], rtol=1e-5, atol=1e-5
        )
        assert L > L_before
    assert rejected > 0


def test_s3_chain_carries_prenorm_output(env, monkeypatch):
    d = env["drafter"]
    calls = []
    orig = type(d).forward

    def spy(self, ids, feature, positions, attn_fn):
        normed, pre = orig(self, ids, feature, positions, attn_fn)
        calls.append((feature.clone(), pre.clone(), positions.clone()))
        return normed, pre

    monkeypatch.setattr(type(d), "forward", spy)
    p = prompts(1, seed=14, lo=6, hi=6)[0]
    spec(env, [Request(p, max_tokens=10)], k=3, max_batch=1)
    (f0, pre0, pos0), (f1, pre1, pos1), (f2, _, pos2) = calls[:3]
    assert torch.equal(f1[0, 0], pre0[0, -1])  # step 2 consumes step 1's pre-norm output
    assert torch.equal(f2[0, 0], pre1[0, 0])
    assert pos1.item() == pos0[0, -1].item() + 1 and pos2.item() == pos0[0, -1].item() + 2


def test_s5_drafts_are_mapped_through_d2t(env):
    d = env["drafter"]
    ids = torch.arange(d.config.draft_vocab_size) + d.d2t
    assert bool(d.t2d[ids].all()) and int(d.t2d.sum()) == d.config.draft_vocab_size
    drafts = []
    dec = SpecDecoder(env["model"], d, 3, max_batch=2, max_model_len=160)
    orig = dec.proposer.propose

    def spy(*a, **kw):
        out = orig(*a, **kw)
        drafts.append(out[0])
        return out

    dec.proposer.propose = spy
    dec.generate([Request(p, max_tokens=6) for p in prompts(2, seed=15)])
    allowed = set(ids.tolist())
    assert all(t in allowed for x in drafts for t in x.flatten().tolist())


def test_kernel_path_matches_reference_sampler(env, monkeypatch):
    """The Triton rejection sampler (interpreted on CPU) and its torch reference give the same
    tokens end to end."""
    import draftkernels.rejection_sampler as rs

    ps = prompts(3, seed=16)
    reqs = [Request(p, SamplingParams(1.0, seed=i), max_tokens=6) for i, p in enumerate(ps)]
    a = spec(env, reqs)
    assert rs.use_triton(torch.device("cpu")) or torch.cuda.is_available()
    monkeypatch.setattr(rs, "use_triton", lambda device: False)
    b = spec(env, reqs)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accepted for o in a] == [o.accepted for o in b]


def test_cli_report_and_plot(env, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    report = tmp_path / "r.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftinfer",
            f"drafter={env['export']}",
            f"prompts={env['data']}",
            "prompts_split=train",
            "num_prompts=4",
            "max_new_tokens=8",
            "batch_size=2",
            "max_model_len=128",
            f"report={report}",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(report.read_text())
    for key in (
        "acceptance_length",
        "per_position_acceptance",
        "lossless",
        "tokens_per_s_plain",
        "tokens_per_s_spec",
        "speedup",
    ):
        assert key in rep, key
    assert rep["lossless"] is True and rep["rounds"] > 0 and rep["acceptance_length"] >= 1.0
    assert len(rep["per_position_acceptance"]) == 3
    assert report.with_suffix(".png").stat().st_size > 1000
    assert "acceptance length" in r.stdout and "lossless" in r.stdout


def test_drafter_target_mismatch_is_one_line_error(env, tiny_qwen3_dir):
    from draftinfer.config import InferConfig
    from draftinfer.errors import CheckpointError
    from draftinfer.run import run_eval

    cfg = InferConfig(
        drafter=env["export"],
        target=str(tiny_qwen3_dir),
        prompts=env["data"],
        prompts_split="train",
        num_prompts=1,
        progress=False,
    )
    with pytest.raises(CheckpointError) as e:
        run_eval(cfg)
    assert "does not match" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["eagle3", "ptd"])
def test_untrained_random_drafter_is_lossless_with_al_near_one(env, kind):
    from tests.tiny_models import untrained_drafter

    d = untrained_drafter(kind, env["model"], parallel_k=3)
    ps = prompts(6, seed=40)
    plain = greedy_generate(env["model"], ps, 16)
    outs = SpecDecoder(env["model"], d, 3, max_batch=6, max_model_len=160).generate(
        [Request(p, max_tokens=16) for p in ps]
    )[0]
    assert [o.token_ids for o in outs] == plain
    al = acceptance_length([a for o in outs for a in o.accepted])
    assert 1.0 <= al <= 1.15, al
