"""K2 and the runner of every option of the block-drafter kind.

- DFlash2 with identity-initialised conv and selector drafts exactly what plain DFlash drafts
  (same hidden states bit for bit, same drafts); the causal option (JetSpec) changes the block
  mask and nothing else.
- Train/serve parity (S9) for every option, incl. M-RoPE positions.
- The engine's rounds, with drafts partly accepted and partly rejected, give every option the
  logits a from-scratch reference computes over the committed prefix (the KV refresh: context
  from target features only, stale block entries never seen), also when `max_model_len` caps
  the block: its slots never reach `max_model_len` (capped, never wrapped).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.proposer import FirstPass
from draftinfer.files.loading import load_native_target
from draftinfer.kinds.dflash import DFlashDrafter, DFlashProposer
from draftinfer.kinds.dflash.attention import CONTEXT, mask_flags, visible
from draftinfer.kinds.dflash.proposer import dflash_block_forward, dflash_write_context
from draftinfer.registry import drafter_spec
from drafttrain.registry import train_spec
from tests.support.dflash import VARIANTS, randomize_heads, runner_logits, variant_drafter
from tests.support.kind_factories import drafter_for


def _inputs(d, T=15, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, d.config.vocab_size, (1, T), generator=g)
    feats = torch.randn(1, T, d.config.features.width(d.config.hidden_size), generator=g)
    return ids, feats


def _with_arch(d, **changes) -> DFlashDrafter:
    """A fresh drafter of `d`'s architecture with `changes` (new modules at their init), every
    tensor the two share copied from `d`."""
    new = DFlashDrafter(dataclasses.replace(d.config, **changes))
    missing, unexpected = new.load_state_dict(d.state_dict(), strict=False)
    assert not unexpected and all("_conv." in n or "candidate_selector." in n for n in missing)
    return new.eval()


def test_dflash2_identity_init_drafts_exactly_plain_dflash():
    plain = variant_drafter("dflash")
    d2 = _with_arch(plain, conv_kernel_size=2, conv_group_size=8, selector_top_k=6, selector_rank=5)
    assert d2.config.architecture == "DFlash2DraftModel" and d2.candidate_selector is not None
    ids, feats = _inputs(plain)
    pos = torch.arange(15)[None]
    for anchor in (0, 5, 9):
        got, want = [], []
        for d, out in ((plain, want), (d2, got)):
            prop = DFlashProposer(d, 2, 64, torch.device("cpu"), torch.float32)
            n = anchor + 1
            fp = FirstPass(
                torch.tensor([0]),
                ids[:, 1 : n + 1],
                feats[:, :n],
                torch.arange(n)[None],
                pos[..., :n],
            )
            # The block's hidden states (conv identity: bit for bit) and the greedy drafts.
            normed = []
            orig = prop._block

            def spy(*a, _orig=orig, _normed=normed, **kw):
                _normed.append(_orig(*a, **kw))
                return _normed[-1]

            prop._block = spy
            drafts, _ = prop.propose(prop.admit(fp), torch.tensor([4]), 4)
            out.append((normed[0], drafts))
        assert torch.equal(got[0][0], want[0][0])
        assert torch.equal(got[0][1], want[0][1])


def test_causal_option_changes_the_mask_and_nothing_else():
    plain = variant_drafter("dflash")
    causal = _with_arch(plain, causal_block=True)
    assert causal.trainable_state_dict().keys() == plain.trainable_state_dict().keys()
    hp, hc = plain.config.to_hf(), causal.config.to_hf()
    assert hc.pop("dflash_config").pop("causal") is True
    hp_dc = hp.pop("dflash_config")
    assert hc == hp and "causal" not in hp_dc
    # The predicate: the masks differ exactly on same-block keys after the query.
    q = torch.arange(6, 10)[:, None]  # the 4 slots of the block anchored at 6
    k = torch.arange(10)[None]  # 6 context rows, then the block
    k_anchor = torch.where(k < 6, CONTEXT, 6)
    m0, m1 = visible(q, 6, k, k_anchor, False, None), visible(q, 6, k, k_anchor, True, None)
    assert bool(m0.all())  # bidirectional: every slot sees the context and the whole block
    assert torch.equal(m0 & ~m1, (k >= 6) & (k > q))
    # The model: the causal drafter = the plain drafter's code under the causal mask. Its last
    # slot sees the whole block either way; earlier slots differ.
    ids, feats = _inputs(plain)
    pos = torch.arange(15)[None]
    lc = runner_logits(causal, ids, feats, pos, 6, 4)
    lp = runner_logits(plain, ids, feats, pos, 6, 4)
    torch.testing.assert_close(lc[-1], lp[-1], rtol=1e-5, atol=1e-5)
    assert (lc[0] - lp[0]).abs().max() > 1e-3
    spec = train_spec("dflash")
    obj = spec.objective(causal, spec.config_class(), "eager")
    torch.testing.assert_close(obj.anchor_logits(ids, feats, pos, 6, 4), lc, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 3), (True, 2)])
def test_mask_predicate_takes_tensor_flags_as_python_flags(causal, window):
    """The flex mask_mod passes (causal, window) as 0-d tensors (`mask_flags`; a compiled
    create_block_mask specialised on the Python values); the predicate is the same."""
    q = torch.arange(6, 10)[:, None]
    k = torch.arange(10)[None]
    k_anchor = torch.where(k < 6, CONTEXT, 6)
    want = visible(q, 6, k, k_anchor, causal, window)
    got = visible(q, 6, k, k_anchor, *mask_flags(causal, window, "cpu"))
    assert torch.equal(got, want.expand_as(got))  # (Python flags may broadcast narrower)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("rope", ["1d", "mrope"])
def test_s9_parity_for_every_option(variant, rope):
    d = variant_drafter(variant, rope)
    spec = train_spec("dflash")
    obj = spec.objective(d, spec.config_class(), "eager")
    ids, feats = _inputs(d)
    T = 15
    t = torch.arange(T)
    pos = (
        torch.stack([torch.where((t >= 3) & (t < 9), 3, t), t + 1, t + 2])[:, None]
        if rope == "mrope"
        else t[None]
    )
    # LiLiCorr's correlator (two transformer layers and RMSNorms of width 8 over the block's
    # hidden) carries the fp32 reduction-order noise of the block hidden (the runner's cached
    # attention, training's dense one) into its scores at a few 1e-6 relative: its candidates
    # (the finite entries) must match exactly, their scores to 2e-5.
    tol = {"rtol": 2e-5, "atol": 2e-5} if variant.startswith("lilicorr") else {}
    for anchor in (0, 4, 9):
        with torch.no_grad():
            want = obj.anchor_logits(ids, feats, pos, anchor, 4)
        got = runner_logits(d, ids, feats, pos, anchor, 4)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("max_model_len", [64, 30])
def test_rounds_equal_a_from_scratch_reference(
    tiny_llama3_dir, variant, max_model_len, monkeypatch
):
    """Greedy requests whose first two drafts per round are the target's own tokens (forced by
    the chooser, so rounds accept some drafts and reject the rest); every round's draft logits
    equal the no-cache reference over the committed prefix. With max_model_len 30 the last
    rounds' blocks are capped: no slot reaches index 30 and the outputs end exactly there."""
    target = load_native_target(tiny_llama3_dir, max_batch=4, max_seq_len=64)
    d = randomize_heads(drafter_for("dflash", str(tiny_llama3_dir), **VARIANTS[variant]))
    drafter_spec("dflash").attach_shared(d, target.shared_weights())
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 14, 5)]
    k, new = 6, 40
    plain = greedy_generate(target, prompts, new)
    seqs = torch.zeros(3, 128, dtype=torch.long)
    for b, (p, o) in enumerate(zip(prompts, plain)):
        seqs[b, : len(p) + len(o)] = torch.tensor(p + o)
    dec = SpecDecoder(target, d, k, max_batch=3, max_model_len=max_model_len)
    rounds = []

    def draft_chooser(t, L):
        def choose(logits, step):
            greedy = logits.argmax(-1)
            forced = seqs[torch.arange(3), (L + step).clamp(max=127)]
            return torch.where(torch.tensor(step < 2), forced, greedy), None

        return choose

    monkeypatch.setattr(dec.verifier, "draft_chooser", draft_chooser)
    blocks = []
    orig_block = dec.proposer._block

    def spy_block(drafter, kc, vc, ids, rope, rows, cache, *rest):
        blocks.append(cache.clone())
        return orig_block(drafter, kc, vc, ids, rope, rows, cache, *rest)

    dec.proposer._block = spy_block
    propose = dec.proposer.propose

    def spy(fp, num_drafts, kk, choose, attn_len=None):
        seen = []

        def rec(logits, step):
            seen.append(logits.clone())
            return choose(logits, step)

        drafts, q = propose(fp, num_drafts, kk, rec, attn_len)
        rounds.append((fp.cache_pos.clone(), num_drafts.clone(), drafts.clone(), seen))
        return drafts, q

    monkeypatch.setattr(dec.proposer, "propose", spy)
    outs, _ = dec.generate([Request(p, max_tokens=new) for p in prompts])
    for p, o, want in zip(prompts, outs, plain):
        n = min(new, max_model_len - len(p))
        assert o.token_ids == want[:n]
    assert sum(a for o in outs for a in o.accepted) > 0
    assert any(0 < a < pr for o in outs for a, pr in zip(o.accepted, o.proposed))
    assert max(int(c.max()) for c in blocks) <= max_model_len - 1
    if max_model_len == 30:
        assert any(int(nd.min()) < k for _, nd, _, _ in rounds)  # some blocks were capped
    # Every round of every row against the no-cache reference on the committed prefix.
    checked = 0
    for cache_pos, num_drafts, drafts, seen in rounds:
        for b in range(3):
            live = cache_pos[b] >= 0
            n = int(num_drafts[b])
            if not bool(live.any()) or n == 0:
                continue
            L = int(cache_pos[b][live].max()) + 2  # committed tokens
            tokens = (prompts[b] + outs[b].token_ids)[:L]
            feats = target(
                torch.tensor([tokens[:-1]]),
                Slots(torch.tensor([3]), torch.arange(L - 1)[None]),
                d.config.features,
            ).features[0]
            replay = iter(drafts[b, :n].tolist())

            def choose_ref(logits, step, _b=b, _seen=seen, _replay=replay):
                torch.testing.assert_close(logits[0], _seen[step][_b], rtol=1e-4, atol=1e-4)
                return torch.tensor([next(_replay)]), None

            ref_drafts, _ = DFlashProposer.reference_drafts(
                d, torch.tensor(tokens[1:]), feats, torch.arange(L - 1), n, choose_ref
            )
            assert ref_drafts == drafts[b, :n].tolist()
            checked += 1
    assert checked > 10


@pytest.mark.parametrize("rope", ["1d", "mrope"])
def test_compiled_glue_drafts_and_writes_what_the_eager_proposer_does(rope):
    """`compile()` runs the round's glue as compiled pieces: the block's inputs from the first
    pass (`dflash_block_inputs`: anchor, slots' cache indices and positions, caps) and the
    greedy choice (`Proposer.compile`'s `greedy_record`). Traced by dynamo with the engine's
    options (dynamic shapes, `aot_eager`: no compiler needed; fullgraph, the recompile limit an
    error), rounds of two requests (one capped, then idle; first passes of 1..3 rows) draft the
    same tokens and leave the same KV as the eager proposer. The block forward stays eager
    (tracing the drafter costs seconds; the GPU tests compile it)."""
    d = variant_drafter("dflash", rope)
    ids, feats = _inputs(d, T=24)
    pos = torch.arange(24)[None].expand(2, 24)
    if rope == "mrope":
        pos = torch.stack([pos, pos + 1, pos + 2])
    feats = feats.expand(2, -1, -1)
    # (first-pass rows start..stop of both requests, each request's draft cap)
    plan = [(0, 9, [0, 0]), (8, 9, [4, 2]), (9, 11, [4, 4]), (11, 14, [3, 0]), (14, 15, [4, 1])]
    runs = []
    torch._dynamo.reset()
    for compile_it in (False, True):
        prop = DFlashProposer(d, 2, 64, torch.device("cpu"), torch.float32)
        if compile_it:
            prop.compile(backend="aot_eager", dynamic=True, fullgraph=True)
            prop._write, prop._block = dflash_write_context, dflash_block_forward
        drafts = []
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for i, (a, b, caps) in enumerate(plan):
                cache = torch.arange(a, b)[None].expand(2, -1).clone()
                if i == len(plan) - 1:
                    cache[1] = -1  # the second request left: an idle row
                fp = FirstPass(
                    torch.tensor([0, 1]),
                    ids[:, a + 1 : b + 1].expand(2, -1),
                    feats[:, a:b],
                    cache,
                    pos[..., a:b],
                )
                if i == 0:
                    prop.admit(fp, 64)
                    continue
                drafts.append(prop.propose(fp, torch.tensor(caps), 4, attn_len=64)[0])
        runs.append((drafts, [x.clone() for x in (*prop.cache.k, *prop.cache.v)]))
    (drafts, kv), (drafts_c, kv_c) = runs
    assert [x.tolist() for x in drafts_c] == [x.tolist() for x in drafts]
    assert any(x[1, 2:].eq(0).all() and x[1, :2].ne(0).any() for x in drafts)  # a capped block
    for x, y in zip(kv, kv_c):
        assert torch.equal(x, y)


# ---- GPU (run by the integrator; skipped without CUDA) ---------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dflash2", "sliding", "causal", "lilicorr_conv"])
def test_every_option_rounds_without_host_sync_and_replay_from_graphs(tiny_llama3_dir, variant):
    """Every option's round (the selector's top-k walk and sampled q included) makes no host
    sync, compiled; rounds replayed from CUDA graphs emit what the eager rounds emit."""
    from draftinfer.decoding.sampling import SamplingParams
    from tests.support.prompts import random_prompts

    target = load_native_target(
        tiny_llama3_dir, "cuda", torch.float32, max_batch=4, max_seq_len=256
    )
    d = drafter_for("dflash", str(tiny_llama3_dir), **VARIANTS[variant])
    drafter_spec("dflash").attach_shared(d, target.shared_weights())
    d = d.to("cuda")
    ps = random_prompts(4, seed=33)
    reqs = [
        Request(ps[0], max_tokens=24),
        Request(ps[1], SamplingParams(1.0, seed=1), max_tokens=20),
        Request(ps[2], SamplingParams(0.8, top_k=20, seed=2), max_tokens=16),
        Request(ps[3], max_tokens=12),
    ]
    dec = SpecDecoder(target, d, 4, max_batch=4, max_model_len=256, compile=True, verify="full")
    dec.generate([Request(p, max_tokens=6) for p in ps])  # warm-up: compiles (may sync)
    dec.sync_check = True
    eager = dec.generate(reqs)[0]
    graphed = SpecDecoder(
        target, d, 4, max_batch=4, max_model_len=256, compile="all", verify="full", cuda_graphs=True
    )
    graphed.generate(reqs)  # first use of each bucket captures
    again = graphed.generate(reqs)[0]
    assert graphed._graphed.replays > 0
    assert [o.token_ids for o in again] == [o.token_ids for o in eager]
    assert [o.accepted for o in again] == [o.accepted for o in eager]
