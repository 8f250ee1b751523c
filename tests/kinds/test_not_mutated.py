"""Nothing mutated behind its owner's back (issue 21 item 3, DESIGN convention 3: "never reuse
or mutate the target's position buffer in place"): every caller that receives positions or
features the target owns, each kind's objective (forward and backward), its proposer's
`admit` and `propose` and its `reference_drafts`, leaves them bitwise unchanged, on 1-D `[B, T]`
and M-RoPE `[3, B, T]` positions. Parametrized over the registry: a new kind is checked by
registering. (The reference loop, which holds views of the target's outputs, is checked in
`tests/kinds/test_kinds.py` and, with images, `tests/families/test_qwen3_vl_runner.py`.)
"""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.decoding.proposer import FirstPass, greedy_chooser
from draftinfer.registry import drafter_spec, registered_kinds
from drafttrain.registry import train_spec
from tests.support.kind_factories import (
    config_and_drafter_for,
    servable,
    small_target,
    small_target_dir,
)

KINDS = registered_kinds()
ROPES = ["1d", "mrope"]
B, T = 2, 11


def _positions(rope: str) -> torch.Tensor:
    """`[B, T]`, or a `[3, B, T]` table in the target's layout: a text run, then an image whose
    H and W rows differ from T (a 2 x 3 merged grid), then text advancing by max(h, w)."""
    if rope == "1d":
        return torch.arange(T).expand(B, T).clone()
    rows = [(p, p, p) for p in range(3)]
    rows += [(3, 3 + y, 3 + x) for y in range(2) for x in range(3)]
    rows += [(6 + i, 6 + i, 6 + i) for i in range(T - len(rows))]
    return torch.tensor(rows).T[:, None, :].expand(3, B, T).clone()


def _setup(kind: str, rope: str):
    """(training config, drafter, ids [B, T], the target's output for them with its
    positions), on the small target."""
    cfg, d = config_and_drafter_for(kind, small_target_dir(rope))
    # The features come from the 1-D twin of the target (HF Llama runs no M-RoPE); the
    # positions handed over are the `[3, B, T]` table an M-RoPE target returns.
    target = small_target("1d")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, target.info.vocab_size, (B, T), generator=g)
    out = target(ids, Slots(torch.arange(B), torch.arange(T).expand(B, T)), d.config.features)
    return cfg, d, ids, replace(out, rope_pos=_positions(rope))


def _snapshot(obj) -> dict[str, torch.Tensor]:
    return {
        f.name: getattr(obj, f.name).clone()
        for f in fields(obj)
        if isinstance(getattr(obj, f.name), torch.Tensor)
    }


def _assert_same(obj, snap: dict[str, torch.Tensor], who: str) -> None:
    changed = [k for k, v in snap.items() if not torch.equal(getattr(obj, k), v)]
    assert not changed, f"{who} changed {changed} in place"


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("kind", KINDS)
def test_objective_leaves_target_output_unchanged(kind, rope):
    cfg, d, ids, out = _setup(kind, rope)
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
    before, batch_before = _snapshot(out), {k: v.clone() for k, v in batch.items()}
    obj = train_spec(kind).objective(d.train(), cfg, "eager")
    torch.manual_seed(0)
    loss, _ = obj(batch, out)
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None for p in d.parameters())
    _assert_same(out, before, f"{kind}'s objective")
    assert all(torch.equal(batch[k], v) for k, v in batch_before.items())


def _first_pass(d, ids, out) -> FirstPass:
    """The prefill's first pass (left-padded: request 1 starts 3 rows later)."""
    cache_pos = torch.arange(T - 1).expand(B, T - 1).clone()
    cache_pos[1, :3] = -1
    return FirstPass(
        torch.arange(B), ids[:, 1:], out.features[:, :-1], cache_pos, out.rope_pos[..., :-1]
    )


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("kind", KINDS)
def test_proposer_leaves_first_pass_unchanged(kind, rope):
    _, d, ids, out = _setup(kind, rope)
    d.eval().requires_grad_(False)
    fp = _first_pass(d, ids, out)
    before = _snapshot(fp)
    prop = drafter_spec(kind).proposer_class(d, B, 64, torch.device("cpu"), torch.float32)
    pending = prop.admit(fp)
    _assert_same(fp, before, f"{kind}'s admit")
    k = max(k for k in (1, 2, 3) if servable(kind, d.config, k))
    pending_before = _snapshot(pending)
    drafts, _ = prop.propose(pending, torch.full((B,), k), k)
    assert drafts.shape == (B, k)
    _assert_same(pending, pending_before, f"{kind}'s propose")
    _assert_same(fp, before, f"{kind}'s propose")
    assert torch.equal(out.rope_pos, _positions(rope))  # the target's table itself


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("kind", KINDS)
def test_reference_drafts_leave_inputs_unchanged(kind, rope):
    _, d, ids, out = _setup(kind, rope)
    d.eval().requires_grad_(False)
    # One request's rows [R]: the views the reference loop hands over (no copies).
    r_ids, feats, pos = ids[0, 1:], out.features[0, :-1], out.rope_pos[..., 0, :-1]
    before = [t.clone() for t in (r_ids, feats, pos, out.rope_pos, out.features)]
    k = max(k for k in (1, 2, 3) if servable(kind, d.config, k))
    with torch.no_grad():
        drafts, _ = drafter_spec(kind).proposer_class.reference_drafts(
            d, r_ids, feats, pos, k, greedy_chooser
        )
    assert len(drafts) == k
    after = (r_ids, feats, pos, out.rope_pos, out.features)
    assert all(torch.equal(a, b) for a, b in zip(after, before)), f"{kind} reference_drafts"
