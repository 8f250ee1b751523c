"""LiLiCorr as an option of the block drafter (`drafter.lilicorr`): the correlator's transition
scores and the lattice walk computed by hand, the lattice loss against its formula, the
identity start (an untrained correlator drafts plain DFlash's argmax), the config's round trip
and refusals. The S9 parity, the rounds-vs-reference, export and training tests run it through
`tests/support/dflash.py::VARIANTS` (`lilicorr`, `lilicorr_conv`); its sampled q through
`tests/kinds/test_dflash_sampling.py`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftinfer.files.errors import ConfigError
from draftinfer.kinds.dflash.config import DFlashConfig
from draftinfer.kinds.dflash.module import LatticeCorrelator, draft_logits, lattice_logits
from draftinfer.kinds.dflash.proposer import choose_block
from drafttrain.registry import train_spec
from tests.support.dflash import VARIANTS, runner_logits, variant_drafter

# Token embeddings of a 4-token vocabulary in 2-D: 0 -> (0, 0), 1 -> (1, 0), 2 -> (0, 1), 3 -> (1, 1).
EMB = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])


def _config(**kw) -> DFlashConfig:
    base = dict(
        hidden_size=2,
        intermediate_size=4,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=2,
        vocab_size=4,
        num_target_layers=4,
        tap_layer_ids=[1],
        num_hidden_layers=1,
        block_size=3,
        lilicorr_top_k=2,
        lilicorr_rank=2,
        lilicorr_heads=1,
    )
    return DFlashConfig(**{**base, **kw})


@torch.no_grad()
def _hand_drafter():
    """A stand-in drafter whose 'normed hidden' is already the head's logits, with a
    correlator whose token projection, W_u and W_v are the identity: node(s, c) = z_s + E[c],
    transition(a -> b) = <z_prev + E[a], z_cur + E[b]>."""
    corr = LatticeCorrelator(_config())
    for lin in (corr.token_projection, corr.predecessor, corr.successor):
        lin.weight.copy_(torch.eye(2))
    embed = nn.Embedding(4, 2)
    embed.weight.copy_(EMB)
    return SimpleNamespace(
        lattice_correlator=corr,
        embed_tokens=embed,
        logits=lambda h: h,
        markov_head=None,
        candidate_selector=None,
    )


def test_transition_scores_by_hand():
    d = _hand_drafter()
    corr = d.lattice_correlator
    z_prev, z_cur = torch.tensor([0.5, 0.0]), torch.tensor([0.0, -1.0])
    # u(a) = z_prev + E[a]; v(b) = z_cur + E[b]; every pair in one matmul.
    got = corr.transition_scores(z_prev, EMB[[1, 3]], z_cur, EMB[[0, 2, 3]])
    # u(1) = (1.5, 0), u(3) = (1.5, 1); v(0) = (0, -1), v(2) = (0, 0), v(3) = (1, 0).
    want = torch.tensor([[0.0, 0.0, 1.5], [-1.0, 0.0, 1.5]])
    torch.testing.assert_close(got, want)
    # One predecessor: the head's logit of each candidate plus its transition.
    s = corr.scores(
        d.embed_tokens,
        z_prev,
        z_cur,
        torch.tensor(3),
        torch.tensor([0.25, 2.0]),
        torch.tensor([2, 3]),
    )
    torch.testing.assert_close(s, torch.tensor([0.25 + 0.0, 2.0 + 1.5]))


def test_lattice_logits_are_minus_inf_off_the_top_k():
    d = _hand_drafter()
    z = torch.zeros(2)
    logits = torch.tensor([0.0, 1.0, 1.2, -5.0])  # top-2: tokens 2 then 1
    out = lattice_logits(d, (z, z), torch.tensor(3), logits)
    # from anchor 3 = (1, 1): token 2 scores 1.2 + 1, token 1 scores 1.0 + 1; 0 and 3 are off.
    want = torch.tensor([float("-inf"), 2.0, 2.2, float("-inf")])
    assert torch.equal(out, want)


def test_greedy_walk_follows_the_lattice_not_the_per_slot_argmax():
    """Two drafts after anchor 3, zero slot contexts: slot 1's top-2 are {2: 1.2, 1: 1.0} ->
    2 + 1 and 1 + 1: draft 2. Slot 2's are {1: 1.5, 2: 1.0}; after 2 = (0, 1), token 1 scores
    1.5 + 0 and token 2 scores 1.0 + 1: draft 2, where the per-slot argmax drafts 1."""
    d = _hand_drafter()
    normed = torch.tensor([[[0.0, 1.0, 1.2, -5.0], [0.0, 1.5, 1.0, -5.0]]])  # [1, 2, V]
    z = torch.zeros(1, 3, 2)  # anchor slot + two drafting slots
    path, seen = [], []

    def pick(step, logits):
        seen.append(logits)
        path.append(int(logits.argmax(-1)))
        return logits.argmax(-1)

    choose_block(d, normed, torch.tensor([3]), pick, z)
    assert path == [2, 2] and normed.argmax(-1).tolist() == [[2, 1]]
    torch.testing.assert_close(seen[1][0, [1, 2]], torch.tensor([1.5, 2.0]))


def test_sampled_q_is_a_softmax_over_the_k_candidates():
    """T > 0: q = softmax(scores / T) over the slot's candidates, zero elsewhere (what the
    proposer's rejection sampling reads, as for DFlash2's selector)."""
    d = _hand_drafter()
    z = torch.zeros(2)
    out = lattice_logits(d, (z, z), torch.tensor(3), torch.tensor([0.0, 1.0, 1.2, -5.0]))
    q = torch.softmax(out / 0.5, -1)
    e = torch.exp(torch.tensor([2.0, 2.2]) / 0.5)
    torch.testing.assert_close(q, torch.tensor([0.0, e[0] / e.sum(), e[1] / e.sum(), 0.0]))


def test_lattice_loss_by_formula():
    """K-way cross-entropy over the draft's top-K, the target's top-1 inserted last when
    missing, each candidate scored from the ground-truth predecessor x_{a+k-1} with the rows'
    slot contexts: U(b) + <W_u (z_prev + P E[pred]), W_v (z_cur + P E[b])>, written out."""
    d = variant_drafter("lilicorr")
    spec = train_spec("dflash")
    obj = spec.objective(d, spec.config_class(), "eager")
    corr, V = d.lattice_correlator, d.config.vocab_size
    g = torch.Generator().manual_seed(1)
    hf = torch.randn(3, d.config.hidden_size, generator=g)
    r = corr.slot_projection.weight.shape[0]
    z_prev, z_cur = torch.randn(3, r, generator=g), torch.randn(3, r, generator=g)
    logits = d.logits(hf)
    cand = logits.topk(6, -1).indices
    top1 = torch.tensor([int(cand[0, 2]), int(logits[1].argsort()[0]), int(cand[2, 0])])
    ids = torch.randint(0, V, (1, 5), generator=g)
    labc = torch.tensor([[[1, 2, 3]]])  # predecessors ids[0, 0..2]
    loss, hit = obj._selector_loss(hf, ids, labc, torch.arange(3), top1, cand, (z_prev, z_cur))
    want_cand = cand.clone()
    want_cand[1, -1] = top1[1]  # row 1's gold was no candidate: it replaces the last one
    E, P = d.embed_tokens.weight, corr.token_projection.weight
    Wu, Wv = corr.predecessor.weight, corr.successor.weight
    u = (z_prev + E[ids[0, :3]] @ P.T) @ Wu.T  # [3, r]
    v = (z_cur[:, None] + E[want_cand] @ P.T) @ Wv.T  # [3, 6, r]
    scores = logits.gather(1, want_cand) + (u[:, None] * v).sum(-1)
    target = torch.tensor([2, 5, 0])
    torch.testing.assert_close(loss, F.cross_entropy(scores, target, reduction="none"))
    assert torch.equal(hit, scores.argmax(-1) == target)


def test_lattice_loss_trains_the_correlator_and_the_backbone():
    from tests.support.dflash import batch_and_target

    d = variant_drafter("lilicorr_conv").train()
    spec = train_spec("dflash")
    obj = spec.objective(d, spec.config_class(lilicorr=True, num_anchors=3), "eager")
    batch, tgt = batch_and_target(d, T=20)
    torch.manual_seed(0)
    loss, m = obj(batch, tgt)
    loss.backward()
    assert float(m["lattice_loss"]) > 0
    grads = {n for n, p in d.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    for name in (
        "lattice_correlator.successor.weight",
        "lattice_correlator.layers.1.qkv.weight",
        "lattice_correlator.slot_embedding",
        "layers.0.attention_conv.base_kernel",
        "fc.weight",
    ):
        assert name in grads, name


@pytest.mark.parametrize("variant", ["lilicorr", "lilicorr_conv"])
def test_an_untrained_correlator_drafts_plain_dflash(variant):
    """W_v starts at zero: the lattice scores are the head's logits on the top-k, so the greedy
    walk drafts the per-slot argmax (K2 for this option)."""
    d = variant_drafter(variant)
    with torch.no_grad():
        d.lattice_correlator.successor.weight.zero_()
    g = torch.Generator().manual_seed(2)
    V = d.config.vocab_size
    ids = torch.randint(0, V, (1, 15), generator=g)
    feats = torch.randn(1, 15, d.config.features.width(d.config.hidden_size), generator=g)
    pos = torch.arange(15)[None]
    got = runner_logits(d, ids, feats, pos, 6, 3)
    plain = d.logits
    spec = train_spec("dflash")
    h = spec.objective(d, spec.config_class(), "eager")._anchors_hidden(ids, feats, pos, [6], 3)
    assert torch.equal(got.argmax(-1), plain(h[0]).argmax(-1))


def test_config_round_trip_and_refusals():
    c = _config(conv_kernel_size=2, conv_group_size=2)
    hf = c.to_hf()
    assert hf["architectures"] == ["LiLiCorrDraftModel"]
    dc = hf["dflash_config"]
    assert dc["projector_type"] == "lilicorr" and dc["lilicorr_top_k"] == 2
    assert dc["conv_kernel_size"] == 2 and "selector_top_k" not in dc
    assert DFlashConfig.from_hf(hf) == c
    with pytest.raises(ConfigError, match="LiLiCorr"):
        _config(selector_top_k=2)
    with pytest.raises(ConfigError, match="LiLiCorr"):
        _config(sample_from_anchor=True)
    from drafttrain.jobs.errors import ConfigError as TrainConfigError

    with pytest.raises(TrainConfigError, match="lilicorr"):
        train_spec("dflash").config_class(lilicorr=True, dflash2=True).check()


def test_draft_logits_of_the_lattice_need_the_slot_contexts():
    """The lattice scores a slot from its own and its predecessor slot's contexts: draft_logits
    with other contexts gives other scores (the contexts are read, not ignored)."""
    d = variant_drafter("lilicorr")
    h = torch.randn(2, d.config.hidden_size)
    prev = torch.tensor([3, 4])
    r = d.config.lilicorr_rank
    a = draft_logits(d, h, prev, (torch.zeros(2, r), torch.zeros(2, r)))
    b = draft_logits(d, h, prev, (torch.ones(2, r), torch.zeros(2, r)))
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    assert (a[torch.isfinite(a)] - b[torch.isfinite(b)]).abs().max() > 1e-3
    assert set(VARIANTS) >= {"lilicorr", "lilicorr_conv"}


def test_model_card_says_no_engine_serves_it():
    from draftinfer.registry import drafter_spec

    d = variant_drafter("lilicorr_conv")
    hint = drafter_spec("dflash").serving_hint(d.config, 3, "tgt", "drf")
    assert hint.startswith("No merged serving engine loads LiLiCorr yet")
    assert "python -m draftinfer drafter=drf k=3" in hint and "vllm serve" not in hint
    assert "sglang#37462" not in hint and "SGLang (#37462)" in hint
    plain = drafter_spec("dflash").serving_hint(variant_drafter("dflash2").config, 3, "t", "d")
    assert "vllm serve t" in plain and "LiLiCorr" not in plain
