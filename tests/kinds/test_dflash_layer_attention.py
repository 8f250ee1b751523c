"""Per-layer attention of the block drafter, layer by layer (issue 51 item 4; REFERENCES A1
"Sliding window", "vLLM causality rule", "Speculators SWA pitfall").

vLLM #47745 turned one global causal flag into `dflash_config.causal=true`, which made the
*full-attention* layers of a mixed drafter causal too. The bug class: a per-layer option read
as a global one. Here every layer of a drafter that mixes window and full-attention layers is
checked on its own, in training (`drafttrain/kinds/dflash/blocks.py`, eager and flex) and in the
runner (`draftinfer/kinds/dflash/proposer.py` over its KV cache):

1. the export is read the way vLLM reads it (`engine_readers.vllm_dflash_layer_attention`:
   `use_swa`/`swa_window_size`, else `layer_types` + `sliding_window`; causality `is_causal`,
   else `dflash_config.causal`, else "sliding => causal"), and what it resolves per layer equals
   the options' definition: a window layer is causal inside the block with window W; a full
   layer is bidirectional unless the JetSpec causal block is on;
2. each layer's input and output are captured with forward hooks while our code runs, and the
   layer is recomputed from the exported tensors (`engine_readers.BlockDrafterFiles.layer`)
   with the mask written from the engines' rule (`engine_readers.block_mask_by_positions`:
   context strictly before the anchor's position, the block's own slots all or causally, keys
   within W of the query's position in a window layer) - never with our mask builder;
3. the check can fail: the same layer recomputed with the #47745 mask (every layer causal) or
   with the window dropped differs from what our layer did, wherever that mask differs.

Option combinations (parametrized):
- layer layout: `[sliding, full, sliding]`, `[full, sliding, full]` and all sliding (the one
  layout written with vLLM's `use_swa` / `swa_window_size` too), window 3 (it bites in the
  context and inside the block);
- `causal_block` (JetSpec) off / on;
- DSpark's sample-from-anchor layout (`dspark`: the anchor slot drafts, so the runner's block
  is k slots instead of k + 1; Markov and confidence heads on) off / on.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from draftinfer.files.checkpoint import write_drafter
from drafttrain.registry import train_spec
from tests.support.dflash import randomize_heads, runner_logits
from tests.support.engine_readers import (
    BlockDrafterFiles,
    block_mask_by_positions,
    vllm_dflash_layer_attention,
)
from tests.support.kind_factories import small_drafter

W = 3  # sliding window
LAYOUTS = {
    "SFS": ["sliding_attention", "full_attention", "sliding_attention"],
    "FSF": ["full_attention", "sliding_attention", "full_attention"],
    "SSS": ["sliding_attention"] * 3,
}
CASES = list(itertools.product(LAYOUTS, (False, True), (False, True)))


def _drafter(layout: str, causal: bool, dspark: bool):
    extra = {"dspark": True, "markov_rank": 5} if dspark else {}
    return randomize_heads(
        small_drafter(
            "dflash",
            num_layers=3,
            target_layer_ids=[1, 2],
            layer_types=LAYOUTS[layout],
            sliding_window=W,
            causal_block=causal,
            **extra,
        )
    )


def _exported(d, tmp_path):
    write_drafter(tmp_path, d, {"target": "t"}, dtype=torch.float32)
    return BlockDrafterFiles.read(tmp_path)


def _inputs(d, T=16, seed=4):
    g = torch.Generator().manual_seed(seed)
    c = d.config
    ids = torch.randint(0, c.vocab_size, (1, T), generator=g)
    feats = 2 * torch.randn(1, T, c.features.width(c.hidden_size), generator=g)
    return ids, feats


class _Capture:
    """Forward hooks on every drafter layer: each call's (input, output) `[B, S, H]`."""

    def __init__(self, d):
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in d.layers]
        self.handles = [
            layer.register_forward_hook(
                lambda _m, args, out, i=i: self.calls[i].append(
                    (args[0].detach().clone(), out.detach().clone())
                )
            )
            for i, layer in enumerate(d.layers)
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _check_layers(files, io, ctx, ctx_pos, block_pos, want_attention) -> None:
    """Each layer's output our code produced `io[i] = (x_in [n, H], x_out [n, H])` equals the
    layer recomputed from the files with the engines' mask of the (causal, window) vLLM reads
    for it; the wrong masks (#47745's global causal flag, a dropped window) give other numbers
    wherever they differ from the right one."""
    for i, ((x_in, x_out), (causal, window)) in enumerate(zip(io, want_attention, strict=True)):
        mask = block_mask_by_positions(ctx_pos, block_pos, causal, window)
        got = files.layer(i, x_in, ctx, ctx_pos, block_pos, mask)
        torch.testing.assert_close(got, x_out.float(), rtol=1e-4, atol=1e-4, msg=f"layer {i}")
        for wrong in ((True, window), (causal, None)):
            bad = block_mask_by_positions(ctx_pos, block_pos, *wrong)
            if torch.equal(bad, mask):
                continue
            other = files.layer(i, x_in, ctx, ctx_pos, block_pos, bad)
            assert float((other - x_out).abs().max()) > 1e-3, (i, wrong)


@pytest.mark.parametrize("layout, causal, dspark", CASES)
def test_export_writes_each_layers_attention_as_vllm_reads_it(layout, causal, dspark, tmp_path):
    d = _drafter(layout, causal, dspark)
    files = _exported(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    types = LAYOUTS[layout]
    assert cfg["layer_types"] == types
    assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == W
    dc = cfg["dflash_config"]
    # `use_swa` makes every layer a window layer in vLLM: written only when every layer is
    # one. `is_causal` / `causal: false` would override the sliding layers' causality: only
    # `causal: true` (JetSpec) is written.
    if layout == "SSS":
        assert dc["use_swa"] is True and dc["swa_window_size"] == W
    else:
        assert "use_swa" not in dc and "swa_window_size" not in dc
    assert "is_causal" not in cfg
    assert dc.get("causal") is (True if causal else None)
    assert bool(dc.get("sample_from_anchor")) is dspark
    want = [
        (causal or t == "sliding_attention", W if t == "sliding_attention" else None) for t in types
    ]
    assert vllm_dflash_layer_attention(files.cfg) == want
    assert [(d.config.layer_causal(i), d.config.layer_window(i)) for i in range(3)] == want
    # The trap this guards: a full layer read as causal while the block is not.
    if not causal and layout != "SSS":
        assert any(not c for c, w in want if w is None)
    # Our loader reads the same per-layer attention back.
    from draftinfer.files.checkpoint import read_drafter_config

    _, arch, _ = read_drafter_config(tmp_path)
    assert [(arch.layer_causal(i), arch.layer_window(i)) for i in range(3)] == want


@pytest.mark.parametrize("layout, causal, dspark", CASES)
def test_runner_attends_per_layer_as_the_engines_read_it(layout, causal, dspark, tmp_path):
    d = _drafter(layout, causal, dspark)
    files = _exported(d, tmp_path)
    want = vllm_dflash_layer_attention(files.cfg)
    ids, feats = _inputs(d)
    anchor = 8  # rows 0..8 committed; the anchor token ids[9] at position 9
    k = d.config.max_drafts
    cap = _Capture(d)
    try:
        with torch.no_grad():
            chosen = torch.arange(k) + 3  # any tokens: the block forward precedes the choices
            runner_logits(d, ids, feats, torch.arange(ids.shape[1])[None], anchor, k, chosen)
    finally:
        cap.remove()
    n = d.config.block_slots(k)
    assert n == (k if dspark else k + 1)
    io = []
    for calls in cap.calls:
        assert len(calls) == 1  # one block forward (the admit writes context only)
        x_in, x_out = calls[0]
        assert x_in.shape[:2] == (1, n)
        io.append((x_in[0], x_out[0]))
    T = anchor + 1
    ctx_pos, block_pos = torch.arange(T), T + torch.arange(n)
    with torch.no_grad():
        _check_layers(files, io, files.context(feats[0, :T]), ctx_pos, block_pos, want)


@pytest.mark.parametrize("backend", ["eager", "flex"])
@pytest.mark.parametrize("layout, causal, dspark", CASES)
def test_training_attends_per_layer_as_the_engines_read_it(
    layout, causal, dspark, backend, tmp_path
):
    """Two blocks in one forward (anchors 5 and 9, block 16 slots): each block's rows, layer by
    layer, against the engines' mask of that block alone (no block sees another)."""
    d = _drafter(layout, causal, dspark)
    files = _exported(d, tmp_path)
    want = vllm_dflash_layer_attention(files.cfg)
    spec = train_spec("dflash")
    cfg = spec.config_class(dspark=True, markov_rank=5) if dspark else spec.config_class()
    obj = spec.objective(d, cfg, backend)
    ids, feats = _inputs(d)
    anchors, n = [5, 9], d.config.block_size
    cap = _Capture(d)
    try:
        with torch.no_grad():
            obj.forward_blocks(
                ids, feats, torch.arange(ids.shape[1])[None], torch.tensor([anchors]), n
            )
    finally:
        cap.remove()
    for b, a in enumerate(anchors):
        io = []
        for calls in cap.calls:
            assert len(calls) == 1
            x_in, x_out = calls[0]
            assert x_in.shape[:2] == (1, len(anchors) * n)
            rows = slice(b * n, (b + 1) * n)
            io.append((x_in[0, rows], x_out[0, rows]))
        ctx_pos, block_pos = torch.arange(a), a + torch.arange(n)
        with torch.no_grad():
            _check_layers(files, io, files.context(feats[0, :a]), ctx_pos, block_pos, want)
