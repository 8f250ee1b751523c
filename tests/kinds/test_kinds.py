"""The test catalogue parametrized over the registered drafter kinds (DESIGN section 6): a kind
inherits T1, S1, S2, S8 and S9 (and fast == reference) by registering.

Drafters here actually accept: each kind is briefly trained on the shipped trained zoo target
(`conftest.zoo_run`), and every test that exercises acceptance asserts that drafts were
accepted, so a refresh or carry bug cannot hide behind a drafter that never accepts.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder, _Active
from draftinfer.decoding.proposer import FirstPass
from draftinfer.decoding.reference import reference_generate
from draftinfer.decoding.sampling import SamplingParams
from draftinfer.files.checkpoint import load_drafter, write_drafter
from draftinfer.files.errors import CheckpointError
from draftinfer.files.loading import load_native_target
from draftinfer.files.paths import resolve_path
from draftinfer.registry import drafter_spec, load_kinds, registered_kinds
from drafttrain.registry import load_train_kinds, train_spec
from tests.support.kind_factories import servable, small_drafter, small_embeddings
from tests.support.prompts import zoo_prompts
from tests.support.round_logits import compare_round_logits, record_fast, record_reference

KINDS = registered_kinds()
MAX_LEN = 384


def test_both_registries_name_the_same_kinds():
    assert sorted(load_kinds()) == sorted(load_train_kinds()) == KINDS
    assert len(KINDS) >= 2


def _decoder(env, k, **kw):
    kw.setdefault("max_batch", 8)
    return SpecDecoder(env["target"], env["drafter"], k, max_model_len=MAX_LEN, **kw)


# ---- T1: greedy speculative output == plain greedy output ---------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3, 6, 7])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_t1_greedy_equals_plain_greedy(kind_env, kind, k, batch):
    env = kind_env(kind)
    if not servable(kind, env["drafter"].config, k):
        # A K the drafter cannot draft is refused before anything runs (its spec's check_k),
        # with one line; nothing is skipped.
        with pytest.raises(CheckpointError) as e:
            _decoder(env, k, max_batch=min(batch, 8))
        assert f"k={k}" in str(e.value) and "\n" not in str(e.value)
        return
    ps = zoo_prompts(batch, seed=k * 100 + batch)
    plain = greedy_generate(env["target"], ps, 16)
    outs = _decoder(env, k, max_batch=min(batch, 8)).generate(
        [Request(p, max_tokens=16) for p in ps]
    )[0]
    assert [o.token_ids for o in outs] == plain
    assert all(sum(o.proposed) > 0 for o in outs)
    assert sum(a for o in outs for a in o.accepted) > 0  # the drafter accepts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("verify, temperature", [("onehot", 0.0), ("onehot", 1.0), ("full", 1.0)])
def test_fast_path_equals_reference_loop(kind_env, kind, verify, temperature, monkeypatch):
    """Same tokens, accepted counts and proposals, and the same drafter logits in every round
    and step (not only the same emitted tokens); the reference loop leaves what it hands the
    drafter (views of the target's outputs) unchanged."""
    env = kind_env(kind)
    ps = zoo_prompts(3, seed=7)
    reqs = [
        Request(p, SamplingParams(temperature, top_k=50, top_p=0.9, seed=i), max_tokens=12)
        for i, p in enumerate(ps)
    ]
    dec = _decoder(env, 3, verify=verify, max_batch=len(reqs))
    fast_logits = record_fast(dec, monkeypatch)
    fast = dec.generate(reqs)[0]
    ref_calls = record_reference(drafter_spec(kind).proposer_class, monkeypatch)
    ref = reference_generate(env["target"], env["drafter"], reqs, 3, MAX_LEN, verify)
    for f, r in zip(fast, ref):
        assert f.token_ids == r.token_ids
        assert f.accepted == r.accepted and f.proposed == r.proposed
    assert compare_round_logits(fast_logits, ref_calls, fast) > 10
    assert all(c.unchanged for c in ref_calls)
    if temperature == 0.0:
        assert sum(a for o in fast for a in o.accepted) > 0


# ---- T5: greedy rows of a mixed greedy / sampling batch equal an all-greedy batch ---------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("verify", ["onehot", "full"])
def test_t5_mixed_greedy_and_sampling_batch(kind_env, kind, verify, monkeypatch):
    import draftinfer.decoding.verify as verify_module

    env = kind_env(kind)
    # Every distribution the round samples from or verifies against: neither NaN nor Inf.
    finite = []
    to_probs = verify_module.logits_to_probs

    def checked(*args, **kwargs):
        p = to_probs(*args, **kwargs)
        finite.append(bool(torch.isfinite(p).all()))
        return p

    monkeypatch.setattr(verify_module, "logits_to_probs", checked)
    k = max(k for k in (1, 2, 3, 4) if servable(kind, env["drafter"].config, k))
    ps = zoo_prompts(6, seed=4)
    greedy = [Request(p, max_tokens=12) for p in ps]
    params = [
        SamplingParams(1.0, seed=1),
        SamplingParams(0.8, top_k=20, seed=2),
        SamplingParams(1.0, top_p=0.9, seed=3),
    ]
    mixed = [r if i % 2 == 0 else replace(r, sampling=params[i // 2]) for i, r in enumerate(greedy)]
    g = _decoder(env, k, verify=verify).generate(greedy)[0]
    m = _decoder(env, k, verify=verify).generate(mixed)[0]
    assert [m[i].token_ids for i in range(0, 6, 2)] == [g[i].token_ids for i in range(0, 6, 2)]
    V = env["target"].info.vocab_size
    assert all(0 <= t < V for o in m for t in o.token_ids)
    assert finite and all(finite)
    assert sum(a for o in m for a in o.accepted) > 0


# ---- S1: first-pass pairing (t_{i+1}, f_i, pos_i) ------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_s1_first_pass_pairing(kind_env, kind, monkeypatch):
    env = kind_env(kind)
    dec = _decoder(env, 3, max_batch=2)
    admitted, proposed = [], []
    orig_admit, orig_propose = dec.proposer.admit, dec.proposer.propose

    def spy_admit(fp, *a, **kw):
        admitted.append((int(fp.rows[0]), fp))
        return orig_admit(fp, *a, **kw)

    def spy_propose(fp, *a, **kw):
        proposed.append(
            FirstPass(*(x.clone() if torch.is_tensor(x) else x for x in vars(fp).values()))
        )
        return orig_propose(fp, *a, **kw)

    monkeypatch.setattr(dec.proposer, "admit", spy_admit)
    monkeypatch.setattr(dec.proposer, "propose", spy_propose)
    p = zoo_prompts(1, seed=12)[0]
    out = dec.generate([Request(p, max_tokens=6)])[0][0]
    row, fp = admitted[0]
    P = len(p)
    assert torch.equal(fp.ids[0], torch.tensor(p[1:] + [out.token_ids[0]]))
    assert torch.equal(fp.cache_pos[0], torch.arange(P))
    assert torch.equal(fp.rope_pos[..., 0, :], torch.arange(P))
    # f_i = the target's features at token i of the prompt, computed independently.
    fresh = load_native_target(resolve_path("zoo:llama-tiny"), max_batch=1, max_seq_len=MAX_LEN)
    ref = fresh(
        torch.tensor([p]),
        Slots(torch.tensor([0]), torch.arange(P)[None]),
        env["drafter"].config.features,
    )
    torch.testing.assert_close(fp.features[0], ref.features[0], rtol=0, atol=0)
    # Round 2's first pass: exactly the a + 1 tokens round 1 committed, at cache indices
    # L-1.. (L = P + 1 after the first token), never the prompt again.
    a = out.accepted[0]
    fp2 = proposed[1]
    assert torch.equal(fp2.cache_pos[row, : a + 1], torch.arange(P, P + a + 1))
    assert bool((fp2.cache_pos[row, a + 1 :] == -1).all())
    assert torch.equal(fp2.ids[row, : a + 1], torch.tensor(out.token_ids[1 : a + 2]))
    assert torch.equal(fp2.rope_pos[..., row, : a + 1], torch.arange(P, P + a + 1))


# ---- S2: drafter state refreshed with target features ------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_s2_drafter_kv_refreshed_with_target_features(kind_env, kind, monkeypatch):
    """After rounds with accepted AND rejected drafts, the drafter state at committed cache
    indices equals a fresh prefill of the committed prefix with target features. The state is
    read right after each round's own `propose` (which first writes the rows the last commit
    made final), exactly as the engine calls it."""
    env = kind_env(kind)
    target, d = env["target"], env["drafter"]
    spec = drafter_spec(kind)
    k = next(k for k in (4, 3, 2, 1) if servable(kind, d.config, k))
    dec = _decoder(env, k, max_batch=1)
    p = zoo_prompts(1, seed=13)[0]
    slot = _Active(0, Request(p, SamplingParams(0.0, seed=0), max_tokens=60), 0, list(p))
    states = []
    propose = dec.proposer.propose

    def spy(fp, *a, **kw):
        out = propose(fp, *a, **kw)
        L = len(slot.tokens)  # committed before this round
        states.append((L, dec.proposer.kv_snapshot(0, L - 1)))
        return out

    monkeypatch.setattr(dec.proposer, "propose", spy)
    dec._admit([slot])
    for _ in range(8):
        dec._round([slot])
        if slot.finish:
            break
    accepted = sum(slot.accepted)
    rejected = sum(slot.proposed) - accepted
    assert accepted > 0 and rejected > 0
    for L, got in states[1:]:  # the first round's state: the prompt prefill only
        # Fresh: target features over the committed prefix, a new proposer, no history.
        tokens = slot.tokens[:L]
        out = target(
            torch.tensor([tokens[:-1]]),
            Slots(torch.tensor([1]), torch.arange(L - 1)[None]),
            d.config.features,
        )
        fresh = spec.proposer_class(d, 2, MAX_LEN, torch.device("cpu"), torch.float32)
        fp = FirstPass(
            torch.tensor([0]),
            torch.tensor([tokens[1:]]),
            out.features,
            torch.arange(L - 1)[None],
            out.rope_pos,
        )
        fresh.propose(fresh.admit(fp), torch.tensor([0]), 1)
        for x, y in zip(got, fresh.kv_snapshot(0, L - 1)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


# ---- S8: mode / weights consistency -------------------------------------------------------
@pytest.mark.parametrize("kind, other", [(a, b) for a in KINDS for b in KINDS if a != b])
def test_s8_checkpoint_of_one_kind_refused_as_another(kind, other, tmp_path):
    a, b = small_drafter(kind), small_drafter(other)
    emb = small_embeddings(a)
    write_drafter(tmp_path / "a", a, {"target": "t"}, dtype=torch.float32)
    write_drafter(tmp_path / "b", b, {"target": "t"}, dtype=torch.float32)
    load_drafter(tmp_path / "a", emb)  # each loads as itself
    # b's config.json with a's tensors: the weights say one mode, the config another.
    shutil.copyfile(tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_drafter(tmp_path / "b", emb)
    assert "\n" not in str(e.value)
    # And a's proposer refuses b's drafter (and vice versa): no silent mode switch.
    with pytest.raises(CheckpointError, match="cannot run in"):
        drafter_spec(kind).proposer_class(b, 1, 32, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_s8_architectures_must_be_the_kinds(kind, tmp_path):
    """`architectures` is what engines dispatch on (a drafter architecture, or for MTP the
    target family): a value the kind does not write is refused, naming it."""
    d = small_drafter(kind)
    write_drafter(tmp_path, d, {"target": "t"}, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["SomethingElse"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="SomethingElse") as e:
        load_drafter(tmp_path, small_embeddings(d))
    assert "\n" not in str(e.value)


# ---- S9: train/serve parity ---------------------------------------------------------------
def _mrope_positions(T: int) -> torch.Tensor:
    """[3, 1, T] positions whose three axes differ (an image grid in the middle)."""
    t = torch.arange(T)
    h = torch.where((t >= 3) & (t < 9), 3 + (t - 3) // 3, t)
    w = torch.where((t >= 3) & (t < 9), 3 + (t - 3) % 3, t)
    return torch.stack([torch.where((t >= 3) & (t < 9), 3, t), h, w])[:, None]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rope", ["1d", "mrope"])
@pytest.mark.parametrize("anchor", [0, 4, 9])
def test_s9_training_forward_equals_runner(kind, rope, anchor):
    """For the same weights and window, the trainer's logits for the k drafts after committed
    row `anchor` equal the runner's (first pass, then the k-th draft step), incl. M-RoPE."""
    T = 15
    d = small_drafter(kind, rope)
    k = next(k for k in (4, 3, 2, 1) if servable(kind, d.config, k))
    tspec = train_spec(kind)
    obj = tspec.objective(d, tspec.config_class(), "eager")
    torch.manual_seed(2)
    V = d.embed_tokens.weight.shape[0]
    ids = torch.randint(0, V, (1, T))
    feats = torch.randn(1, T, d.config.features.width(d.embed_tokens.weight.shape[1]))
    pos = _mrope_positions(T) if rope == "mrope" else torch.arange(T)[None]
    with torch.no_grad():
        train_logits = obj.anchor_logits(ids, feats, pos, anchor, k)
    # Runner: admit rows 0..anchor (t_{i+1}, f_i, pos_i), then one round of k drafts, fed
    # the teacher-forced tokens (identity draft vocabulary) so both sides see one window.
    prop = drafter_spec(kind).proposer_class(d, 2, 64, torch.device("cpu"), torch.float32)
    n = anchor + 1
    fp = FirstPass(
        torch.tensor([1]), ids[:, 1 : n + 1], feats[:, :n], torch.arange(n)[None], pos[..., :n]
    )
    pending = prop.admit(fp)
    seen = []

    def teacher(logits, step):
        seen.append(logits.clone())
        return ids[:, anchor + 2 + step], None

    prop.propose(pending, torch.tensor([k]), k, teacher)
    torch.testing.assert_close(torch.cat(seen), train_logits, rtol=1e-5, atol=1e-5)
