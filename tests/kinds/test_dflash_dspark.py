"""DSpark as options of the block drafter (`drafter.dspark`): the sample-from-anchor layout, the
vanilla Markov head and the confidence head, each pinned directly (REFERENCES A1/A2 "DSpark"):

- layout: draft j comes from slot j - 1 (the anchor slot drafts) and is scored against x[a + j]
  in training, and the runner's block of k slots gives k drafts, capped without wrapping;
- Markov bias: `markov_w2(markov_w1[prev])`, prev = the ground truth in training, the previous
  draft in the runner (the anchor for draft 1), computed here by hand;
- loss: `0.1 CE + 0.9 TV + 1.0 BCE(confidence, sum min(p, q))` per drafting slot, by hand; the
  acceptance target is detached (a zero gradient on the Markov head from the BCE alone);
- the runner carries the confidence head's accept probabilities of its drafts;
- export: the fields vLLM's `dspark` reads and the tensor names and shapes of the references;
- the `gated` head (speculators 0.9.0's definition: `markov_w2(sigmoid(gate_proj([h,
  markov_w1[prev]])) * markov_w1[prev])`) and `confidence_head_with_markov` (the confidence
  head over `[h, markov_w1[prev]]`), by hand in training and the runner; the z-lab / vLLM
  export refuses `gated` in one line, the speculators `dspark` layout holds it.
S9 parity and the rounds-against-a-reference test run the option with every other one
(`tests/support/dflash.py::VARIANTS`, `tests/kinds/test_dflash_options.py`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from draftinfer.files.errors import CheckpointError
from draftinfer.kinds.dflash import DFlashConfig
from draftinfer.kinds.dflash.module import draft_logits
from draftinfer.kinds.dflash.proposer import dflash_block_inputs
from draftinfer.registry import drafter_spec
from drafttrain.kinds.dflash import objective as dflash_objective
from drafttrain.registry import train_spec
from tests.support.dflash import batch_and_target, runner_logits, variant_drafter


def _markov_by_hand(d, prev: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """`W2 @ W1[prev]` with the stored `[V, r]` matrices, written out; gated: `W1[prev]` first
    scaled by `sigmoid(Wg @ [h, W1[prev]] + bg)` (`Wg [r, H + r]`)."""
    w1 = d.markov_head.markov_w1.weight  # [V, r]
    w2 = d.markov_head.markov_w2.weight  # [V, r]
    e = w1[prev]
    if d.config.markov_head_type == "gated":
        g = d.markov_head.gate_proj
        e = torch.sigmoid(torch.cat([h, e], -1) @ g.weight.T + g.bias) * e
    return e @ w2.T


def _conf_by_hand(d, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The confidence logit: `w . h + b`, or `w . [h, W1[prev]] + b` with the Markov input."""
    w, b = d.confidence_head.proj.weight[0], d.confidence_head.proj.bias[0]
    if d.config.confidence_head_with_markov:
        h = torch.cat([h, d.markov_head.markov_w1.weight[prev]], -1)
    return h @ w + b


# (markov_head_type, confidence_head_with_markov) of the DSpark heads tested by hand.
HEADS = [("vanilla", False), ("gated", True), ("vanilla", True), ("gated", False)]


def _dspark(head: str = "vanilla", with_markov: bool = False):
    return variant_drafter("dspark", markov_head_type=head, confidence_head_with_markov=with_markov)


def _inputs(d, T=15, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, d.config.vocab_size, (1, T), generator=g)
    feats = torch.randn(1, T, d.config.features.width(d.config.hidden_size), generator=g)
    return ids, feats, torch.arange(T)[None]


def test_layout_is_one_definition_and_check_k_follows_it():
    d = variant_drafter("dspark")
    c = d.config
    assert c.sample_from_anchor and c.first_draft_slot == 0
    assert c.block_slots(5) == 5 and c.max_drafts == c.block_size
    plain = dataclasses.replace(c, sample_from_anchor=False, markov_rank=0, confidence_head=False)
    assert plain.first_draft_slot == 1 and plain.block_slots(5) == 6
    assert plain.max_drafts == c.block_size - 1
    spec = drafter_spec("dflash")
    spec.check_k(c, c.block_size)  # the anchor slot drafts: B drafts per block
    with pytest.raises(CheckpointError, match="exceeds"):
        spec.check_k(c, c.block_size + 1)
    with pytest.raises(CheckpointError, match="exceeds"):
        spec.check_k(plain, plain.block_size)


def test_runner_block_of_k_slots_capped_without_wrapping():
    """`first = 0`: k slots for k drafts; a request allowed n drafts has live slots 0..n-1
    (the anchor slot always: its row is committed), the others padding."""
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    cache_pos = torch.tensor([[0, 1, 2], [3, 4, -1], [7, 8, 9]])
    rope_pos = cache_pos.clamp(min=0)
    num_drafts = torch.tensor([4, 2, 0])
    anchor_ids, anchor, cache, rope, block, block_end, live = dflash_block_inputs(
        ids, cache_pos, rope_pos, num_drafts, 4, 99, first=0
    )
    assert anchor_ids.tolist() == [7, 9, 13] and anchor.tolist() == [3, 5, 10]
    assert cache.tolist() == [[3, 4, 5, 6], [5, 6, -1, -1], [10, -1, -1, -1]]
    assert rope.tolist() == [[3, 4, 5, 6], [5, 6, 7, 8], [10, 11, 12, 13]]
    assert block.tolist() == [[7, 99, 99, 99], [9, 99, 99, 99], [13, 99, 99, 99]]
    assert block_end.tolist() == [6, 6, 10]
    assert live.tolist() == [[True] * 4, [True, True, False, False], [False] * 4]
    # plain DFlash: k + 1 slots, slot s >= 1 drafts s.
    *_, cache1, _, _, end1, live1 = dflash_block_inputs(
        ids, cache_pos, rope_pos, num_drafts, 4, 99, first=1
    )
    assert cache1.tolist()[1] == [5, 6, 7, -1, -1] and end1.tolist() == [7, 7, 10]
    assert torch.equal(live1, live)


def test_markov_bias_is_w2_of_w1_of_the_previous_token():
    d = variant_drafter("dspark")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, d.config.hidden_size, generator=g)
    prev = torch.randint(0, d.config.vocab_size, (6,), generator=g)
    with torch.no_grad():
        got = draft_logits(d, h, prev) - d.logits(h)
        want = _markov_by_hand(d, prev)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(want.abs().max()) > 1.0  # the randomized head moves the logits


def test_runner_biases_each_draft_by_the_previous_draft():
    """Draft 2's logits after choosing token a vs b for draft 1 differ by exactly the Markov
    bias of a minus that of b; draft 1's by nothing (its predecessor is the anchor)."""
    d = variant_drafter("dspark")
    ids, feats, pos = _inputs(d)
    a, b = torch.tensor([3, 4, 5]), torch.tensor([40, 4, 5])
    with torch.no_grad():
        la = runner_logits(d, ids, feats, pos, 6, 3, choose_ids=a)
        lb = runner_logits(d, ids, feats, pos, 6, 3, choose_ids=b)
        want = _markov_by_hand(d, torch.tensor(3)) - _markov_by_hand(d, torch.tensor(40))
    torch.testing.assert_close(la[0], lb[0])
    torch.testing.assert_close(la[1] - lb[1], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(la[2], lb[2])  # both chose 4 for draft 2


@pytest.mark.parametrize("head, with_markov", HEADS)
def test_training_scores_slot_j_minus_1_against_x_a_plus_j_with_the_dspark_loss(
    monkeypatch, head, with_markov
):
    """Anchor a = 6 of 14 tokens, block 16: draft j (slot j - 1, the anchor slot first) has label
    x[6 + j] scored against target row 5 + j, predecessor x[5 + j]; j = 1..7 are inside the
    sequence. Each slot's logged loss equals 0.1 CE + 0.9 TV + BCE(conf, sum min(p, q)), all
    computed here from the block's hidden states and the weights by hand, for each Markov head
    type and confidence input."""
    d = _dspark(head, with_markov)
    spec = train_spec("dflash")
    cfg = spec.config_class(
        dspark=True, markov_rank=5, markov_head_type=head, confidence_head_with_markov=with_markov
    )
    obj = spec.objective(d, cfg, "eager")
    batch, tgt = batch_and_target(d)
    a, T = 6, 14
    ids = batch["input_ids"]
    monkeypatch.setattr(dflash_objective, "sample_anchors", lambda c, n: torch.tensor([[a]]))
    with torch.no_grad():
        _, m = obj(batch, tgt)
        h = obj.forward_blocks(ids, tgt.features, tgt.rope_pos, torch.tensor([[a]]), 16)[0, 0]
    p_t = torch.softmax(tgt.logits[0], -1)
    assert int(m["acc_16"] != m["acc_16"]) == 0  # 16 drafts are logged (B, not B - 1)
    for j in range(1, 17):
        if a + j >= T:
            assert m[f"loss_{j}"] == 0.0
            continue
        slot, row, prev = j - 1, a + j - 1, ids[0, a + j - 1]
        logits = h[slot] @ d.lm_head.weight.T + _markov_by_hand(d, prev, h[slot])
        q = torch.softmax(logits, -1)
        ce = -(p_t[row] * torch.log_softmax(logits, -1)).sum()
        tv = 0.5 * (q - p_t[row]).abs().sum()
        alpha = torch.minimum(q, p_t[row]).sum()
        z = _conf_by_hand(d, h[slot], prev)
        bce = -(alpha * F.logsigmoid(z) + (1 - alpha) * F.logsigmoid(-z))
        want = 0.1 * ce + 0.9 * tv + bce
        torch.testing.assert_close(m[f"loss_{j}"].float(), want, rtol=1e-4, atol=1e-4)
        assert float(m[f"acc_{j}"]) == float(logits.argmax() == p_t[row].argmax())


def test_confidence_target_is_detached_and_each_term_trains_its_own_part():
    """With CE and TV weighted 0, the loss is the BCE alone: the Markov head's gradient is
    exactly zero (alpha = sum min(p, q) is a detached target), the confidence head's is not.
    With the BCE weighted 0 the confidence head gets exactly zero gradient."""
    d = variant_drafter("dspark")
    spec = train_spec("dflash")
    batch, tgt = batch_and_target(d)
    for weights, zero, nonzero in (
        ({"dspark_ce_weight": 0.0, "dspark_tv_weight": 0.0}, "markov_head", "confidence_head"),
        ({"confidence_loss_weight": 0.0}, "confidence_head", "markov_head"),
    ):
        cfg = spec.config_class(dspark=True, markov_rank=5, **weights)
        obj = spec.objective(d, cfg, "eager")
        d.zero_grad(set_to_none=False)
        torch.manual_seed(0)
        loss, _ = obj(batch, tgt)
        loss.backward()
        grads = {n: p.grad for n, p in d.named_parameters() if p.requires_grad}
        assert all(float(g.abs().max()) == 0.0 for n, g in grads.items() if n.startswith(zero))
        assert any(float(g.abs().max()) > 0.0 for n, g in grads.items() if n.startswith(nonzero))


@pytest.mark.parametrize("head, with_markov", HEADS)
def test_runner_carries_the_confidence_of_its_drafts(head, with_markov):
    """The proposer's `confidence` `[B, k]` is sigmoid(proj(h)) of the drafting slots (with the
    Markov input: sigmoid(proj([h, W1[prev]])), prev the anchor for draft 1, else the previous
    draft), h the hidden states training gives the same block; its draft logits are the head's
    plus the Markov bias of the previous draft, gated by h for the gated head, by hand."""
    d = _dspark(head, with_markov)
    ids, feats, pos = _inputs(d)
    spec = train_spec("dflash")
    obj = spec.objective(d, spec.config_class(dspark=True, markov_rank=5), "eager")
    prop = drafter_spec("dflash").proposer_class(d, 2, 64, torch.device("cpu"), torch.float32)
    from draftinfer.decoding.proposer import FirstPass

    anchor, k = 6, 4
    n = anchor + 1
    fp = FirstPass(
        torch.tensor([1]), ids[:, 1 : n + 1], feats[:, :n], torch.arange(n)[None], pos[..., :n]
    )
    seen = []

    def keep(logits, step):
        seen.append(logits[0].clone())
        return logits.argmax(-1), None

    drafts, _ = prop.propose(prop.admit(fp), torch.tensor([k]), k, keep)
    prev = torch.cat([ids[0, n : n + 1], drafts[0, :-1]])  # anchor token, then the drafts
    with torch.no_grad():
        h = obj._anchors_hidden(ids, feats, pos, [anchor], k)[0]  # [k, H]
        want = torch.sigmoid(_conf_by_hand(d, h, prev))
        logits = h @ d.lm_head.weight.T + _markov_by_hand(d, prev, h)
    assert prop.confidence is not None and prop.confidence.shape == (1, k)
    torch.testing.assert_close(prop.confidence[0], want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.stack(seen), logits, rtol=1e-4, atol=1e-4)
    if head == "gated":  # the gate is not a constant: it moves the bias
        g = d.markov_head.gate_proj
        e = d.markov_head.markov_w1.weight[prev]
        gate = torch.sigmoid(torch.cat([h, e], -1) @ g.weight.T + g.bias)
        assert float(gate.detach().std()) > 0.01


def test_export_fields_and_tensor_names_round_trip():
    d = variant_drafter("dspark")
    c = d.config
    hf = c.to_hf()
    assert hf["dflash_config"]["sample_from_anchor"] is True
    assert hf["markov_rank"] == 5 and hf["markov_head_type"] == "vanilla"
    assert DFlashConfig.from_hf(hf) == c
    sd = d.trainable_state_dict()
    V, H, r = c.vocab_size, c.hidden_size, 5
    assert sd["markov_head.markov_w1.weight"].shape == (V, r)
    assert sd["markov_head.markov_w2.weight"].shape == (V, r)
    assert sd["confidence_head.proj.weight"].shape == (1, H)
    assert sd["confidence_head.proj.bias"].shape == (1,)
    plain = dataclasses.replace(c, sample_from_anchor=False, markov_rank=0, confidence_head=False)
    ph = plain.to_hf()
    assert "sample_from_anchor" not in ph["dflash_config"] and "markov_rank" not in ph


def test_untrained_markov_head_is_plain_dflash():
    """`markov_w2` starts at zero: a freshly built DSpark drafter's draft logits are the
    head's (the test drafters above are randomized past that on purpose)."""
    d = drafter_spec("dflash").build(variant_drafter("dspark").config)
    assert float(d.markov_head.markov_w2.weight.detach().abs().max()) == 0.0
    assert float(d.markov_head.markov_w1.weight.detach().abs().max()) > 0.0
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, d.config.hidden_size, generator=g)
    with torch.no_grad():
        assert torch.equal(draft_logits(d, h, torch.tensor([1, 2, 3])), d.logits(h))


def test_on_policy_stage_refuses_the_markov_head():
    """OPD trains on the head's logits alone; a Markov head's drafts are not those."""
    from drafttrain.jobs.errors import ConfigError

    d = variant_drafter("dspark")
    spec = train_spec("dflash")
    obj = spec.objective(d, spec.config_class(dspark=True, markov_rank=5), "eager")
    ids, feats, pos = _inputs(d)
    with pytest.raises(ConfigError, match="Markov head"):
        obj.anchors_hidden(ids, feats, pos, [3], 2)


def test_gated_head_is_refused_by_the_vllm_layout_and_kept_by_speculators(tmp_path):
    """vLLM's `dspark` serves the vanilla head only: writing the z-lab layout of a gated head is
    a one-line error; speculators' `dspark` layout holds it (`markov_head.gate_proj`); a z-lab
    config that says gated is refused at load."""
    import json

    from draftinfer.files.checkpoint import write_drafter, write_speculators
    from tests.support.kind_factories import small_embeddings

    d = _dspark("gated", True)
    with pytest.raises(CheckpointError, match="markov_head_type 'gated'") as e:
        write_drafter(tmp_path / "z", d, {"target": "t"}, dtype=torch.float32)
    assert "\n" not in str(e.value) and not (tmp_path / "z" / "config.json").exists()
    emb = small_embeddings(d)
    sub = write_speculators(
        tmp_path,
        d,
        "org/target",
        ["LlamaForCausalLM"],
        d.config.block_size,
        lambda: emb["input_embeddings"],
        torch.float32,
        lambda: emb["output_embeddings"],
    )
    cfg = json.loads((sub / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["markov_head_type"] == "gated"
    assert cfg["confidence_head_with_markov"] is True
    from safetensors import safe_open

    with safe_open(str(sub / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    H, r = d.config.hidden_size, 5
    assert shapes["markov_head.gate_proj.weight"] == (r, H + r)
    assert shapes["markov_head.gate_proj.bias"] == (r,)
    assert shapes["confidence_head.proj.weight"] == (1, H + r)
    hf = dataclasses.replace(d.config, markov_head_type="vanilla").to_hf()
    hf["markov_head_type"] = "gated"
    with pytest.raises(CheckpointError, match="vanilla Markov head only"):
        DFlashConfig.from_hf(hf)


def test_confidence_with_markov_needs_both_heads():
    from draftinfer.files.errors import ConfigError

    c = variant_drafter("dspark").config
    with pytest.raises(ConfigError, match="confidence_head_with_markov"):
        dataclasses.replace(c, markov_rank=0, confidence_head_with_markov=True)


def test_warm_start_from_a_trained_dflash_drafter(train_env, tmp_path):
    """`trainer.init_from` a DFlash run into a DSpark run of the same backbone: every backbone
    tensor is the DFlash checkpoint's (an lr of 1e-30 keeps them there, bitwise, through a step), the Markov and
    confidence heads start at their init; another backbone is still refused in one line."""
    from drafttrain.jobs.train import train
    from drafttrain.trainer.checkpoint import latest_checkpoint, load_checkpoint
    from tests.support.presets import compose_preset

    def overrides(out, steps, *extra):
        return [
            f"target.name_or_path={train_env['target']}",
            f"data.path={train_env['data']}",
            f"output_dir={out}",
            f"trainer.max_steps={steps}",
            "trainer.save_every=100",
            "trainer.warmup_steps=1",
            "trainer.progress=false",
            "data.batch_size=2",
            "drafter.num_layers=1",
            "drafter.num_anchors=4",
            "export.enabled=false",
            *extra,
        ]

    base = tmp_path / "dflash"
    train(compose_preset("dflash", overrides(base, 2)))
    dspark = ["drafter.dspark=true", "drafter.markov_rank=8", f"trainer.init_from={base}"]
    out = tmp_path / "dspark"
    train(compose_preset("dflash", overrides(out, 1, "trainer.lr=1e-30", *dspark)))
    before = load_checkpoint(latest_checkpoint(base / "checkpoints"))["drafter"]
    after = load_checkpoint(latest_checkpoint(out / "checkpoints"))["drafter"]
    heads = {k for k in after if k.startswith(("markov_head.", "confidence_head."))}
    assert heads and not heads & set(before)
    assert set(after) - heads == set(before)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Its init, zero (plain DFlash drafts), moved by the one 1e-30 step only.
    assert after["markov_head.markov_w2.weight"].abs().max() < 1e-20
    with pytest.raises(CheckpointError, match="another architecture"):
        train(
            compose_preset("dflash", overrides(tmp_path / "x", 1, "drafter.num_layers=2", *dspark))
        )
