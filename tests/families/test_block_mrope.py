"""Block drafters (`dflash`) on Qwen3-VL (issue 22 item 5): M1/M2-style checks of where the
drafter's layers rotate block slots and context keys, at the layer, against transformers'
`get_rope_index` of the sequence (context rows) and of the same sequence extended by the
block's tokens (block slots: the anchor and its mask tokens, as text tokens after the committed
prefix), rotated by transformers' Qwen3-VL rotary (`tests/support/block_positions.py`). In the
runner (the engine's rounds on an image prompt) and in training (the objective's block
forward). Wrong positions fail the same checks (1-D cache-index positions, shown below).

Also the runner option `drafter_positions=1d` (`draftinfer.models.rope.serve_positions_1d`): plain
RoPE at the T row, as an engine that strips `mrope_section` serves the drafter (vLLM's
`positions[0]`), against transformers' plain Llama rotary; `run_eval` measures the AL of both.
"""

from __future__ import annotations

import pytest
import torch

from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.files.errors import ConfigError
from draftinfer.files.loading import load_native_target
from draftinfer.models.rope import serve_positions_1d
from tests.support.block_positions import (
    AttentionCapture,
    hf_plain_rope,
    hf_rotate,
    hf_table,
    unrotated,
    unrotated_context_keys,
)
from tests.support.kind_factories import (
    config_and_drafter_for,
    kinds_for_family,
    randomized,
    small_target_dir,
    small_vl_dir,
)
from tests.support.vl_drafters import build_drafter, target_window
from tests.support.vl_fixtures import IMG, image_tokens, mm_inputs, save_tiny_vl

KIND = "dflash"
GRID = [[1, 4, 6]]  # 6 merged tokens; positions advance by max(4, 6) // 2 = 3
PROMPT = [28, 216, 69, 20, *image_tokens(GRID[0]), 21]
MM = mm_inputs(PROMPT, GRID, seed=11)
MAX_LEN = 64
TOL = dict(atol=1e-4, rtol=1e-4)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_native_target(
        save_tiny_vl(tmp_path_factory.mktemp("qwen3_vl")), "cpu", torch.float32, 1, MAX_LEN
    )


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
    spec, cfg, d = build_drafter(KIND, target, tmp_path_factory.mktemp(KIND))
    randomized(d)  # O(1) weights: a wrong rotation is not lost among tiny numbers
    return spec, cfg, d.requires_grad_(False)


def test_block_kinds_pair_with_qwen3_vl():
    assert KIND in kinds_for_family("qwen3_vl")


def cache_index_positions(n: int, start: int = 0) -> torch.Tensor:
    """The wrong convention: the cache index on every axis (no image grid, no delta)."""
    return torch.arange(start, start + n)[None].expand(3, n)


def check_block_call(d, call, live: torch.Tensor, want: torch.Tensor) -> None:
    """A block forward's captured layer call rotated its live slots (`live [n]` bool) at `want`
    `[3, n]`: its queries and the block's own keys."""
    q0, k0 = unrotated(call)
    q_ref, k_ref = hf_rotate(d, q0, k0, want[:, None])
    torch.testing.assert_close(call["q"][:, live], q_ref[:, live], **TOL)
    torch.testing.assert_close(call["k"][:, live], k_ref[:, live], **TOL)


def test_runner_block_slots_and_context_keys_at_get_rope_index(target, drafter):
    """The engine's rounds on an image prompt (k = 3, drafts mostly rejected by a random
    drafter, so many rounds): in every block forward, every layer rotates slot s of the block
    of the anchor at cache index A at transformers' position of token A + s of the committed
    prefix extended by the block's tokens; the context keys in the drafter's cache at cache
    index i are rotated at transformers' position of token i (image rows at their grid
    positions). 1-D cache-index positions fail both checks."""
    _, _, d = drafter
    c = d.config
    dec = SpecDecoder(target, d, 3, max_batch=1, max_model_len=MAX_LEN, prefill_chunk=5)
    prop = dec.proposer
    block, blocks = prop._block, []

    def spy(drafter_, kc, vc, ids, rope, rows, cache, anchor, block_end, attn_len):
        cap = AttentionCapture(d)
        try:
            out = block(drafter_, kc, vc, ids, rope, rows, cache, anchor, block_end, attn_len)
        finally:
            cap.remove()
        blocks.append((cache[0].clone(), ids[0].clone(), cap.calls))
        return out

    prop._block = spy
    out = dec.generate([Request(PROMPT, max_tokens=14, mm_inputs=MM)])[0][0]
    seq = PROMPT + out.token_ids
    hf_cfg = target.config.hf_config
    assert len(blocks) >= 4
    checked = 0
    for cache, ids, calls in blocks:
        A = int(cache[0])  # the anchor's cache index: tokens 0..A are committed
        assert int(ids[0]) == seq[A]
        n = cache.shape[0]
        live = cache >= 0
        want = hf_table(hf_cfg, seq[: A + 1] + [c.mask_token_id] * (n - 1), GRID)[:, A:]
        assert torch.equal(want, want[:1].expand(3, n))  # text slots: equal axes ...
        assert int(want[0, 0]) != A  # ... at the request's delta, not the cache index
        assert len(calls) == c.num_hidden_layers
        for call in calls:
            check_block_call(d, call, live, want)
            with pytest.raises(AssertionError):
                check_block_call(d, call, live, cache_index_positions(n, A))
            checked += 1
    assert checked >= 4 * c.num_hidden_layers
    # Context keys: cache indices 0..A_last - 1 hold the committed rows' context.
    A_last = int(blocks[-1][0][0])
    _, _, tgt = target_window(target, [seq], [MM], c.features)
    table = hf_table(hf_cfg, seq, GRID)[:, :A_last]
    image = torch.tensor(seq[:A_last]) == IMG
    assert image.sum() == 6 and not torch.equal(table[1, image], table[0, image])
    for layer, k0 in enumerate(unrotated_context_keys(d, tgt.features[:, :A_last])):
        got = prop.cache.k[layer][0, :A_last][None]
        _, k_ref = hf_rotate(d, k0, k0, table[:, None])
        torch.testing.assert_close(got, k_ref, **TOL)
        _, k_bad = hf_rotate(d, k0, k0, cache_index_positions(A_last)[:, None])
        assert not torch.allclose(got[:, image], k_bad[:, image], **TOL)


def test_training_block_slots_and_context_keys_at_get_rope_index(target, drafter):
    """The objective's block forward over an image+text sequence: the block of anchor a puts
    slot s at transformers' position of token a + s of `x_0..x_a` extended by the mask tokens,
    in every layer; the context keys of row j are rotated at transformers' position of token j
    (image rows included)."""
    spec, cfg, d = drafter
    c = d.config
    seq = PROMPT + [30 + i for i in range(10)]
    ids, _, tgt = target_window(target, [seq], [MM], c.features)
    hf_cfg = target.config.hf_config
    table = hf_table(hf_cfg, seq, GRID)
    first_text = len(PROMPT) - 1  # the token after the vision end... and later text anchors
    anchors = [first_text, first_text + 1, first_text + 5]
    n = 4
    obj = spec.objective(d, cfg, "eager")
    kv_seen: list = []
    context_kv = d.context_kv

    def context_spy(ctx, rope_pos):
        kv_seen.extend(context_kv(ctx, rope_pos))
        return kv_seen

    d.context_kv = context_spy
    cap = AttentionCapture(d)
    try:
        obj.forward_blocks(ids, tgt.features, tgt.rope_pos, torch.tensor([anchors]), n)
    finally:
        cap.remove()
        del d.context_kv
    assert len(cap.calls) == c.num_hidden_layers
    for call in cap.calls:
        q0, k0 = unrotated(call)
        for b, a in enumerate(anchors):
            want = hf_table(hf_cfg, seq[: a + 1] + [c.mask_token_id] * (n - 1), GRID)[:, a:]
            rows = slice(b * n, (b + 1) * n)
            q_ref, k_ref = hf_rotate(d, q0[:, rows], k0[:, rows], want[:, None])
            torch.testing.assert_close(call["q"][:, rows], q_ref, **TOL)
            torch.testing.assert_close(call["k"][:, rows], k_ref, **TOL)
    image = torch.tensor(seq) == IMG
    for (k, _), k0 in zip(kv_seen, unrotated_context_keys(d, tgt.features)):
        _, k_ref = hf_rotate(d, k0, k0, table[:, None])
        torch.testing.assert_close(k, k_ref, **TOL)
        _, k_bad = hf_rotate(d, k0, k0, cache_index_positions(len(seq))[:, None])
        assert not torch.allclose(k[:, image], k_bad[:, image], **TOL)


# ---- serving with 1-D positions (an engine that strips mrope_section) --------------------
def test_serve_positions_1d_is_plain_rope_at_the_t_row():
    """After `serve_positions_1d`, the drafter's rotary gives transformers' plain Llama RoPE
    at row T of the `[3, N]` positions: unchanged on text rows (equal axes), changed on
    image rows; a drafter without M-RoPE is a one-line error."""
    _, d = config_and_drafter_for(KIND, small_vl_dir())
    rows = [(p, p, p) for p in range(3)] + [(3, 3 + y, 3 + x) for y in range(2) for x in range(3)]
    rows += [(6 + i, 6 + i, 6 + i) for i in range(4)]
    pos = torch.tensor(rows).T[:, None, :]  # [3, 1, 13]
    cos0, sin0 = d.rotary(pos)
    assert serve_positions_1d(d) == 1
    cos, sin = d.rotary(pos)
    hc, hs = hf_plain_rope(d.config.head_dim, d.config.rope_theta, pos[0])
    torch.testing.assert_close(cos, hc, **TOL)
    torch.testing.assert_close(sin, hs, **TOL)
    text = torch.tensor([r[0] == r[1] == r[2] for r in rows])
    torch.testing.assert_close(cos[:, text], cos0[:, text])
    assert not torch.allclose(cos[:, ~text], cos0[:, ~text])
    d.rotary.reset_parameters("cpu")  # (meta-device builds recompute the tables: still T only)
    torch.testing.assert_close(d.rotary(pos)[0], hc, **TOL)
    _, text_drafter = config_and_drafter_for(KIND, small_target_dir("1d"))
    with pytest.raises(ConfigError, match="no M-RoPE rotary") as e:
        serve_positions_1d(text_drafter)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_run_eval_measures_the_1d_positions_cost(tmp_path):
    """`run_eval` (`python -m draftinfer`) on image+text `messages` data with a trained block
    drafter, as trained and with `drafter_positions=1d`: both lossless (drafts never change the
    output), the 1-D run labelled in its report and table."""
    from dataclasses import replace

    from draftinfer.decoding.baseline import greedy_generate
    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.prompts import load_prompts
    from draftinfer.evaluation.run import format_report, run_eval
    from draftinfer.files.checkpoint import write_drafter
    from draftinfer.registry import family_spec
    from tests.support.vl_data_fixtures import make_vl_target, write_vl_chat
    from tests.support.vl_drafters import train

    tdir = make_vl_target(tmp_path / "target")
    data = write_vl_chat(tmp_path / "data", n_train=1, n_test=6)
    tgt = load_native_target(tdir, "cpu", torch.float32, 6, 256)
    prompts, _ = load_prompts(str(data), "test", 6, family_spec("qwen3_vl"), str(tdir), 254)
    mm = [p.mm_inputs for p in prompts]
    eos = tgt.config.eos_token_ids
    cont = greedy_generate(tgt, [p.ids for p in prompts], 16, eos, mm_inputs=mm)
    spec, cfg, d = build_drafter(KIND, tgt, tmp_path / "build")
    train(spec, cfg, d, tgt, [p.ids + c for p, c in zip(prompts, cont)], mm)
    write_drafter(tmp_path / "export", d, {"target": str(tdir)}, dtype=torch.float32)
    cfg = InferConfig(
        drafter=str(tmp_path / "export"),
        prompts=str(data),
        num_prompts=6,
        k=3,
        batch_size=4,
        max_new_tokens=16,
        max_model_len=256,
        prefill_chunk=16,
        dtype="float32",
        device="cpu",
        check_reference=True,
        progress=False,
    )
    native = run_eval(cfg)
    one_d = run_eval(replace(cfg, drafter_positions="1d"))
    print("AL native", native.acceptance_length, "1d", one_d.acceptance_length)
    assert native.lossless and one_d.lossless and native.image_prompts == 5
    assert native.acceptance_length > 1.1  # drafts accepted (measured 1.27: B = 16, 60 steps)
    assert "drafter_positions" not in native.extra and one_d.extra["drafter_positions"] == "1d"
    assert "drafter positions" in format_report(one_d)
    assert "drafter positions" not in format_report(native)
    with pytest.raises(ConfigError, match="drafter_positions must be one of"):
        run_eval(replace(cfg, drafter_positions="2d"))
