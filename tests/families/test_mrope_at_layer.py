"""M-RoPE where it is applied (issue 21 item 2): for every kind that pairs with Qwen3-VL, the
queries and keys its attention layers rotate, captured where each layer hands them to its
attention function (a pre-hook on every `draftinfer.models.layers.Attention` that wraps the `attn_fn`
it is called with), equal an oracle built from transformers' own Qwen3-VL rotary
(`Qwen3VLTextRotaryEmbedding` + `apply_rotary_pos_emb`) with the drafter's `mrope_section`, at
the `[3, N]` positions of an image prompt; and moving only the H/W rows of those positions
(T fixed) changes the drafter's outputs on image rows, so a drafter that rotated by T alone
would fail. Checked in the runner (the proposer's admission) and in training (the kind's
objective). The positions helper is not what is tested: the layers are.
"""

from __future__ import annotations

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.decoding.proposer import FirstPass
from draftinfer.models.layers import Attention
from draftinfer.registry import drafter_spec
from drafttrain.registry import train_spec
from tests.support.block_positions import hf_rotate
from tests.support.kind_factories import config_and_drafter_for, kinds_for_family, small_vl_dir

# Kinds whose drafter rows sit at the target's positions (+ a draft step); a block drafter's
# rows enter as context keys only and its queries are block slots: `test_block_mrope.py`
# checks those, at the layer, against transformers' `get_rope_index`.
KINDS = [k for k in kinds_for_family("qwen3_vl") if drafter_spec(k).mode != "block drafting"]
T = 12
IMAGE = range(3, 9)  # rows of a 2 x 3 merged image grid
OFFSETS = range(8)  # a layer may sit k draft steps ahead (TTT step / MTP module k: pos + k)


def positions(hw_shift: int = 0) -> torch.Tensor:
    """`[3, 1, T]`: text 0..2, a 2 x 3 image at (3, 3 + y, 3 + x), text from 6 on (advanced by
    max(h, w) = 3). `hw_shift` moves the image's H and W rows, T unchanged."""
    rows = [(p, p, p) for p in range(3)]
    rows += [(3, 3 + y + hw_shift, 3 + x + 2 * hw_shift) for y in range(2) for x in range(3)]
    rows += [(6 + i, 6 + i, 6 + i) for i in range(T - len(rows))]
    return torch.tensor(rows).T[:, None, :].clone()


class Capture:
    """Every attention call of a drafter: the layer's input and the q, k it rotated, taken
    from the `attn_fn` the layer calls (where RoPE has been applied), and its output."""

    def __init__(self, d):
        self.calls: list[dict] = []
        self.handles = []
        for m in d.modules():
            if isinstance(m, Attention):
                self.handles.append(m.register_forward_pre_hook(self._pre))
                self.handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args):
        x, cos, sin, attn_fn, idx = args
        call = {"module": module, "x": x.detach().clone()}
        self.calls.append(call)

        def spy(i, q, k, v):
            call["q"], call["k"] = q.detach().clone(), k.detach().clone()
            return attn_fn(i, q, k, v)

        return (x, cos, sin, spy, idx)

    def _post(self, module, args, out):
        self.calls[-1]["out"] = out.detach().clone()

    def remove(self):
        for h in self.handles:
            h.remove()


def unrotated(call) -> tuple[torch.Tensor, torch.Tensor]:
    m, x = call["module"], call["x"]
    lead = x.shape[:-1]
    q = m.q_proj(x).view(*lead, m.n_heads, m.head_dim)
    k = m.k_proj(x).view(*lead, m.n_kv, m.head_dim)
    if m.q_norm is not None:
        q, k = m.q_norm(q), m.k_norm(k)
    return q, k


def check_calls(d, calls: list[dict], pos: torch.Tensor) -> list[int]:
    """Each call's rotated q and k equal the oracle at the call's rows' positions plus one
    draft-step offset on all three axes (its first rows are rows 0.. of `pos`; rows past
    `pos`, a parallel drafter's mask slots in training, are not checked here); returns the
    offsets found, one per call."""
    found = []
    for c in calls:
        with torch.no_grad():
            q0, k0 = unrotated(c)
        n = min(q0.shape[1], pos.shape[-1])
        q0, k0, q, k = q0[:, :n], k0[:, :n], c["q"][:, :n], c["k"][:, :n]
        match = None
        for o in OFFSETS:
            q_ref, k_ref = hf_rotate(d, q0, k0, pos[..., :n] + o)
            if torch.allclose(q, q_ref, atol=1e-5, rtol=1e-5) and torch.allclose(
                k, k_ref, atol=1e-5, rtol=1e-5
            ):
                match = o
                break
        assert match is not None, "rotated q/k match no Qwen3-VL rotary at these positions"
        found.append(match)
    # Calls come in draft-step order: step 0 first, each later call at most one step further.
    assert found[0] == 0 and all(b - a in (0, 1) for a, b in zip(found, found[1:])), found
    return found


def vl_drafter(kind: str):
    cfg, d = config_and_drafter_for(kind, small_vl_dir())
    assert "mrope_section" in d.config.rope_scaling  # the drafter inherits the target's M-RoPE
    return cfg, d.eval().requires_grad_(False)


def runner_calls(kind: str, d, pos: torch.Tensor) -> list[dict]:
    """The proposer's admission of one prompt of T + 1 rows (its first T rows run the
    drafter at the target's positions of tokens 0..T-1)."""
    g = torch.Generator().manual_seed(1)
    V, H = d.config.vocab_size, d.config.target_hidden_size
    ids = torch.randint(0, V, (1, T + 1), generator=g)
    feats = torch.randn(1, T + 1, d.config.features.count * H, generator=g)
    pos = torch.cat([pos, pos[..., -1:] + 1], -1)  # the pending last row
    fp = FirstPass(torch.tensor([0]), ids, feats, torch.arange(T + 1)[None], pos)
    prop = drafter_spec(kind).proposer_class(d, 1, 64, torch.device("cpu"), torch.float32)
    cap = Capture(d)
    try:
        prop.admit(fp)
    finally:
        cap.remove()
    return cap.calls


@pytest.mark.parametrize("kind", KINDS)
def test_runner_layers_apply_qwen3_vl_mrope(kind):
    _, d = vl_drafter(kind)
    pos = positions()
    assert not torch.equal(pos[1, 0, IMAGE], pos[0, 0, IMAGE])  # H differs from T on images
    calls = runner_calls(kind, d, pos)
    assert calls, "the admission ran no attention layer"
    offsets = check_calls(d, calls, pos)
    print(kind, "runner offsets per call", offsets)
    # Moving H/W with T fixed changes every call's output on image rows (and nothing before).
    moved = runner_calls(kind, d, positions(hw_shift=2))
    for a, b in zip(calls, moved):
        img = [r for r in IMAGE if r < a["out"].shape[1]]
        assert not torch.allclose(a["out"][0, img], b["out"][0, img])
        torch.testing.assert_close(a["out"][0, :3], b["out"][0, :3])


def training_calls(kind: str, cfg, d, pos: torch.Tensor) -> list[dict]:
    """The kind's objective over one sequence of T tokens at `pos` (forward only)."""
    from tests.support.kind_factories import _frozen

    target = _frozen(small_vl_dir())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 200, (1, T), generator=g)  # text ids: no placeholder to embed
    cache_pos = torch.arange(T)[None]
    out = target(ids, Slots(torch.tensor([0]), cache_pos, pos), d.config.features)
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
    obj = train_spec(kind).objective(d, cfg, "eager")
    cap = Capture(d)
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            obj(batch, out)
    finally:
        cap.remove()
    return cap.calls


@pytest.mark.parametrize("kind", KINDS)
def test_training_layers_apply_qwen3_vl_mrope(kind):
    cfg, d = vl_drafter(kind)
    pos = positions()
    calls = training_calls(kind, cfg, d, pos)
    assert calls, "the objective ran no attention layer through `Attention`"
    # A training call holds the rows of step 0 / TTT step k / module k (and, for a parallel
    # drafter, its sampled mask slots after them, at their anchors' positions + depth).
    offsets = check_calls(d, calls, pos)
    print(kind, "training offsets per call", offsets)
    moved = training_calls(kind, cfg, d, positions(hw_shift=2))
    a, b = calls[0], moved[0]
    assert not torch.allclose(a["out"][0, list(IMAGE)], b["out"][0, list(IMAGE)])
