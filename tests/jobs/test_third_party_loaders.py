"""Third-party loaders read our exports as they are written: vllm-project/speculators 0.9.0's
own `from_pretrained` on the `speculators/` folder of each kind's trained zoo export (the folder
is the working directory, where its recorded verifier resolves; nothing is edited or passed
but `dtype=float32`), then its own forward on the inputs of our drafter's first pass, compared
in fp32: logits within fp32 noise (1e-4; the max difference is printed) and drafts equal.

speculators runs in its own virtualenv (`tests/support/speculators_env.py`; `.ci/run` creates
it), in a subprocess. The tests skip only when that venv is absent, which CI never is.
Kinds are every registered kind whose spec writes a speculators layout; what each speculators
model type is compared on is `SPECULATORS_CHECKS` (a kind with a new speculators type adds a
check there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftinfer.decoding.proposer import FirstPass
from draftinfer.files.checkpoint import SPECULATORS_DIR
from draftinfer.models.layers import causal_attention
from draftinfer.registry import drafter_spec
from tests.support.engine_readers import speculators_kinds
from tests.support.speculators_env import (
    VERIFIER_OWNED,
    run_speculators_side,
    speculators_python,
)

pytestmark = pytest.mark.slow

LOGIT_TOL = 1e-4  # fp32: the two implementations differ only in reduction order
T = 12  # first-pass rows


def _inputs(drafter, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `[1, T + 1]` (row i consumes ids[i + 1]) and aux features `[1, T, 3H]` of the
    size real taps have."""
    g = torch.Generator().manual_seed(seed)
    c = drafter.config
    V = c.vocab_size
    ids = torch.randint(0, V, (1, T + 1), generator=g)
    width = c.features.width(getattr(c, "target_hidden_size", c.hidden_size))
    feats = 4 * torch.randn(1, T, width, generator=g)
    return ids, feats


def _report(record_property, kind: str, diff: float) -> None:
    print(f"speculators 0.9.0 {kind}: max abs logit difference {diff:.3e} (fp32)")
    record_property(f"speculators_{kind}_max_abs_logit_diff", diff)


def _runner_first_pass(d, ids, feats, a: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's first pass after committing rows 0..a (row i consumes `(t_{i+1}, f_i)` at
    position i): the drafter's logits `[K, Dd]` and K drafts (target ids), read through the
    proposer's draft chooser."""
    prop = drafter_spec(d.config.kind).proposer_class(d, 2, 64, torch.device("cpu"), torch.float32)
    n = a + 1
    pos = torch.arange(n)[None]
    fp = FirstPass(torch.tensor([1]), ids[:, 1 : n + 1], feats[:, :n], pos, pos)
    got: list[torch.Tensor] = []

    def keep(logits, step):
        got.append(logits.clone())
        return logits.argmax(-1), None

    drafts, _ = prop.propose(prop.admit(fp), torch.tensor([K]), K, keep)
    return torch.cat(got), drafts[0]


def _check_eagle3(d, theirs: dict, record_property, kind: str) -> None:
    """EAGLE-3: every row of one TTT step against our drafter's first pass (row i's logits are
    draft 1 after committing rows 0..i)."""
    ids, feats = _inputs(d, SPECULATORS_CHECKS["eagle3"][0])
    pos = torch.arange(T)[None]
    with torch.no_grad():
        normed, _ = d(
            ids[:, 1:],
            d.project_features(feats),
            pos,
            lambda _i, q, k, v: causal_attention(q, k, v),
        )
        ours = d.logits(normed)[0]  # [T, Dd]
    got = theirs["logits"][0]
    assert got.shape == ours.shape
    diff = (got - ours).abs().max().item()
    _report(record_property, kind, diff)
    assert diff <= LOGIT_TOL
    assert ours.abs().max() > 1.0  # logits of real size, not a comparison of tiny numbers
    vocab = d.draft_vocab_ids()
    assert torch.equal(vocab[got.argmax(-1)], vocab[ours.argmax(-1)])  # drafts equal


def _check_peagle(d, theirs: dict, record_property, kind: str) -> None:
    """P-EAGLE: its (anchor, depth) slots against our runner's parallel first pass (the
    proposer's K drafts after each anchor)."""
    K = d.config.parallel_k
    slots = {(int(a), int(k)): j for j, (a, k) in enumerate(zip(theirs["anchor"], theirs["depth"]))}
    anchors = [a for a in range(T) if all((a, k) in slots for k in range(K))]
    assert len(anchors) >= 3
    ids, feats = _inputs(d, SPECULATORS_CHECKS["peagle"][0])
    vocab = d.draft_vocab_ids()
    diffs = []
    for a in anchors:
        ours, drafts = _runner_first_pass(d, ids, feats, a, K)  # [K, Dd], [K]
        got = theirs["logits"][0][[slots[(a, k)] for k in range(K)]]
        diffs.append((ours - got).abs().max().item())
        assert torch.equal(vocab[got.argmax(-1)], drafts)  # drafts equal
    diff = max(diffs)
    _report(record_property, kind, diff)
    assert diff <= LOGIT_TOL


def _check_dflash(d, theirs: dict, record_property, kind: str) -> None:
    """DFlash: speculators' block of every anchor a >= 1 (token x_a, context f_j for j < a:
    its rows pair token j with feature j) against our runner's first pass after committing
    rows 0..a-1 (row i consumes `(x_{i+1}, f_i)`, so its anchor token is x_a): the B - 1 mask
    slots' logits and drafts. Anchor 0 has no context, which the runner never drafts from."""
    B = d.config.block_size
    anchors = [int(a) for a in theirs["anchor"]]
    assert len(anchors) >= 3
    ids, feats = _inputs(d, SPECULATORS_CHECKS["dflash"][0])
    logits = theirs["logits"][0].view(len(anchors), B, -1)
    diffs = []
    for j, a in enumerate(anchors):
        if a == 0:
            continue
        ours, drafts = _runner_first_pass(d, ids, feats, a - 1, B - 1)  # [B-1, V], [B-1]
        got = logits[j, 1:]
        diffs.append((ours - got).abs().max().item())
        assert torch.equal(got.argmax(-1), drafts)  # drafts equal
    assert len(diffs) >= 2
    diff = max(diffs)
    _report(record_property, kind, diff)
    assert diff <= LOGIT_TOL


# Per speculators model type: the seed of the shared inputs and our side's comparison.
SPECULATORS_CHECKS = {
    "eagle3": (0, _check_eagle3),
    "peagle": (1, _check_peagle),
    "dflash": (2, _check_dflash),
}


def _side_inputs(d, stype: str) -> dict[str, torch.Tensor]:
    """What the speculators side runs its forward on: the drafter rows of the same inputs our
    side uses (row i consumes ids[i + 1] and feature i, at position i)."""
    ids, feats = _inputs(d, SPECULATORS_CHECKS[stype][0])
    x = {"input_ids": ids[:, 1:], "hidden_states": feats, "position_ids": torch.arange(T)[None]}
    if stype == "dflash":  # DFlash rows pair token j with the target's feature of token j
        x["input_ids"] = ids[:, :T]
        x["verifier_hidden_size"] = torch.tensor(d.config.hidden_size)
    if stype == "peagle":
        x["num_depths"] = torch.tensor(d.config.parallel_k)
        x["verifier_hidden_size"] = torch.tensor(d.config.target_hidden_size)
    return x


@pytest.mark.parametrize("kind", speculators_kinds())
def test_speculators_loads_export_as_written_and_matches(kind_env, kind, tmp_path, record_property):
    if speculators_python() is None:
        pytest.skip("no speculators virtualenv (.ci-venvs/speculators; .ci/run creates it)")
    env = kind_env(kind)
    d, export = env["drafter"], Path(env["export"])
    folder = export / SPECULATORS_DIR
    cfg = json.loads((folder / "config.json").read_text())
    stype = cfg["speculators_model_type"]
    assert stype in SPECULATORS_CHECKS, f"no check for speculators type {stype!r}"
    theirs, meta = run_speculators_side(stype, folder, _side_inputs(d, stype), tmp_path)
    print(f"speculators side: {meta}")
    assert meta["speculators"] == "0.9.0" and meta["transformers"] == "5.19.0"
    # The verifier resolved as recorded (from a working directory apart from the export), and
    # nothing in the model came from anywhere but the folder, except speculators' own copies
    # of verifier weights.
    assert meta["verifier"] == cfg["speculators_config"]["verifier"]["name_or_path"]
    assert set(meta["not_in_folder"]) <= VERIFIER_OWNED, meta["not_in_folder"]
    assert meta["unused_in_folder"] == [], meta["unused_in_folder"]
    # What speculators loaded is our drafter: the shared embedding, the vocabulary maps and
    # every drafter tensor (the export is bf16; both sides read the same values).
    state = {k[len("state.") :]: v for k, v in theirs.items() if k.startswith("state.")}
    assert torch.equal(state["embed_tokens.weight"], d.embed_tokens.weight)
    for name, t in d.trainable_state_dict().items():
        assert torch.equal(state[name].to(t.dtype), t), name
    if "mask_token_id" in cfg:
        assert meta["mask_token_id"] == d.config.mask_token_id
    SPECULATORS_CHECKS[stype][1](d, theirs, record_property, kind)
