"""Speculative decoding mechanics with a chain EAGLE-3 drafter briefly trained on the zoo target
(CPU, fp32): seeded sampling (T4), batching (B1), length and termination (L1-L4), the
chain's carried features (S3), the draft vocabulary (S5), the kernel path, the CLI report,
one-line errors, and untrained drafters of every kind. The catalogue every kind inherits
(T1, S1, S2, S8, S9) lives in `tests/test_kinds.py`.
"""

from __future__ import annotations

import pytest
import torch

from draftinfer.conventions.metrics import acceptance_length
from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.sampling import SamplingParams
from draftinfer.files.checkpoint import load_drafter
from draftinfer.registry import registered_kinds
from tests.support.prompts import random_prompts, zoo_prompts

MAX_LEN = 384


@pytest.fixture
def env(kind_env):
    return kind_env("eagle3")


def spec(env, reqs, k=3, max_batch=16, max_model_len=MAX_LEN, verify="onehot", **kw):
    dec = SpecDecoder(
        env["target"],
        env["drafter"],
        k,
        max_batch=max_batch,
        max_model_len=max_model_len,
        verify=verify,
        **kw,
    )
    return dec.generate(reqs)[0]


def test_t4_seeded_output_independent_of_batch(env):
    ps = zoo_prompts(6, seed=3)
    reqs = [Request(p, SamplingParams(1.0, seed=100 + i), max_tokens=10) for i, p in enumerate(ps)]
    full = spec(env, reqs, max_batch=6)
    solo = [spec(env, [r], max_batch=1)[0] for r in reqs]
    reordered = spec(env, reqs[::-1], max_batch=4)[::-1]
    for a, b, c in zip(full, solo, reordered):
        assert a.token_ids == b.token_ids == c.token_ids


def test_b1_heterogeneous_batch_equals_solo(env):
    ps = zoo_prompts(5, seed=5)
    reqs = [Request(p, max_tokens=m) for p, m in zip(ps, [3, 17, 9, 1, 12])]
    batched = spec(env, reqs, max_batch=3)  # requests finish at different times; rows reused
    for r, b in zip(reqs, batched):
        assert spec(env, [r], max_batch=1)[0].token_ids == b.token_ids
        assert len(b.token_ids) == r.max_tokens
    assert sum(a for o in batched for a in o.accepted) > 0


def test_l1_stops_exactly_at_max_model_len(env):
    max_len = 64
    ps = [p[-(max_len - 6) :] for p in zoo_prompts(4, seed=6)]
    outs = spec(env, [Request(p, max_tokens=100) for p in ps], k=7, max_model_len=max_len)
    plain = greedy_generate(env["target"], ps, 100)
    for p, o, g in zip(ps, outs, plain):
        assert len(p) + len(o.token_ids) == max_len
        assert o.finish_reason == "length"
        assert o.token_ids == g[: max_len - len(p)]
        assert max(o.proposed[-2:]) < 7  # drafts were capped near the limit, not wrapped


def test_l2_context_past_drafter_max_position_embeddings(env, tmp_path, zoo_target):
    """L2: a drafter whose config declares max_position_embeddings 16 drafts contexts far past
    16 exactly as the unchanged drafter does (RoPE is computed per position, never read from a
    table of the declared length). Checked to bite: the short value is what the loaded drafter
    holds, positions past it reach its rotary, the drafter accepts; and the check engines need
    (a declared length shorter than the target's corrupts their RoPE tables) refuses it."""
    import json
    import shutil

    from draftinfer.files.checkpoint import read_drafter_config
    from draftinfer.files.errors import CheckpointError

    short = tmp_path / "short"
    shutil.copytree(env["export"], short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (short / "config.json").write_text(json.dumps(cfg))
    d_short, _ = load_drafter(short, env["target"].shared_weights())
    assert d_short.config.max_position_embeddings == 16
    seen = []
    rotary = d_short.rotary.forward
    d_short.rotary.forward = lambda pos: seen.append(int(pos.max())) or rotary(pos)
    ps = [p for p in zoo_prompts(12, seed=8) if len(p) > 30][:6]  # every position is past 16
    reqs = [Request(p, max_tokens=24) for p in ps]
    a = spec(env, reqs)
    b = SpecDecoder(env["target"], d_short, 3, max_batch=4, max_model_len=MAX_LEN).generate(reqs)[0]
    assert max(seen) > 16 + 30
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accepted for o in a] == [o.accepted for o in b]
    assert sum(x for o in a for x in o.accepted) > 0
    spec_, arch, _ = read_drafter_config(short)
    with pytest.raises(CheckpointError, match="max_position_embeddings 16 is shorter"):
        spec_.check_fit(arch, zoo_target.info)


def test_l3_eos_inside_accepted_run(env):
    ps = zoo_prompts(4, seed=9)
    plain = greedy_generate(env["target"], ps, 16)
    for p, g in zip(ps, plain):
        stop = g[5]
        cut = g.index(stop) + 1
        out = spec(env, [Request(p, max_tokens=16, stop_token_ids=(stop,))], k=7)[0]
        assert out.token_ids == g[:cut] and out.finish_reason == "stop"


def test_l3_stop_string(env):
    from transformers import AutoTokenizer

    from draftinfer.files.paths import resolve_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_path("zoo:llama-tiny"))
    p = zoo_prompts(1, seed=10)[0]
    g = greedy_generate(env["target"], [p], 16)[0]
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
    ps = zoo_prompts(3, seed=11)
    outs = spec(env, [Request(p, max_tokens=max_tokens) for p in ps], k=7)
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in outs)


def test_s3_chain_carries_prenorm_output(env, monkeypatch):
    d = env["drafter"]
    calls = []
    orig = type(d).forward

    def spy(self, ids, feature, rope_pos, attn_fn, mm=None):
        normed, pre = orig(self, ids, feature, rope_pos, attn_fn, mm)
        calls.append((feature.clone(), pre.clone(), rope_pos.clone()))
        return normed, pre

    monkeypatch.setattr(type(d), "forward", spy)
    p = zoo_prompts(1, seed=14)[0]
    spec(env, [Request(p, max_tokens=10)], k=3, max_batch=1)
    # calls[0] is admit's prompt prefix; then the round: first pass, step 2, step 3.
    (f0, pre0, pos0), (f1, pre1, pos1), (f2, _, pos2) = calls[1:4]
    assert torch.equal(f1[0, 0], pre0[0, 0])  # step 2 consumes step 1's pre-norm output
    assert torch.equal(f2[0, 0], pre1[0, 0])
    assert pos1.item() == pos0[0, 0].item() + 1 and pos2.item() == pos0[0, 0].item() + 2


def test_s5_drafts_are_mapped_through_d2t(env):
    d = env["drafter"]
    ids = torch.arange(d.config.draft_vocab_size) + d.d2t
    assert bool(d.t2d[ids].all()) and int(d.t2d.sum()) == d.config.draft_vocab_size
    drafts = []
    dec = SpecDecoder(env["target"], d, 3, max_batch=2, max_model_len=MAX_LEN)
    orig = dec.proposer.propose

    def spy(*a, **kw):
        out = orig(*a, **kw)
        drafts.append(out[0])
        return out

    dec.proposer.propose = spy
    dec.generate([Request(p, max_tokens=6) for p in zoo_prompts(2, seed=15)])
    allowed = set(ids.tolist()) | {0}  # 0 = no draft (past a request's cap, idle rows)
    assert all(t in allowed for x in drafts for t in x.flatten().tolist())


def test_kernel_path_matches_reference_sampler(env, monkeypatch):
    """The Triton rejection sampler (interpreted on CPU) and its torch reference give the same
    tokens end to end."""
    import draftkernels.rejection_sampler as rs

    ps = zoo_prompts(3, seed=16)
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
    costs = tmp_path / "costs.json"  # K=9 is beyond the run's K=3: not ranked
    costs.write_text(json.dumps({"round_cost": {"2": 1.2, "3": 1.3, "9": 2.0}}))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftinfer",
            f"drafter={env['export']}",
            "prompts=zoo:chat",
            "prompts_split=test",
            "num_prompts=6",
            "max_new_tokens=16",
            "batch_size=3",
            "max_model_len=384",
            f"report={report}",
            f"round_costs={costs}",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
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
    # The trained drafter accepts: AL clearly above 1 (an untrained one stays near 1.0).
    assert rep["lossless"] is True and rep["rounds"] > 0 and rep["acceptance_length"] > 1.2
    assert len(rep["per_position_acceptance"]) == 3 and rep["per_position_acceptance"][0] > 0.2
    assert report.with_suffix(".png").stat().st_size > 1000
    assert "acceptance length" in r.stdout and "lossless" in r.stdout
    # The best K for these costs, from the run's own per-position acceptance.
    choice, pos = rep["extra"]["k_choice"], rep["per_position_acceptance"]
    assert sorted(choice["by_k"]) == ["2", "3"]
    rates = {k: (1 + sum(pos[:k])) / c for k, c in ((2, 1.2), (3, 1.3))}
    assert choice["k"] == max(rates, key=rates.get)
    assert choice["by_k"]["3"]["expected_speedup"] == pytest.approx(rates[3])
    assert f"K={choice['k']}:" in r.stdout and "best K" in r.stdout


def test_a_bad_round_costs_file_is_one_line_error_before_loading(tmp_path):
    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.run import run_eval
    from draftinfer.files.errors import ConfigError

    bad = tmp_path / "costs.json"
    for text, words in (
        (None, "no file"),
        ('{"round_costs": {}}', "is not"),
        ('{"round_cost": {"3": 0}}', "costs > 0"),
    ):
        if text is not None:
            bad.write_text(text)
        # The drafter does not exist: the costs are read first, before anything loads.
        cfg = InferConfig(drafter=str(tmp_path / "none"), round_costs=str(bad), progress=False)
        with pytest.raises(ConfigError) as e:
            run_eval(cfg)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_drafter_target_mismatch_is_one_line_error(env, tiny_qwen3_dir):
    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.run import run_eval
    from draftinfer.files.errors import CheckpointError

    cfg = InferConfig(
        drafter=env["export"],
        target=str(tiny_qwen3_dir),
        prompts="zoo:chat",
        prompts_split="test",
        num_prompts=1,
        progress=False,
    )
    with pytest.raises(CheckpointError) as e:
        run_eval(cfg)
    assert "does not match" in str(e.value) and "\n" not in str(e.value)


def test_fused_projections_serve_the_same_tokens(env):
    """`fuse_projections=true` (the default on CUDA) runs the same target: lossless, and the
    drafter accepts as it does on the unfused target (fp32: the fused GEMM sums in another
    order, so equal tokens rather than equal bits)."""
    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.run import run_eval

    reps = []
    for fuse in (False, True):
        cfg = InferConfig(
            drafter=env["export"],
            prompts="zoo:chat",
            prompts_split="test",
            num_prompts=4,
            max_new_tokens=16,
            batch_size=4,
            max_model_len=MAX_LEN,
            fuse_projections=fuse,
            progress=False,
        )
        reps.append(run_eval(cfg))
    assert all(r.lossless is True for r in reps)
    assert reps[0].acceptance_length > 1.2
    assert reps[1].acceptance_length == pytest.approx(reps[0].acceptance_length, abs=0.05)


@pytest.mark.parametrize("kind", registered_kinds())
def test_fused_drafter_projections_serve_what_unfused_ones_do(kind_env, kind):
    """`fuse_projections` on a drafter (every kind's attention blocks and SwiGLU MLPs; a block
    drafter's context k/v through the fused k/v rows): the same tokens and the same accepted
    counts as the unfused drafter, with drafts accepted, and the HF-named weights unchanged."""
    import copy

    from draftinfer.models.layers import Attention
    from draftinfer.models.transforms import FusedAttention, fuse_projections

    env = kind_env(kind)
    fused = copy.deepcopy(env["drafter"])
    names = {k: v.clone() for k, v in fused.state_dict().items()}
    fuse_projections(fused)
    assert any(isinstance(m, FusedAttention) for m in fused.modules())
    assert not any(type(m) is Attention for m in fused.modules())
    after = fused.state_dict()
    assert list(after) == list(names) and all(torch.equal(after[k], names[k]) for k in names)
    ps = zoo_prompts(4, seed=12)
    runs = []
    for drafter in (env["drafter"], fused):
        dec = SpecDecoder(env["target"], drafter, 3, max_batch=4, max_model_len=MAX_LEN)
        runs.append(dec.generate([Request(p, max_tokens=16) for p in ps])[0])
    for a, b in zip(*runs):
        assert (a.token_ids, a.accepted) == (b.token_ids, b.accepted)
    assert sum(x for o in runs[0] for x in o.accepted) > 0


@pytest.mark.parametrize("kind", registered_kinds())
def test_compiled_greedy_choice_drafts_what_the_eager_one_does(kind_env, kind):
    """`Proposer.compile` compiles the greedy choice of drafts (`greedy_record`) for every
    kind. Traced by dynamo with the engine's options (dynamic shapes, `aot_eager`: no compiler
    needed; fullgraph; the recompile limit an error), every other piece left eager (the kinds'
    compiled glue has its own tests): the same tokens and accepted counts as the eager
    proposer, with drafts accepted (a wrong draft id would show as fewer)."""
    from draftinfer.decoding.proposer import greedy_record

    env = kind_env(kind)
    ps = zoo_prompts(3, seed=14)
    runs = []
    torch._dynamo.reset()
    for compile_it in (False, True):
        dec = SpecDecoder(env["target"], env["drafter"], 3, max_batch=3, max_model_len=MAX_LEN)
        if compile_it:
            eager = dict(vars(dec.proposer))
            dec.proposer.compile(backend="aot_eager", dynamic=True, fullgraph=True)
            for name, fn in vars(dec.proposer).items():  # only the greedy choice traced
                if name != "_greedy" and callable(fn) and not isinstance(fn, torch.nn.Module):
                    setattr(dec.proposer, name, eager[name])
            assert dec.proposer._greedy is not greedy_record
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            runs.append(dec.generate([Request(p, max_tokens=12) for p in ps])[0])
    for a, b in zip(*runs):
        assert (a.token_ids, a.accepted) == (b.token_ids, b.accepted)
    assert sum(x for o in runs[0] for x in o.accepted) > 0


@pytest.mark.parametrize("kind", registered_kinds())
def test_untrained_random_drafter_is_lossless_with_al_near_one(zoo_target, kind):
    from draftinfer.files.paths import resolve_path
    from tests.support.tiny_models import untrained_drafter

    d = untrained_drafter(kind, resolve_path("zoo:llama-tiny"), zoo_target)
    ps = random_prompts(6, seed=40)
    plain = greedy_generate(zoo_target, ps, 16)
    outs = SpecDecoder(zoo_target, d, 3, max_batch=6, max_model_len=MAX_LEN).generate(
        [Request(p, max_tokens=16) for p in ps]
    )[0]
    assert [o.token_ids for o in outs] == plain
    al = acceptance_length([a for o in outs for a in o.accepted])
    assert 1.0 <= al <= 1.15, al


@pytest.mark.parametrize("kind", registered_kinds())
def test_p1_one_round_ahead_serves_what_one_at_a_time_does(kind_env, kind):
    """P1 (`SpecDecoder(pipeline=True)`, the CUDA default): launching round i+1 before reading
    round i back, with the rows of the unread round left to the device's carry, emits the same
    tokens, finish reasons, accepted and proposed counts as reading every round back first,
    with requests that stop on EOS inside an accepted run, on `max_tokens` (1 included), on
    `max_model_len`, seeded sampling, and more requests than rows (rows freed while a round
    that still ran them is in flight, then refilled). The rounds launched ahead for stopped
    requests are dropped, and there were some."""
    env = kind_env(kind)
    max_len = 72
    ps = [p[-(max_len - 12) :] for p in zoo_prompts(8, seed=31)]
    plain = greedy_generate(env["target"], ps, 12)
    reqs = []
    for i, (p, g) in enumerate(zip(ps, plain)):
        sampling = SamplingParams(1.0, seed=7 + i) if i == 3 else SamplingParams(0.0)
        stop = (g[6],) if i % 4 == 1 else ()
        reqs.append(
            Request(p, sampling, max_tokens=[9, 1, 40, 5, 16, 12, 2, 40][i], stop_token_ids=stop)
        )
    runs = {}
    for ahead in (False, True):
        dec = SpecDecoder(
            env["target"], env["drafter"], 3, max_batch=3, max_model_len=max_len, pipeline=ahead
        )
        outs, stats = dec.generate(reqs)
        runs[ahead] = outs, stats["rounds"], dec._launches
    (one, n_one, launched_one), (ahead, n_ahead, launched_ahead) = runs[False], runs[True]
    for a, b in zip(one, ahead):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert (a.accepted, a.proposed) == (b.accepted, b.proposed)
    assert {o.finish_reason for o in one} == {"stop", "length"}
    assert any(len(p) + len(o.token_ids) == max_len for p, o in zip(ps, one))
    assert sum(x for o in one for x in o.accepted) > 0
    # Every round read one at a time ran a request; ahead, some ran only stopped ones (a row
    # freed while a round was in flight is refilled one round later, so the counts differ).
    assert n_one == launched_one and n_ahead < launched_ahead


def test_p1_runner_config_reaches_the_decoder(monkeypatch):
    """`infer.pipeline` (null: on for CUDA) and the other decoder settings of the runner's
    config reach `SpecDecoder` in `run_eval` and the suites (`draftinfer.evaluation.run.spec_decoder`)."""
    import draftinfer.evaluation.run as run
    from draftinfer.evaluation.config import InferConfig

    seen = {}
    monkeypatch.setattr(run, "SpecDecoder", lambda *a, **kw: seen.update(kw, args=a))
    cfg = InferConfig(k=5, batch_size=3, pipeline=False, cuda_graphs=True, verify="full")
    cfg.compile_options = {"combo_kernels": True}
    run.spec_decoder(cfg, "target", "drafter", "tok")
    assert seen["args"] == ("target", "drafter", 5)
    assert (seen["pipeline"], seen["cuda_graphs"], seen["verify"]) == (False, True, "full")
    assert (seen["max_batch"], seen["tokenizer"]) == (3, "tok")
    assert seen["compile_options"] == {"combo_kernels": True}
    run.spec_decoder(InferConfig(), "target", "drafter", None)
    assert seen["pipeline"] is None  # SpecDecoder's default: on for CUDA, off on the CPU
    assert seen["compile_options"] is None


def test_runner_compiles_with_combo_kernels_on_cuda_only(env, monkeypatch):
    """`compile_options=None` is the runner's default: inductor's combo kernels on CUDA
    (`RUNNER_CUDA_OPTIONS`), inductor's own defaults elsewhere; options given replace it (`{}`
    too), and `SpecDecoder` compiles with what that resolves to."""
    import draftinfer.decoding.engine as engine
    from draftinfer.decoding.compiled import RUNNER_CUDA_OPTIONS, runner_compile_options

    assert runner_compile_options(None, "cuda") == {"combo_kernels": True}
    assert runner_compile_options(None, torch.device("cpu")) == {}
    assert runner_compile_options({}, "cuda") == {}
    assert runner_compile_options({"max_autotune": True}, "cuda:0") == {"max_autotune": True}
    runner_compile_options(None, "cuda")["combo_kernels"] = False  # a copy
    assert RUNNER_CUDA_OPTIONS == {"combo_kernels": True}
    seen = []
    monkeypatch.setattr(engine, "compiled", lambda fn, **kw: seen.append(kw) or fn)
    for given in (None, {"max_autotune": True}):
        d, t = env["drafter"], env["target"]
        SpecDecoder(t, d, 3, 2, MAX_LEN, compile="target", compile_options=given)
    assert seen == [{"dynamic": True}, {"dynamic": True, "options": {"max_autotune": True}}]


def test_unknown_compile_option_is_a_one_line_error_before_loading():
    """`infer.compile_options` names inductor settings; a misspelt one fails at the config
    check (before any model loads), not at the first compile."""
    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.run import check_infer_config
    from draftinfer.files.errors import ConfigError

    ok = InferConfig(drafter="d", compile=True, compile_options={"combo_kernels": True})
    check_infer_config(ok)
    bad = InferConfig(drafter="d", compile=True, compile_options={"combo_kernel": True})
    with pytest.raises(ConfigError, match="'combo_kernel' is not an inductor setting"):
        check_infer_config(bad)
    eager = InferConfig(drafter="d", compile_options={"combo_kernels": True})
    with pytest.raises(ConfigError, match="compile_options are inductor settings for compile"):
        check_infer_config(eager)


def test_choose_k_ranks_measured_ks_by_tokens_per_cost():
    from draftinfer.conventions.metrics import choose_k

    # P(drafts 1..j accepted) measured at K=4; costs in plain steps at K=2..6.
    pos = [0.8, 0.6, 0.3, 0.1]
    out = choose_k(pos, {2: 1.2, 3: 1.3, 4: 1.6, 5: 1.7, 6: 1.8})
    assert sorted(out["by_k"]) == [2, 3, 4]  # 5 and 6 have no measured acceptance
    # K=2: 2.4 / 1.2 = 2.0; K=3: 2.7 / 1.3 = 2.077; K=4: 2.8 / 1.6 = 1.75.
    assert out["k"] == 3
    assert out["by_k"][3]["tokens_per_round"] == pytest.approx(2.7)
    assert out["by_k"][2]["expected_speedup"] == pytest.approx(2.0)
    assert choose_k(pos, {7: 2.0}) == {"k": None, "by_k": {}}
