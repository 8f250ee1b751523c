"""On-policy post-training (`trainer.stage=opd`, `drafttrain.objectives.opd`,
`drafttrain.jobs.rollouts`): the reverse KL by hand, the runner's rounds as training rows by
hand, the Draft-OPD loss of every kind against the plain formula, the config and init errors
(one line, nothing written), and the stage end to end after a trained drafter: rollouts that
accept drafts, cached features that are the target's own over the committed sequence (text
and Qwen3-VL), a lossless export, and an exact resume."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from drafttrain.jobs.config import check_train_config
from drafttrain.jobs.errors import CheckpointError, ConfigError
from drafttrain.objectives.fused_ce import linear_soft_ce
from drafttrain.objectives.loss_fns import REVERSE_KL
from drafttrain.objectives.opd import OPDLoss, OPDSequence, RoundRows, round_rows
from tests.support.presets import compose_preset, small_overrides

# ---- the reverse KL on the 3-token example of tests/train/test_loss_fns.py ------------------
# p = (0.5, 0.3, 0.2), q = (0.2, 0.5, 0.3):
#   KL(q || p) = 0.2 ln(0.2/0.5) + 0.5 ln(0.5/0.3) + 0.3 ln(0.3/0.2)
#              = -0.1832581 + 0.2554128 + 0.1216395                   = 0.1937942
#   d/dz = q * (ln q - ln p - KL) = (0.2 * -1.1100850, 0.5 * 0.3170314, 0.3 * 0.2116709)
#                                                                  = (-0.2220170, 0.1585157, 0.0635013)
P = [0.5, 0.3, 0.2]
Q = [0.2, 0.5, 0.3]


@pytest.mark.parametrize("path", ["plain", "chunked"])
def test_reverse_kl_equals_hand_computation(path):
    h = torch.tensor([Q]).log().requires_grad_()
    w = torch.eye(3)
    probs = torch.tensor([P])
    zero = torch.zeros(1, dtype=torch.long)
    chunk = 1 if path == "chunked" else 1 << 26
    loss, hits, count = linear_soft_ce(
        h, w, probs, zero, probs.argmax(-1), zero, chunk_elements=chunk, loss=REVERSE_KL
    )
    assert loss.item() == pytest.approx(0.1937942, abs=1e-6)
    assert hits.item() == 0 and count.item() == 1
    (g,) = torch.autograd.grad(loss.sum(), h)
    assert g[0].tolist() == pytest.approx([-0.2220170, 0.1585157, 0.0635013], abs=1e-6)


def test_reverse_kl_of_a_target_zero_is_finite():
    """A draft token the target gives probability 0: a large finite penalty, never inf/NaN."""
    h = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    probs = torch.tensor([[0.5, 0.5, 0.0]])
    zero = torch.zeros(1, dtype=torch.long)
    loss, _, _ = linear_soft_ce(h, torch.eye(3), probs, zero, zero, zero, loss=REVERSE_KL)
    (g,) = torch.autograd.grad(loss.sum(), h)
    assert math.isfinite(loss.item()) and loss.item() > 20
    assert torch.isfinite(g).all() and g[0, 2] > 0  # pushes the draft off token 2


def test_round_rows_by_hand():
    """Prompt of 5, continuation of 10 (token 0 from the prefill), K = 3, rounds (accepted /
    proposed) 2/3, 0/3, 3/3, 1/3:
    - round 1 after token 0: anchor row 4 (it consumes token 5 = continuation 0), drafts 1..3
      predict continuation 1..3; 2 accepted, draft 3 rejected -> scores 3 (2 fwd + 1 rev);
    - round 2 starts after continuation 3 (0 + 2 + 1): anchor 7, 0 accepted -> scores 1;
    - round 3 after continuation 4: anchor 8, all 3 accepted (no rejection) -> scores 3;
    - round 4 after continuation 8: anchor 12, 1 accepted, but only continuation 9 is left
      (the round that met the end counted drafts past it) -> scores 1, accepted."""
    r = round_rows(5, 10, [2, 0, 3, 1], [3, 3, 3, 3], 3)
    assert r == RoundRows(anchors=[4, 7, 8, 12], accepted=[2, 0, 3, 1], scored=[3, 1, 3, 1])
    # A round capped below K (max_model_len / max_tokens): 1 proposed and accepted, no
    # rejected draft to score; a round that starts at the last token scores nothing.
    assert round_rows(3, 3, [1], [1], 3) == RoundRows([2], [1], [1])
    assert round_rows(3, 1, [0], [3], 3) == RoundRows([], [], [])


def _plain_opd(obj, seq, k: int, gamma: float, normalize: str, rejected: str) -> torch.Tensor:
    """The Draft-OPD loss written out: per draft position the mean over its rounds of
    KL(p || q) (accepted) or gamma^j KL(q || p) (first rejected; `rejected="kl"`: gamma^j
    KL(p || q)), summed over positions; `normalize="token"`: one mean over all rows."""
    from drafttrain.frozen.head import logit_source, target_distribution

    d = obj.drafter
    vocab = d.draft_vocab_ids()
    full = vocab.numel() == logit_source(seq.tgt).vocab_size
    p_all = target_distribution(seq.tgt, None if full else vocab).probs
    r = seq.rows
    logits = obj.anchors_logits(seq.ids, seq.tgt.features, seq.tgt.rope_pos, r.anchors, k)
    total, rows = 0.0, []
    for j in range(k):
        terms = []
        for i, (a, acc, n) in enumerate(zip(r.anchors, r.accepted, r.scored)):
            if j >= n:
                continue
            logq = F.log_softmax(logits[i, j].float(), -1)
            p = p_all[a + 1 + j]
            fwd = (p * (p.clamp_min(1e-38).log() - logq)).sum()
            if j < acc:
                terms.append(fwd)
            elif rejected == "kl":
                terms.append(gamma**j * fwd)
            else:
                terms.append(gamma**j * (logq.exp() * (logq - p.clamp_min(1e-38).log())).sum())
        if terms:
            total = total + torch.stack(terms).mean()
            rows += terms
    return total if normalize == "position" else torch.stack(rows).mean()


@pytest.mark.parametrize("variant", [("position", "rkl"), ("token", "kl")])
@pytest.mark.parametrize("kind", ["eagle3", "ptd", "dflash", "mtp"])
def test_opd_loss_equals_the_plain_formula(kind, variant):
    """Every kind's `anchors_hidden` through the fused head + loss gives the written-out
    Draft-OPD loss and its gradient (rows, positions, accepted/rejected split, decay)."""
    from drafttrain.registry import train_spec
    from tests.support.kind_factories import small_drafter, small_target

    k, gamma = 3, 0.7
    d = small_drafter(kind, parallel_k=k + 1, block_size=k + 1, gamma=4.0).train()
    spec = train_spec(kind)
    block = {"block_size": k + 1, "gamma": 4.0}  # a block drafter serves K = block - 1
    cfg = spec.config_class(**(block if kind == "dflash" else {}))
    obj = spec.objective(d, cfg, "eager")
    torch.manual_seed(3)
    T = 21
    ids = torch.randint(0, 90, (1, T))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["loss_mask"] = batch["attention_mask"]
    batch["position_ids"] = torch.arange(T)[None]
    with torch.no_grad():
        tgt = small_target().batch_output(batch, d.config.features)
    rows = round_rows(6, T - 6, [2, 0, 3, 1, 0, 2], [3, 3, 3, 3, 2, 3], k)
    assert len(rows.anchors) >= 4
    seq = OPDSequence(ids, tgt, rows)
    loss, metrics = OPDLoss(obj, k, gamma, *variant)([seq])
    want = _plain_opd(obj, seq, k, gamma, *variant)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    params = [p for p in d.parameters() if p.requires_grad]
    got_g = torch.autograd.grad(loss, params, allow_unused=True)
    want_g = torch.autograd.grad(want, params, allow_unused=True)
    for a, b in zip(got_g, want_g):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert metrics["opd_accepted"] == pytest.approx(sum(rows.accepted) / len(rows.anchors))


# ---- config and init errors: one line, nothing written ---------------------------------------
def test_opd_without_init_from_is_a_one_line_error():
    with pytest.raises(ConfigError) as e:
        check_train_config(compose_preset("eagle3", ["trainer.stage=opd"]))
    msg = str(e.value)
    assert "\n" not in msg and "trainer.init_from" in msg
    with pytest.raises(ConfigError, match="opd.gamma must be in"):
        check_train_config(compose_preset("eagle3_opd", ["opd.gamma=0"]))
    with pytest.raises(ConfigError, match="trainer.stage must be one of"):
        check_train_config(compose_preset("eagle3", ["trainer.stage=rl"]))


def test_init_from_errors_before_anything_is_written(train_env, tmp_path):
    from drafttrain.jobs.train import train

    out = tmp_path / "run"
    base = small_overrides(train_env, out, steps=2)
    with pytest.raises(CheckpointError) as e:
        train(compose_preset("eagle3", [*base, "trainer.stage=opd", f"trainer.init_from={out}x"]))
    assert "\n" not in str(e.value) and "no checkpoint at" in str(e.value)
    assert not out.exists()
    # A checkpoint of another architecture (here: a 2-layer drafter) is refused the same way.
    sft = tmp_path / "sft"
    train(
        compose_preset(
            "eagle3", [*small_overrides(train_env, sft, steps=2), "export.enabled=false"]
        )
    )
    with pytest.raises(CheckpointError, match="another architecture"):
        train(compose_preset("eagle3", [*base, "drafter.num_layers=2", f"trainer.init_from={sft}"]))
    assert not out.exists()


# ---- the stage end to end, after a trained drafter (slow: the session's zoo runs) -------------
OPD_SHORT = [
    "trainer.max_steps=8",
    "trainer.save_every=4",
    "trainer.log_every=2",
    "trainer.warmup_steps=2",
    "trainer.progress=false",
    "opd.refresh_every=4",
    "opd.num_prompts=6",
    "opd.max_new_tokens=40",
    "data.batch_size=4",
    "data.eval_batches=2",
    "export.verify_prompts=8",
    "export.verify_max_new_tokens=32",
]
# (OPD preset, the SFT run it starts from: a kind's zoo run or a preset's short recipe, and
# what the OPD preset must change to match that run's drafter)
CASES = {
    "eagle3": ("eagle3_opd", ("zoo", "eagle3"), ["drafter.ttt_steps=3"]),
    "dflash": ("dflash_opd", ("zoo", "dflash"), ["drafter.block_size=8"]),
    "qwen3_vl_eagle3": (
        "eagle3_opd",
        ("preset", "qwen3_vl_eagle3"),
        ["target=qwen3_vl_tiny", "data=zoo_vl_caption", "drafter.draft_vocab_size=512"],
    ),
}


def _greedy_is_the_cached_targets(run_dir: Path, cfg) -> int:
    """Every T=0 rollout sequence's continuation is the argmax of the frozen target's output
    over the committed sequence (what the loss reads: its features and distributions are the
    target's own, images included); returns the sequences checked."""
    from drafttrain.frozen.head import target_logits
    from drafttrain.jobs.rollouts import Rollouts
    from drafttrain.jobs.setup import setup_drafter_job

    job = setup_drafter_job(cfg, torch.device("cpu"))
    feats = job.spec.init_drafter(cfg.drafter, job.init_context()).config.features
    r = Rollouts(cfg, job.target, feats, torch.device("cpu"), run_dir, 3)
    store = r.read("step_000000.json")
    checked = 0
    for rec, seq in zip(store.records, store.seqs):
        if rec["temperature"] != 0.0 or len(rec["tokens"]) < 2:
            continue
        P = seq.ids.shape[1] - len(rec["tokens"])
        argmax = target_logits(seq.tgt)[0, P - 1 : -1].argmax(-1).tolist()
        assert argmax == rec["tokens"], rec["prompt"]
        checked += 1
    return checked


@pytest.mark.parametrize("case", sorted(CASES))
def test_opd_stage_after_sft(case, zoo_run, preset_run, tmp_path):
    from drafttrain.jobs.job import run_job
    from drafttrain.jobs.train import train

    preset, (source, name), extra = CASES[case]
    sft = (zoo_run if source == "zoo" else preset_run)(name)
    out = tmp_path / "opd"
    over = [f"output_dir={out}", f"trainer.init_from={sft['run_dir']}", *OPD_SHORT, *extra]
    cfg = compose_preset(preset, over)
    summary = run_job(cfg)
    # Rollouts with the SFT drafter and after 4 steps, and the drafter accepted drafts there.
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == [
        "step_000000.json",
        "step_000004.json",
    ]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "rollout_al" in r)
    assert first["step"] == 0 and first["rollout_al"] >= 1.2, first
    assert {"rollout_al_t0", "rollout_al_t1"} <= set(first)
    losses = summary["losses"]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert _greedy_is_the_cached_targets(out, cfg) >= 3
    rep = summary["runner"]
    assert rep.lossless is True and rep.acceptance_length >= 1.2, rep.acceptance_length
    if case != "eagle3":
        return
    # Resume (R3 for the stage): from the step-4 checkpoint, the rollout file and cursor are
    # read back and the run reproduces the uninterrupted step-8 weights exactly.
    again = tmp_path / "resumed"
    shutil.copytree(out, again)
    shutil.rmtree(again / "checkpoints" / "step_000008")
    (again / "checkpoints" / "latest").write_text("step_000004\n")
    resumed = compose_preset(preset, [*over[1:], f"output_dir={again}", "resume=true"])
    resumed.export.enabled = False
    train(resumed)
    a = load_file(str(out / "checkpoints" / "step_000008" / "drafter.safetensors"))
    b = load_file(str(again / "checkpoints" / "step_000008" / "drafter.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_cli_refuses_a_missing_sft_run_before_hydra_writes(tmp_path):
    """`python -m drafttrain conf=eagle3_opd` before `conf=eagle3`: the entry point's precheck
    refuses it in one line before Hydra creates `output_dir` (`.hydra/`)."""
    from drafttrain.__main__ import precheck, rewrite_argv

    out = tmp_path / "out"
    argv = ["conf=eagle3_opd", f"trainer.init_from={tmp_path / 'none'}", f"output_dir={out}"]
    with pytest.raises(CheckpointError) as e:
        precheck(rewrite_argv(argv))
    assert "\n" not in str(e.value) and "no checkpoint at" in str(e.value)
    assert not out.exists()
