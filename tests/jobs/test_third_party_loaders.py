"""Third-party loaders read our exports as they are: vllm-project/speculators 0.9.0's
`from_pretrained` on the export's `speculators/` folder, then its own forward on the inputs of
our drafter's first pass, in fp32 (logits within 1e-4).

Nothing is installed at test time; without speculators the tests skip. It is not in the `dev`
extra because speculators 0.9.0 pins `transformers<=5.19` and `torch<=2.14.1` (pip would
change both); docs/training.md gives the install command.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftinfer.checkpoint import SPECULATORS_DIR
from draftinfer.layers import causal_attention
from draftinfer.proposer import FirstPass
from draftinfer.registry import drafter_spec
from tests.support.tiny_models import train_tiny_export

pytestmark = pytest.mark.slow

# The bound the brief sets for fp32: the two implementations differ only in reduction order.
LOGIT_TOL = 1e-4
T = 12  # first-pass rows


def _speculators():
    return pytest.importorskip(
        "speculators",
        reason="vllm-project/speculators is not installed (pip install --no-deps "
        "speculators==0.9.0 ...; see docs/training.md)",
    )


@pytest.fixture(scope="module")
def exports(train_env, tmp_path_factory):
    """`exports(kind)` -> (native target, drafter loaded from the export, export dir): a tiny
    run of `kind` exported in fp32 by `drafttrain.export` (aux taps distinct, as speculators
    requires; draft vocabulary smaller than the target's, so `d2t`/`t2d` are exercised)."""
    _speculators()
    made: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in made:
            out = tmp_path_factory.mktemp(f"spec_{kind}")
            target, drafter, _, export, _ = train_tiny_export(
                kind,
                train_env,
                out,
                3,
                "trainer.lr=3e-2",
                "drafter.aux_layer_ids=[1,3,5]",
                "export.dtype=float32",
            )
            made[kind] = (target, drafter, Path(export))
        return made[kind]

    return get


def _inputs(drafter, seed: int = 0):
    """Token ids `[1, T + 1]` (row i consumes ids[i + 1]), aux features `[1, T, 3H]`."""
    g = torch.Generator().manual_seed(seed)
    V, H = drafter.embed_tokens.weight.shape
    ids = torch.randint(0, V, (1, T + 1), generator=g)
    feats = torch.randn(1, T, 3 * drafter.config.target_hidden_size, generator=g)
    return ids, feats


def _load(cls, export: Path, train_env):
    model = cls.from_pretrained(str(export / SPECULATORS_DIR)).eval()
    cfg = model.config
    assert cfg.speculators_config.verifier.name_or_path == train_env["target"]
    return model


def _capture_lm_head(model) -> list[torch.Tensor]:
    """speculators' forward returns draft tokens; its logits are the `lm_head` outputs."""
    seen: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    return seen


def _check_weights(model, drafter) -> None:
    """What speculators loaded is our drafter: the shared embedding from the verifier, the
    vocabulary maps and every drafter tensor from the folder."""
    assert torch.equal(model.embed_tokens.weight, drafter.embed_tokens.weight)
    assert torch.equal(model.d2t, drafter.d2t) and torch.equal(model.t2d, drafter.t2d)
    theirs = model.state_dict()
    for name, t in drafter.trainable_state_dict().items():
        assert torch.equal(theirs[name], t), name


def _runner_first_pass(spec, d, ids, feats, a: int, K: int) -> torch.Tensor:
    """The runner's drafter logits `[K, Dd]` after committing rows 0..a (row i consumes
    `(t_{i+1}, f_i)` at position i), read through the proposer's draft chooser."""
    prop = spec.proposer_class(d, 2, 64, torch.device("cpu"), torch.float32)
    n = a + 1
    pos = torch.arange(n)[None]
    fp = FirstPass(torch.tensor([1]), ids[:, 1 : n + 1], feats[:, :n], pos, pos)
    got: list[torch.Tensor] = []

    def keep(logits, step):
        got.append(logits.clone())
        return logits.argmax(-1), None

    prop.propose(prop.admit(1, fp), torch.tensor([K]), K, keep)
    return torch.cat(got)


def _report(record_property, kind: str, diff: float) -> None:
    print(f"speculators 0.9.0 {kind}: max abs logit difference {diff:.3e} (fp32)")
    record_property(f"speculators_{kind}_max_abs_logit_diff", diff)


def test_speculators_eagle3_loads_export_and_matches(exports, train_env, record_property):
    from speculators.models.eagle3 import Eagle3DraftModel

    _, d, export = exports("eagle3")
    cfg = json.loads((export / SPECULATORS_DIR / "config.json").read_text())
    assert (
        cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] < d.config.vocab_size
    )
    model = _load(Eagle3DraftModel, export, train_env)
    _check_weights(model, d)
    ids, feats = _inputs(d)
    pos = torch.arange(T)[None]
    with torch.no_grad():  # our first pass: row i consumes (t_{i+1}, f_i) at pos_i
        normed, _ = d(
            ids[:, 1:],
            d.project_features(feats),
            pos,
            lambda _i, q, k, v: causal_attention(q, k, v),
        )
        ours = d.logits(normed)  # [1, T, Dd]
    seen = _capture_lm_head(model)
    with torch.no_grad():
        model(
            hidden_states=feats,
            input_ids=ids[:, 1:],
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=pos,
            ttt_steps=1,
        )
    assert len(seen) == 1 and seen[0].shape == ours.shape
    diff = (seen[0] - ours).abs().max().item()
    _report(record_property, "eagle3", diff)
    assert diff <= LOGIT_TOL
    assert ours.abs().max() > 1.0  # logits of real size, not a comparison of tiny numbers


def test_speculators_peagle_loads_ptd_export_and_matches(exports, train_env, record_property):
    from speculators.models.peagle import PEagleDraftModel
    from speculators.models.peagle.data import generate_cod_sample_indices

    target, d, export = exports("ptd")
    K = d.config.parallel_k
    model = _load(PEagleDraftModel, export, train_env)
    assert model.mask_token_id == d.config.mask_token_id
    _check_weights(model, d)
    ids, feats = _inputs(d, seed=1)
    # P-EAGLE's forward samples (anchor, depth) slots at random (COD sampling); with both keep
    # ratios at 1 and a fixed seed, the slots are known in advance by drawing them the same way.
    cod = {"num_depths": K, "down_sample_ratio": 1.0, "down_sample_ratio_min": 1.0}
    loss_mask = torch.ones(1, T)
    torch.manual_seed(5)
    anchor, depth = generate_cod_sample_indices(T, loss_mask, **cod)
    seen = _capture_lm_head(model)
    torch.manual_seed(5)
    with torch.no_grad():
        model(
            hidden_states=feats,
            input_ids=ids[:, 1:],
            document_ids=torch.zeros(1, T, dtype=torch.long),
            loss_mask=loss_mask,
            verifier_last_hidden_states=torch.zeros(1, T, target.info.hidden_size),
            **cod,
        )
    theirs = seen[0][0]  # [slots, Dd], slot j = (anchor[j], depth[j])
    slots = {(int(a), int(dd)): j for j, (a, dd) in enumerate(zip(anchor, depth))}
    # Our runner's first pass for committed rows 0..a: one forward, K drafts (row a, then the
    # K-1 mask slots at p_a + m), read through the proposer's draft chooser.
    spec = drafter_spec("ptd")
    diffs, anchors = [], [a for a in range(T) if all((a, dd) in slots for dd in range(K))]
    assert len(anchors) >= 3
    for a in anchors:
        ours = _runner_first_pass(spec, d, ids, feats, a, K)  # [K, Dd]
        diffs.append((ours - theirs[[slots[(a, dd)] for dd in range(K)]]).abs().max().item())
    diff = max(diffs)
    _report(record_property, "ptd", diff)
    assert diff <= LOGIT_TOL
