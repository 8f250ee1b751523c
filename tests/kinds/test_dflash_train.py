"""The block-drafter objective: per-slot weights (exp-decay, D-PACE against a hand computation),
anchors drawn from assistant tokens, labels and their target rows checked against an
independent computation, the forward KL, the selector's gold insertion, flex == eager on the
CPU, the per-row fused loss against its plain formula, activation checkpointing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from drafttrain.kinds.dflash import objective as dflash_objective
from drafttrain.kinds.dflash.objective import sample_anchors
from drafttrain.objectives.fused_ce import linear_soft_ce_rows, linear_soft_ce_rows_ref
from drafttrain.objectives.loss_weights import dpace_weights, exp_decay_weights
from drafttrain.registry import train_spec
from tests.support.dflash import VARIANTS, batch_and_target, variant_drafter


def test_exp_decay_weights():
    w = exp_decay_weights(15, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    torch.testing.assert_close(w[:3], torch.tensor([1.0, math.exp(-1 / 7), math.exp(-2 / 7)]))


def test_dpace_weights_against_a_hand_computation():
    prob = torch.tensor([[0.8, 0.5, 0.2, 0.9]])
    valid = torch.tensor([[True, True, False, True]])
    # s = (1 - a) p + a with a = 0.5, 1 where invalid: 0.9, 0.75, 1, 0.95
    # P = 0.9, 0.675, 0.675, 0.64125; P * m = 0.9, 0.675, 0, 0.64125
    # w_k = sum_{j >= k} P_j m_j = 2.21625, 1.31625, 0.64125, 0.64125
    torch.testing.assert_close(
        dpace_weights(prob, valid, 0.5), torch.tensor([[2.21625, 1.31625, 0.64125, 0.64125]])
    )
    torch.testing.assert_close(
        dpace_weights(prob, valid, 0.5, "cumulative"), torch.tensor([[0.9, 0.675, 0.675, 0.64125]])
    )
    torch.testing.assert_close(
        dpace_weights(prob, valid, 0.5, "continuation"),
        torch.tensor([[2.21625 / 0.9, 1.31625 / 0.675, 0.64125 / 0.675, 1.0]]),
    )
    # alpha = 1: every position survives with certainty, w_k = valid positions from k on.
    torch.testing.assert_close(
        dpace_weights(prob, valid, 1.0), torch.tensor([[3.0, 2.0, 1.0, 1.0]])
    )


def test_anchors_come_from_assistant_tokens_capped_and_sorted():
    cand = torch.zeros(3, 40, dtype=torch.bool)
    cand[0, 10:30] = True
    cand[1, [3, 7]] = True
    torch.manual_seed(0)
    a = sample_anchors(cand, 8)
    assert a.shape == (3, 8)
    row0 = a[0]
    assert bool(cand[0, row0].all()) and torch.equal(row0, row0.sort().values)
    assert len(set(row0.tolist())) == 8
    assert a[1, :2].tolist() == [3, 7] and bool((a[1, 2:] == -1).all())
    assert bool((a[2] == -1).all())


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_slot_k_is_scored_against_the_target_row_that_predicts_x_a_plus_k(loss, monkeypatch):
    """Anchor a = 6 of a 14-token sequence, block 16: slots 1..7 have labels x_7..x_13 inside
    the sequence (scored against the target rows 6..12), slots 8..15 none. Each slot's logged
    loss equals the soft cross-entropy (or KL) of the S9 logits against that row, computed
    here independently."""
    d = variant_drafter("dflash")
    spec = train_spec("dflash")
    cfg = spec.config_class(loss=loss, kd_temperature=1.0)
    obj = spec.objective(d, cfg, "eager")
    batch, tgt = batch_and_target(d)
    a = 6
    monkeypatch.setattr(dflash_objective, "sample_anchors", lambda c, n: torch.tensor([[a]]))
    with torch.no_grad():
        _, m = obj(batch, tgt)
        # The logits of slots 1..15 of anchor a (committed row a - 1), as in S9.
        drafted = obj.anchor_logits(batch["input_ids"], tgt.features, tgt.rope_pos, a - 1, 15)
    p = torch.softmax(tgt.logits[0], -1)
    for k in range(1, 16):
        if a + k >= 14:
            assert m[f"loss_{k}"] == 0.0 and f"acc_{k}" in m
            continue
        row = a + k - 1
        ce = -(p[row] * F.log_softmax(drafted[k - 1], -1)).sum()
        want = ce - torch.special.entr(p[row]).sum() if loss == "kl" else ce
        torch.testing.assert_close(m[f"loss_{k}"].float(), want, rtol=1e-4, atol=1e-4)
        hit = drafted[k - 1].argmax() == p[row].argmax()
        assert float(m[f"acc_{k}"]) == float(hit)


def test_selector_loss_inserts_the_target_top1_when_missing():
    d = variant_drafter("dflash2")
    spec = train_spec("dflash")
    obj = spec.objective(d, spec.config_class(dflash2=True), "eager")
    H, V = d.config.hidden_size, d.config.vocab_size
    hf = torch.randn(3, H)
    logits = d.logits(hf)
    cand = logits.topk(6, -1).indices
    top1 = torch.tensor([int(cand[0, 2]), int(logits[1].argsort()[0]), int(cand[2, 0])])
    ids = torch.randint(0, V, (1, 5))
    labc = torch.tensor([[[1, 2, 3]]])  # predecessors ids[0, 0..2]
    sce, hit = obj._selector_loss(hf, ids, labc, torch.arange(3), top1, cand)
    # Row 1's gold was not a candidate: it replaced the last one and is the target index.
    sel = d.candidate_selector
    want_cand = cand.clone()
    want_cand[1, -1] = top1[1]
    unary = logits.gather(1, want_cand)
    scores = sel.scores(sel.hidden_projection(hf), ids[0, :3], unary, want_cand)
    target = torch.tensor([2, 5, 0])
    torch.testing.assert_close(sce, F.cross_entropy(scores, target, reduction="none"))
    assert torch.equal(hit, scores.argmax(-1) == target)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("rope", ["1d", "mrope"])
def test_flex_forward_equals_eager_on_cpu(variant, rope):
    d = variant_drafter(variant, rope)
    spec = train_spec("dflash")
    B, T, n = 2, 40, 16
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, d.config.vocab_size, (B, T), generator=g)
    feats = torch.randn(B, T, d.config.features.width(d.config.hidden_size), generator=g)
    pos = torch.arange(T)[None].expand(B, T)
    if rope == "mrope":
        pos = torch.stack([pos, pos + 2, pos + 5])
    anchors = torch.tensor([[3, 11, 20, 30], [5, 17, -1, -1]])
    out = {}
    for backend in ("eager", "flex"):
        obj = spec.objective(d, spec.config_class(), backend)
        with torch.no_grad():
            out[backend] = obj.forward_blocks(ids, feats, pos, anchors, n)
    valid = anchors >= 0
    torch.testing.assert_close(out["flex"][valid], out["eager"][valid], rtol=1e-5, atol=1e-5)


def test_per_row_fused_loss_equals_plain_formula_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    N, H, V, M = 37, 16, 53, 41
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g) / 3
    probs = torch.softmax(torch.randn(M, V, generator=g), -1)
    rows = torch.randint(0, M, (N,), generator=g)
    top1 = probs.argmax(-1)
    weights = torch.rand(N, generator=g)
    got = linear_soft_ce_rows(h, w, probs, rows, top1, topk=4, chunk_elements=7 * V)
    want = linear_soft_ce_rows_ref(h, w, probs, rows, top1, topk=4)
    torch.testing.assert_close(got.ce, want.ce)
    torch.testing.assert_close(got.logp_top1, want.logp_top1)
    assert torch.equal(got.hit, want.hit) and torch.equal(got.cand, want.cand)
    (ga,) = torch.autograd.grad((got.ce * weights).sum(), h)
    (gb,) = torch.autograd.grad((want.ce * weights).sum(), h)
    torch.testing.assert_close(ga, gb)
    with pytest.raises(ValueError, match="frozen head"):
        linear_soft_ce_rows(h, w.requires_grad_(), probs, rows, top1, chunk_elements=7 * V)


@pytest.mark.parametrize("weights", ["exp_decay", "dpace", "uniform"])
def test_activation_checkpointing_keeps_loss_and_grads(weights):
    from drafttrain.trainer.wrap import apply_activation_checkpointing

    spec = train_spec("dflash")
    cfg = spec.config_class(loss_weights=weights, dflash2=True, num_anchors=3)
    results = []
    for ckpt in (False, True):
        d = variant_drafter("dflash2").train()
        if ckpt:
            apply_activation_checkpointing(spec.blocks(d))
        obj = spec.objective(d, cfg, "eager")
        batch, tgt = batch_and_target(d, T=24)
        torch.manual_seed(5)
        loss, m = obj(batch, tgt)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, m))
    (l0, g0, m0), (l1, g1, _) = results
    assert float(m0["anchors"]) == 3 and l0 > 0
    torch.testing.assert_close(l1, l0)
    assert (
        set(g0) == set(g1) and "fc.weight" in g0 and "candidate_selector.successor_codebook" in g0
    )
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["math", "compiled"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_flex_equals_eager_on_cuda_values_and_gradients(variant, kernel, monkeypatch):
    """The CUDA training path (compiled create_block_mask; flex attention compiled, or its
    uncompiled math kernel, which reads the block mask too) against the eager dense mask:
    block outputs and the drafter's gradients. 80 query rows: fewer than one flex block, so
    the padding to 128 rows is exercised (inductor's decoding kernel has no backward). All
    variants in one process: a compiled mask reused across (causal, window) keys once failed
    exactly here (fixed by `mask_flags`)."""
    import drafttrain.objectives.ttt as ttt

    if kernel == "math":
        from torch.nn.attention.flex_attention import flex_attention

        monkeypatch.setattr(ttt, "flex_fn", lambda device: flex_attention)
    d = variant_drafter(variant, head_dim=16).cuda()  # 16: compiled flex's smallest head
    spec = train_spec("dflash")
    B, T, n = 2, 300, 16
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, d.config.vocab_size, (B, T), generator=g).cuda()
    feats = torch.randn(B, T, d.config.features.width(d.config.hidden_size), generator=g).cuda()
    pos = torch.arange(T, device="cuda")[None].expand(B, T)
    anchors = torch.tensor([[3, 40, 41, 200, 290], [5, 17, 100, -1, -1]], device="cuda")
    up = torch.randn(B, anchors.shape[1], n, d.config.hidden_size, generator=g).cuda()
    res = {}
    for backend in ("eager", "flex"):
        d.zero_grad()
        out = spec.objective(d, spec.config_class(), backend).forward_blocks(
            ids, feats, pos, anchors, n
        )
        valid = (anchors >= 0)[..., None, None]
        (out * up * valid).sum().backward()
        res[backend] = (
            out[anchors >= 0],
            {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None},
        )
    tol = 2e-4 if kernel == "math" else 1e-3
    torch.testing.assert_close(res["flex"][0], res["eager"][0], rtol=tol, atol=tol)
    for k, grad in res["eager"][1].items():
        torch.testing.assert_close(res["flex"][1][k], grad, rtol=1e-3, atol=1e-3)


def test_presets_compose_with_the_published_recipe():
    from tests.support.presets import compose_preset

    for name, target in (
        ("dflash_qwen3_8b", "Qwen/Qwen3-8B"),
        ("dflash_llama3_8b", "meta-llama/Llama-3.1-8B-Instruct"),
    ):
        cfg = compose_preset(name)
        d, t = cfg.drafter, cfg.trainer
        assert cfg.target.name_or_path == target and d.kind == "dflash"
        assert (d.num_layers, d.block_size, d.num_anchors, d.gamma) == (5, 16, 512, 7.0)
        assert (t.lr, cfg.data.max_length) == (6e-4, 3072)
        assert t.warmup_steps == 0.04 * t.max_steps
        assert cfg.data.batch_size * t.grad_accum == 32  # SpecForge: 4 per GPU x 8 GPUs
        assert cfg.data.path.startswith("outputs/regen_")  # drafttrain.regenerate's output
        assert cfg.data.eval_path == "HuggingFaceH4/ultrachat_200k"
    assert compose_preset("dflash_llama3_8b").drafter.mask_token_id == 128002
    assert compose_preset("dflash").drafter.kind == "dflash"
