"""DSpark in vllm-project/speculators' own layout, loaded by speculators 0.9.0 itself (issue 51
item 1): `DSparkDraftModel.from_pretrained` (`speculators/models/dspark/`, registered as
`speculators_model_type: "dspark"`) reads our `speculators/` folder as written, in fp32, from a
working directory apart from it; its own training forward on the same inputs (every anchor of
the sequence but the last block's, slot s scored with the Markov bias of the ground-truth
token before it, `x[a + s]`) gives our runner's draft logits and confidences, anchor by
anchor, when our chooser takes those same tokens. Every Markov head type and confidence
input speculators has and we implement: `vanilla` and `gated` (`rnn`: neither serves it here),
with and without `confidence_head_with_markov`.

speculators runs in its own virtualenv (`tests/support/speculators_env.py`); without it the
test skips (CI creates it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftinfer.files.checkpoint import write_speculators
from tests.support.dflash import runner_logits, variant_drafter
from tests.support.kind_factories import small_embeddings, small_target_dir
from tests.support.speculators_env import (
    VERIFIER_OWNED,
    run_speculators_side,
    speculators_python,
)

pytestmark = pytest.mark.slow

LOGIT_TOL = 1e-4  # fp32: the two implementations differ only in reduction order
T = 24  # rows: speculators anchors every position but the last block's (24 - 16 = 8 blocks)


@pytest.mark.parametrize("head, with_markov", [("vanilla", False), ("gated", True)])
def test_speculators_dspark_loads_our_export_and_gives_our_logits(head, with_markov, tmp_path):
    if speculators_python() is None:
        pytest.skip("no speculators virtualenv (.ci-venvs/speculators; .ci/run creates it)")
    d = variant_drafter("dspark", markov_head_type=head, confidence_head_with_markov=with_markov)
    c = d.config
    B = c.block_size
    emb = small_embeddings(d)
    with torch.no_grad():  # the target's embedding and head, as a loaded export has them
        d.embed_tokens.weight.copy_(emb["input_embeddings"])
        d.lm_head.weight.copy_(emb["output_embeddings"])
    # The verifier: the small target's own directory (absolute), which speculators resolves.
    verifier = str(Path(small_target_dir("1d")).resolve())
    archs = json.loads((Path(verifier) / "config.json").read_text())["architectures"]
    folder = write_speculators(
        tmp_path / "export",
        d,
        verifier,
        archs,
        B,
        lambda: emb["input_embeddings"],
        torch.float32,
        lambda: emb["output_embeddings"],
    )
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark"
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, c.vocab_size, (1, T + 1), generator=g)
    feats = 4 * torch.randn(1, T, c.features.width(c.hidden_size), generator=g)
    # speculators' rows pair token j with the target's feature of token j.
    x = {
        "input_ids": ids[:, :T],
        "hidden_states": feats,
        "position_ids": torch.arange(T)[None],
        "verifier_hidden_size": torch.tensor(c.hidden_size),
    }
    theirs, meta = run_speculators_side("dspark", folder, x, tmp_path / "work")
    print(f"speculators side: {meta}")
    assert meta["speculators"] == "0.9.0"
    assert meta["verifier"] == verifier
    assert set(meta["not_in_folder"]) <= VERIFIER_OWNED, meta["not_in_folder"]
    assert meta["unused_in_folder"] == [], meta["unused_in_folder"]
    state = {k[len("state.") :]: v for k, v in theirs.items() if k.startswith("state.")}
    for name, t in d.trainable_state_dict().items():
        assert torch.equal(state[name].to(t.dtype), t), name
    assert torch.equal(state["embed_tokens.weight"], d.embed_tokens.weight)
    assert torch.equal(state["lm_head.weight"], d.lm_head.weight)
    if head == "gated":
        assert "markov_head.gate_proj.weight" in state

    anchors = [int(a) for a in theirs["anchor"]]
    logits = theirs["logits"][0].view(len(anchors), B, -1)
    conf = torch.sigmoid(theirs["confidence_logits"][0].view(len(anchors), B))
    diffs = []
    for j, a in enumerate(anchors):
        if a == 0:  # no context: the runner never drafts from there
            continue
        # Draft s + 1 (slot s) is followed by the ground-truth token a + s + 1, as in
        # speculators' teacher-forced Markov chain.
        chosen = ids[0, a + 1 : a + 1 + B]
        props: list = []
        with torch.no_grad():
            ours = runner_logits(
                d, ids, feats, torch.arange(T)[None], a - 1, B, chosen, props
            )  # [B, V]
        diffs.append(float((ours - logits[j]).abs().max()))
        assert torch.equal(ours.argmax(-1), logits[j].argmax(-1))
        torch.testing.assert_close(props[0].confidence[0], conf[j], rtol=1e-4, atol=1e-5)
    assert len(diffs) >= 5
    print(f"speculators 0.9.0 dspark ({head}): max abs logit difference {max(diffs):.3e}")
    assert max(diffs) <= LOGIT_TOL
    assert float(logits.abs().max()) > 1.0
