"""The training step's memory design, each piece against its plain formula (issue 10 item 3):

- the fused linear + soft cross-entropy (`drafttrain.objectives.fused_ce`) against the materialized
  logits, values and gradients, with groups, masked rows and awkward chunk sizes;
- the target distribution computed from the final hidden state and head in chunks
  (`drafttrain.frozen.head`) against the target's own logits, and no logits in a training
  target's output;
- every kind's objective against its previous formulation (full-vocabulary logits, shifted
  copies, per-row cross-entropy): loss, metrics and gradients;
- no host sync inside an objective's forward and backward (eagle3, mtp);
- `DraftLoss` metrics bit-equal to the host arithmetic they replaced;
- activation checkpointing from outside the model (`drafttrain.trainer.wrap`): same loss, same grads;
- `MixedAdamW` (bf16 parameters, fp32 masters) against `torch.optim.AdamW`;
- the ptd block mask built block row by block row against `create_block_mask`.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from draftinfer.conventions.window import TokenEmbeds, shift_left
from drafttrain.frozen.head import (
    TrainTargetOutput,
    target_distribution,
    target_logits,
)
from drafttrain.frozen.target import batch_slots
from drafttrain.jobs.errors import ConfigError
from drafttrain.objectives.fused_ce import linear_soft_ce, linear_soft_ce_ref
from drafttrain.objectives.losses import DraftLoss, metric_values, soft_cross_entropy, top1_agrees
from drafttrain.registry import train_spec
from tests.support.kind_factories import _frozen, drafter_for, small_target_dir
from tests.support.utils import assert_close, poisoned_empty

KINDS = ("eagle3", "ptd", "mtp")


# ---- fused linear + soft cross-entropy ----------------------------------------------------
def _fused_case(N=37, H=16, V=29, M=41, G=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).requires_grad_()
    w = torch.randn(V, H, generator=g).requires_grad_()
    probs = torch.softmax(2 * torch.randn(M, V, generator=g), -1)
    probs[3] = 0  # a label row past the end of a sequence
    rows = torch.randint(0, M, (N,), generator=g)
    rows[:4] = 3
    group = torch.randint(-1, G, (N,), generator=g)  # -1: masked rows
    return h, w, probs, rows, probs.argmax(-1), group, G


@pytest.mark.parametrize("groups", [3, 1])
@pytest.mark.parametrize("chunk_rows", [1, 5, 37, 64])
def test_fused_soft_ce_equals_plain_formula(chunk_rows, groups):
    """Loss sums, hits and counts per group, and grads of hidden and weight (fp32, CPU),
    whatever the chunk size (1 row, a prime, exactly N, more than N); with several groups
    (gradients recomputed in backward) and one (gradients made in forward, then scaled)."""
    h, w, probs, rows, top1, group, G = _fused_case(G=groups)
    with poisoned_empty():  # every row of grad_hidden / the lse buffer must be written
        got = linear_soft_ce(h, w, probs, rows, top1, group, G, chunk_elements=chunk_rows * 29)
    want = linear_soft_ce_ref(h, w, probs, rows, top1, group, G)
    for a, b in zip(got, want):
        assert_close(a, b)
    assert torch.equal(got[2], torch.bincount(group[group >= 0], minlength=G).float())
    upstream = torch.tensor([0.7, -1.3, 2.0])[:G]
    with poisoned_empty():
        ga = torch.autograd.grad((got[0] * upstream).sum(), (h, w))
    gb = torch.autograd.grad((want[0] * upstream).sum(), (h, w))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    masked = group < 0
    assert not ga[0][masked].any()  # masked rows get no gradient


def test_fused_soft_ce_masked_rows_and_frozen_head():
    """Chunked path: a non-finite hidden row that no group counts does not leak into the loss
    or the other rows' gradients; a head that does not require grad (MTP's shared head) gets
    none."""
    h, w, probs, rows, top1, group, G = _fused_case()
    w = w.detach()
    with torch.no_grad():
        h[group < 0] = float("inf")
    loss, hits, count = linear_soft_ce(h, w, probs, rows, top1, group, G, chunk_elements=5 * 29)
    assert torch.isfinite(loss).all()
    keep = group >= 0
    want = linear_soft_ce_ref(h[keep], w, probs, rows[keep], top1, group[keep], G)
    assert_close(loss, want[0])
    (gh,) = torch.autograd.grad(loss.sum(), (h,))
    assert gh[keep].isfinite().all() and not gh[~keep].any()


def test_fused_soft_ce_bf16_labels_under_autocast():
    """bf16 labels and a bf16 matmul (autocast): within bf16 rounding of the fp32 formula."""
    h, w, probs, rows, top1, group, G = _fused_case(H=32, V=61)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_soft_ce(h, w, probs.bfloat16(), rows, top1, group, G, chunk_elements=7 * 61)
    want = linear_soft_ce_ref(h, w, probs, rows, top1, group, G)
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=1e-1)
    assert torch.equal(got[2], want[2])


# ---- the target distribution, from the head, in chunks -------------------------------------
@pytest.fixture(scope="module")
def small_target():
    return _frozen(small_target_dir("1d"))


def _batch(V: int, B: int = 3, T: int = 23, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 17:] = 0
    am[2, 9:] = 0
    lm = (torch.rand(B, T, generator=g) < 0.7).long() * am
    pos = torch.arange(T)[None].expand(B, T) * am
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "position_ids": pos}


@pytest.mark.parametrize("chunk", [1 << 26, 5 * 97])
def test_target_distribution_from_head_equals_logits(small_target, chunk, monkeypatch):
    """`batch_output` computes no logits; the distribution restricted to a vocabulary subset
    (and over all of it), its top-1 and the in-subset flag equal those of the target's own
    full logits, chunked or not."""
    import drafttrain.frozen.head as th

    monkeypatch.setattr(th, "CHUNK_ELEMENTS", chunk)
    t = small_target
    V = t.info.vocab_size
    batch = _batch(V)
    head = t.batch_output(batch, None)
    assert isinstance(head, TrainTargetOutput) and head.logits is None
    dense = t.forward(batch["input_ids"], batch_slots(batch))
    assert_close(target_logits(head), dense.logits)
    ids = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(1))[:41]).values
    for vocab in (ids, None):
        a, b = target_distribution(head, vocab), target_distribution(dense, vocab)
        assert_close(a.probs, b.probs)
        assert torch.equal(a.top1, b.top1) and torch.equal(a.in_vocab, b.in_vocab)
        logits = dense.logits.flatten(0, 1)
        sub = logits if vocab is None else logits[:, vocab]
        assert_close(a.probs, torch.softmax(sub, -1))
        assert torch.equal(a.top1, sub.argmax(-1))
        member = torch.zeros(V, dtype=torch.bool)
        member[ids if vocab is not None else torch.arange(V)] = True
        assert torch.equal(a.in_vocab, member[logits.argmax(-1)])


# ---- objectives against their previous formulation -----------------------------------------
def _old_eagle3(obj, batch, tgt):
    d, tlog = obj.drafter, tgt.logits
    in_draft = d.t2d[tlog.argmax(-1)]
    target_p = torch.softmax(tlog[..., d.t2d], -1)
    loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    steps = obj.unroll(
        batch["input_ids"], tgt.features, tgt.rope_pos, obj.cfg.ttt_steps, TokenEmbeds.of(tgt)
    )
    out = DraftLoss(tlog.device)
    for k, logits in enumerate(steps):
        p_k = shift_left(target_p, 1 + k)
        valid = shift_left(loss_mask, 2 + k, False) & shift_left(in_draft, 1 + k, False)
        ce, hit = soft_cross_entropy(logits, p_k), top1_agrees(logits, p_k)
        out.add(k, ce, hit, valid, obj.cfg.ttt_decay**k)
    return out.result(loss_mask)


def _old_ptd(obj, batch, tgt):
    from drafttrain.kinds.ptd.objective import PAD_ANCHOR, sample_slots

    c, d = obj.cfg, obj.drafter
    K, (B, T), tlog = c.parallel_k, batch["input_ids"].shape, tgt.logits
    in_draft = d.t2d[tlog.argmax(-1)]
    target_p = torch.softmax(tlog[..., d.t2d], -1)
    loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    cand = shift_left(loss_mask, 3, False)
    slots = [
        sample_slots(
            cand[b].nonzero().flatten(), K, c.keep_ratio, c.keep_floor, c.max_slots_per_seq
        )
        for b in range(B)
    ]
    logits, anchor, depth = obj.forward_slots(
        batch["input_ids"], tgt.features, tgt.rope_pos, *zip(*slots), TokenEmbeds.of(tgt)
    )
    real = depth < PAD_ANCHOR
    src = torch.where(real, anchor + 1 + depth, 0)
    inside = real & (src < T)
    src = src.clamp(max=T - 1)
    bidx = torch.arange(B)[:, None]
    p = target_p[bidx, src]
    nxt = (src + 1).clamp(max=T - 1)
    valid = inside & (src + 1 < T) & loss_mask[bidx, nxt] & in_draft[bidx, src]
    ce, hit = soft_cross_entropy(logits, p), top1_agrees(logits, p)
    out = DraftLoss(tlog.device)
    for dd in range(K):
        out.add(dd, ce, hit, valid & (depth == dd), c.depth_decay**dd)
        out.metrics[f"slots_{dd}"] = float((real & (depth == dd)).sum().item())
    return out.result(loss_mask)


def _old_mtp(obj, batch, tgt):
    c, tlog = obj.cfg, tgt.logits
    target_p = torch.softmax(tlog, -1)
    loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    n = obj.drafter.config.n_predict
    out = DraftLoss(tlog.device)
    for k, lg in enumerate(obj.module_logits(batch["input_ids"], tgt.features, tgt.rope_pos, n)):
        p_k, valid = shift_left(target_p, 1 + k), shift_left(loss_mask, 2 + k, False)
        w = 1.0 if c.loss_weights == "uniform" else c.loss_decay**k
        out.add(k, soft_cross_entropy(lg, p_k), top1_agrees(lg, p_k), valid, w)
    return out.result(loss_mask)


OLD = {"eagle3": _old_eagle3, "ptd": _old_ptd, "mtp": _old_mtp}
CFG = {"eagle3": {"ttt_steps": 4}, "ptd": {"parallel_k": 4}, "mtp": {}}


def _kind_setup(kind, target):
    V = target.info.vocab_size
    over = {} if kind == "mtp" else {"draft_vocab_size": 61}
    d = drafter_for(kind, small_target_dir("1d"), **over)
    if kind != "mtp":  # a non-identity draft vocabulary
        ids = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:61])
        d.d2t.copy_(ids.values - torch.arange(61))
        d.t2d.zero_()
        d.t2d[ids.values] = True
    spec = train_spec(kind)
    return d.train(), spec, spec.objective(d, spec.config_class(**CFG[kind]), "eager")


def _run(fn, d, batch, tgt, seed=5):
    torch.manual_seed(seed)
    d.zero_grad()
    loss, m = fn(batch, tgt)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    return loss.detach(), metric_values(m), grads


@pytest.mark.parametrize("kind", KINDS)
def test_objective_equals_previous_formulation(kind, small_target):
    """Loss, every metric (same keys, same order) and every gradient are bit-for-bit the
    previous formulation's (full logits, shifted label copies, per-row cross-entropy), from
    the training target's head and from dense logits alike: a problem of one chunk runs the
    plain formula, which is what keeps the tiny recipes' golden losses unchanged."""
    d, _, obj = _kind_setup(kind, small_target)
    batch = _batch(small_target.info.vocab_size)
    dense = small_target.forward(batch["input_ids"], batch_slots(batch), d.config.features)
    head = small_target.batch_output(batch, d.config.features)
    l0, m0, g0 = _run(lambda b, t: OLD[kind](obj, b, t), d, batch, dense)
    for tgt in (dense, head):
        l1, m1, g1 = _run(obj, d, batch, tgt)
        assert torch.equal(l1, l0)
        assert list(m1) == list(m0)
        for k in m0:
            assert m1[k] == m0[k] or k.startswith("acc_"), k  # argmax ties may differ
        assert g1.keys() == g0.keys()
        for n in g0:
            assert torch.equal(g1[n], g0[n]), n


@pytest.mark.parametrize("kind", ("eagle3", "mtp"))
def test_objective_step_has_no_host_sync(kind, small_target, monkeypatch):
    """Forward and backward of the objective read nothing back to the host (`.item()`,
    `.tolist()`, `bool` / `int` / `float` of a tensor): metrics stay tensors."""
    d, _, obj = _kind_setup(kind, small_target)
    batch = _batch(small_target.info.vocab_size)
    tgt = small_target.batch_output(batch, d.config.features)

    def sync(*_a, **_k):
        raise AssertionError("host sync inside the training step")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    loss, metrics = obj(batch, tgt)
    loss.backward()
    assert all(torch.is_tensor(v) for v in metrics.values())
    monkeypatch.undo()
    assert metric_values(metrics)["tokens"] == batch["loss_mask"].sum().item()


def test_draft_loss_metrics_equal_host_arithmetic():
    """The metrics computed on device (float64) are bit-equal to the host loop they
    replaced: `n = max(count, 1)`, `loss_k = s / n`, `acc_k = hits / n`, survival product."""
    stats = [(3.25, 2.0, 7.0), (1.5, 0.0, 0.0), (2.75, 3.0, 5.0)]
    dl = DraftLoss(torch.device("cpu"))
    for k, (s, h, c) in enumerate(stats):
        dl.add_sums(k, torch.tensor(s), torch.tensor(h), torch.tensor(c), 0.8**k)
    total, m = dl.result(torch.ones(2, 6))
    got = metric_values(m)
    surv, sim_al, loss, tot = 1.0, 1.0, 0.0, torch.zeros(())
    for k, (s, h, c) in enumerate(stats):
        n = max(c, 1.0)
        tot = tot + 0.8**k * (torch.tensor(s) / n)
        surv *= h / n
        sim_al += surv
        loss += 0.8**k * s / n
        assert got[f"loss_{k}"] == s / n and got[f"acc_{k}"] == h / n
    assert got["loss"] == loss and got["sim_al"] == sim_al and got["tokens"] == 12.0
    assert torch.equal(total, tot)


# ---- activation checkpointing, mixed-precision optimizer -----------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_activation_checkpointing_keeps_loss_and_grads(kind, small_target):
    from drafttrain.trainer.wrap import apply_activation_checkpointing

    d, spec, obj = _kind_setup(kind, small_target)
    batch = _batch(small_target.info.vocab_size)
    tgt = small_target.batch_output(batch, d.config.features)
    l0, m0, g0 = _run(obj, d, batch, tgt)
    d2 = copy.deepcopy(d)
    apply_activation_checkpointing(spec.blocks(d2))
    l1, m1, g1 = _run(spec.objective(d2, obj.cfg, "eager"), d2, batch, tgt)
    assert torch.equal(l1, l0) and m1 == m0
    for n in g0:
        assert torch.equal(g1[n], g0[n]), n


def test_mixed_adamw_tracks_fp32_adamw_and_keeps_masters():
    """fp32 params: the same trajectory as torch's AdamW. bf16 params with masters: the
    masters follow torch's fp32 trajectory from the same (bf16) start with the same (bf16)
    gradients, the params are their rounding (updates far below a bf16 ulp are kept), and a
    state_dict round trip keeps the masters and moments fp32."""
    from drafttrain.trainer.optim import MixedAdamW

    torch.manual_seed(0)
    w0 = torch.randn(5, 7)
    grads = [torch.randn(5, 7) * 1e-2 for _ in range(6)]
    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ref, ours = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ref_low = torch.nn.Parameter(w0.bfloat16().float())
    low = torch.nn.Parameter(w0.bfloat16())
    params = (ref, ours, ref_low, low)
    opts = [
        torch.optim.AdamW([ref], **kw),
        MixedAdamW([ours], **kw),
        torch.optim.AdamW([ref_low], **kw),
        MixedAdamW([low], **kw),
    ]
    for g in grads:
        for i, (p, o) in enumerate(zip(params, opts)):
            p.grad = g.bfloat16().to(p.dtype) if i >= 2 else g.clone()
            o.step()
    torch.testing.assert_close(ours, ref, atol=1e-7, rtol=1e-6)
    master = opts[3].master_of(low)
    assert master.dtype == torch.float32 and torch.equal(low.data, master.bfloat16())
    torch.testing.assert_close(master, ref_low.data, atol=1e-7, rtol=1e-6)
    assert not torch.equal(master, w0.bfloat16().float())  # lr 1e-4: below a bf16 ulp
    fresh = torch.nn.Parameter(low.data.clone())
    again = MixedAdamW([fresh], **kw)
    again.load_state_dict(copy.deepcopy(opts[3].state_dict()))
    assert torch.equal(again.master_of(fresh), master)
    assert again.state[fresh]["exp_avg"].dtype == torch.float32


def test_ptd_block_mask_equals_create_block_mask():
    """The block-row-wise ptd block mask marks the same full and partial blocks as
    `create_block_mask` over the dense predicate (N not a multiple of the block)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from drafttrain.kinds.ptd.objective import PAD_ANCHOR, ptd_block_mask, ptd_mask_mod

    T, S = 300, 70
    g = torch.Generator().manual_seed(0)
    a = torch.sort(torch.randint(0, T - 4, (S,), generator=g)).values
    dp = torch.randint(1, 4, (S,), generator=g)
    anchor = torch.cat([torch.arange(T), a, torch.full((5,), PAD_ANCHOR)])[None]
    depth = torch.cat([torch.zeros(T, dtype=torch.long), dp, torch.full((5,), PAD_ANCHOR)])[None]
    N = anchor.shape[1]
    ours = ptd_block_mask(anchor, depth, q_blocks_per_chunk=1)
    ref = create_block_mask(ptd_mask_mod(anchor, depth), 1, None, N, N, device="cpu")

    def blocks(num, idx):
        return [set(idx[0, 0, q, : num[0, 0, q]].tolist()) for q in range(num.shape[-1])]

    assert blocks(ours.kv_num_blocks, ours.kv_indices) == blocks(ref.kv_num_blocks, ref.kv_indices)
    assert blocks(ours.full_kv_num_blocks, ours.full_kv_indices) == blocks(
        ref.full_kv_num_blocks, ref.full_kv_indices
    )


@pytest.mark.slow
def test_bf16_trainer_run_checkpoints_masters_and_resumes_exactly(train_env, tmp_path):
    """`trainer.param_dtype=bfloat16` with fp32 masters, bf16 moments and activation
    checkpointing through `train(cfg)`: finite losses, checkpoints holding the fp32 masters
    (bf16 parameters are their rounding), and a resume from the mid-run checkpoint ending
    with the uninterrupted run's weights."""
    import shutil

    from safetensors.torch import load_file

    from drafttrain.jobs.train import train
    from tests.support.presets import compose_preset, small_overrides

    extra = [
        "trainer.param_dtype=bfloat16",
        "trainer.optimizer_dtype=bfloat16",
        "trainer.activation_checkpointing=true",
        "trainer.save_every=2",
        "trainer.log_every=1",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    summary = train(compose_preset("eagle3", small_overrides(train_env, full, steps=4) + extra))
    assert len(summary["losses"]) == 4 and all(map(math.isfinite, summary["losses"]))
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    (resumed / "checkpoints" / "latest").write_text("step_000002\n")
    overrides = small_overrides(train_env, resumed, steps=4) + extra + ["resume=true"]
    assert train(compose_preset("eagle3", overrides))["losses"] == summary["losses"][2:]
    a = load_file(str(full / "checkpoints" / "step_000004" / "drafter.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "step_000004" / "drafter.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert a["fc.weight"].dtype == torch.float32  # the master, not the bf16 parameter
    assert not torch.equal(a["fc.weight"], a["fc.weight"].bfloat16().float())


def test_trainer_freeze_keeps_named_parameters_and_rejects_unknown_names(train_env, tmp_path):
    """`trainer.freeze=[lm_head]`: the head is the same tensor at every checkpoint while the
    rest trains; a prefix that names no parameter is a one-line `ConfigError` before any
    output is written."""
    from safetensors.torch import load_file

    from drafttrain.jobs.train import train
    from tests.support.presets import compose_preset, small_overrides

    run = tmp_path / "frozen"
    extra = ["trainer.freeze=[lm_head]", "trainer.save_every=1"]
    train(compose_preset("eagle3", small_overrides(train_env, run, steps=2) + extra))
    a, b = (
        load_file(str(run / "checkpoints" / f"step_00000{i}" / "drafter.safetensors"))
        for i in (1, 2)
    )
    assert torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    assert not torch.equal(a["fc.weight"], b["fc.weight"])
    bad = tmp_path / "bad"
    with pytest.raises(ConfigError, match="'lm_hed' names no drafter parameter"):
        train(
            compose_preset(
                "eagle3", small_overrides(train_env, bad, steps=2) + ["trainer.freeze=[lm_hed]"]
            )
        )
    assert not bad.exists()
