"""Native targets (static KV cache) against Hugging Face transformers on the same weights.

Logits must match HF within 1e-4 (fp32, CPU) through every cache path the runner uses: full
prefill, chunked prefill + one-token decode, ragged padded batches, permuted cache rows and
rewriting speculative positions (rollback without clearing). Greedy decoding must match
HF `generate(do_sample=False)` token for token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.decoding.baseline import greedy_generate
from draftinfer.files.errors import CheckpointError, ConfigError
from draftinfer.files.loading import load_native_target
from draftinfer.registry import FAMILIES
from tests.support.native_parity import hf_model, rand_ids, run

ATOL = 1e-4  # fp32 logits, our SDPA vs HF eager attention
TARGETS = ["tiny_llama3_dir", "tiny_qwen3_dir"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory):
    """Qwen2 (q/k/v bias, untied head), built like tests/tiny_models.py builds the others."""
    from transformers import Qwen2Config

    from tests.support.tiny_models import save_tiny_target

    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = save_tiny_target(cfg, tmp_path_factory.mktemp("qwen2"))
    # Random init leaves biases at zero; make them matter.
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for k in sd:
        if k.endswith(".bias"):
            sd[k] = torch.randn(sd[k].shape, generator=g) * 0.5
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """HF logits `[len(ids), V]` for one unpadded sequence."""
    return hf_model(str(path))(torch.tensor([ids])).logits[0].float()


def native(path: Path, max_batch: int = 4, max_seq_len: int = 64):
    return load_native_target(path, "cpu", torch.float32, max_batch, max_seq_len)


@pytest.mark.parametrize("which", [*TARGETS, "tiny_qwen2_dir"])
def test_full_prefill_matches_hf(which, request):
    path = request.getfixturevalue(which)
    model = native(path)
    seqs = [rand_ids(17, 0), rand_ids(17, 1)]
    logits, aux = run(model, seqs, [list(range(17))] * 2, [0, 1])
    assert aux is None and logits.dtype == torch.float32 and logits.shape == (2, 17, 512)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[b], hf_logits(path, s), atol=ATOL, rtol=0)


@pytest.mark.parametrize("which", TARGETS)
def test_chunked_prefill_then_decode_through_cache(which, request):
    path = request.getfixturevalue(which)
    model = native(path, max_batch=1)
    seq = rand_ids(23, 2)
    ref = hf_logits(path, seq)
    got = []
    for lo, hi in [(0, 7), (7, 12), (12, 13)] + [(i, i + 1) for i in range(13, 23)]:
        logits, _ = run(model, [seq[lo:hi]], [list(range(lo, hi))], [0])
        got.append(logits[0])
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("which", TARGETS)
def test_ragged_batch_with_padding_slots(which, request):
    """Rows of lengths 9, 4, 6 padded to 9 (right, left and interior padding slots), then a
    decode step where one row is padding; each valid slot equals its solo HF run."""
    path = request.getfixturevalue(which)
    model = native(path)
    s0, s1, s2 = rand_ids(10, 3), rand_ids(5, 4), rand_ids(7, 5)
    pad = 0
    ids = [s0[:9], s1[:4] + [pad] * 5, [pad] * 2 + s2[:3] + [pad] + s2[3:6]]
    pos = [list(range(9)), [0, 1, 2, 3] + [-1] * 5, [-1, -1, 0, 1, 2, -1, 3, 4, 5]]
    logits, _ = run(model, ids, pos, [0, 1, 2])
    torch.testing.assert_close(logits[0], hf_logits(path, s0[:9]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1, :4], hf_logits(path, s1[:4]), atol=ATOL, rtol=0)
    ref2 = hf_logits(path, s2[:6])
    torch.testing.assert_close(logits[2, 2:5], ref2[:3], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[2, 6:9], ref2[3:], atol=ATOL, rtol=0)
    assert torch.isfinite(logits).all()  # padding slots are garbage, but never NaN

    # Decode: rows 0 and 2 advance one token, row 1 is a padding slot this step.
    logits, _ = run(model, [[s0[9]], [pad], [s2[6]]], [[9], [-1], [6]], [0, 1, 2])
    torch.testing.assert_close(logits[0, 0], hf_logits(path, s0)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[2, 0], hf_logits(path, s2)[-1], atol=ATOL, rtol=0)
    # Row 1's padding step wrote nothing: its next real token continues cleanly.
    logits, _ = run(model, [[s1[4]]], [[4]], [1])
    torch.testing.assert_close(logits[0, 0], hf_logits(path, s1)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("which", TARGETS)
def test_cache_rows_in_any_order(which, request):
    """Requests live in cache rows 3, 0, 2; the next step lists them in another order."""
    path = request.getfixturevalue(which)
    model = native(path)
    seqs = [rand_ids(8, 6), rand_ids(8, 7), rand_ids(8, 8)]
    rows = [3, 0, 2]
    logits, _ = run(model, [s[:7] for s in seqs], [list(range(7))] * 3, rows)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[b], hf_logits(path, s[:7]), atol=ATOL, rtol=0)
    order = [2, 0, 1]
    logits, _ = run(model, [[seqs[i][7]] for i in order], [[7]] * 3, [rows[i] for i in order])
    for b, i in enumerate(order):
        torch.testing.assert_close(logits[b, 0], hf_logits(path, seqs[i])[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("which", TARGETS)
def test_rewrite_after_speculation_equals_fresh_run(which, request):
    """Write 5 speculative positions, then re-forward from an earlier position with other
    tokens: no cache clearing, yet logits equal a fresh run (stale entries are invisible)."""
    path = request.getfixturevalue(which)
    model = native(path, max_batch=2)
    prefix, spec, fix = rand_ids(6, 9), rand_ids(5, 10), rand_ids(4, 11)
    run(model, [prefix], [list(range(6))], [1])
    run(model, [spec], [list(range(6, 11))], [1])  # drafts at 6..10
    # Commit only 2 drafts (positions 6, 7); verify 3 new tokens at 8..10 ...
    logits, _ = run(model, [fix[:3]], [list(range(8, 11))], [1])
    ref = hf_logits(path, prefix + spec[:2] + fix[:3])
    torch.testing.assert_close(logits[0], ref[8:11], atol=ATOL, rtol=0)
    # ... then roll back further (commit length 7) and decode past the stale region.
    logits, _ = run(model, [[fix[3]]], [[7]], [1])
    ref = hf_logits(path, prefix + spec[:1] + fix[3:])
    torch.testing.assert_close(logits[0, 0], ref[-1], atol=ATOL, rtol=0)
    seq = prefix + spec[:1] + fix[3:]
    for p in range(8, 12):
        nxt = rand_ids(1, 100 + p)
        seq = seq + nxt
        logits, _ = run(model, [nxt], [[p]], [1])
        torch.testing.assert_close(logits[0, 0], hf_logits(path, seq)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("which", TARGETS)
def test_aux_taps_equal_hf_hidden_states(which, request):
    path = request.getfixturevalue(which)
    model = native(path)
    seq = rand_ids(12, 12)
    taps = [5, 0, 2, 2]  # any order, duplicates allowed, 0 = embeddings
    logits, aux = run(
        model,
        [seq[:5] + [0] * 7, seq],
        [[*range(5)] + [-1] * 7, [*range(12)]],
        [1, 0],
        aux_layer_ids=taps,
    )
    H = model.config.hidden_size
    assert aux.shape == (2, 12, len(taps) * H) and aux.dtype == torch.float32
    ref = hf_model(str(path))(torch.tensor([seq]), output_hidden_states=True).hidden_states
    for i, j in enumerate(taps):
        torch.testing.assert_close(aux[1, :, i * H : (i + 1) * H], ref[j][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(
            aux[0, :5, i * H : (i + 1) * H], ref[j][0, :5], atol=1e-5, rtol=0
        )
    assert run(model, [seq[:2]], [[0, 1]], [0], aux_layer_ids=[])[1].shape == (1, 2, 0)
    with pytest.raises(ConfigError, match=r"feature taps \[6\] out of range.*6 decoder layers"):
        run(model, [seq[:2]], [[0, 1]], [0], aux_layer_ids=[1, 6])
    # The final hidden state, pre- and post-norm (what MTP drafters consume).
    L = model.config.num_layers
    hf = hf_model(str(path))
    last_layer_out = {}
    handle = hf.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: last_layer_out.__setitem__(
            "h", out[0] if isinstance(out, tuple) else out
        )
    )
    ref = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    handle.remove()
    _, pre = run(model, [seq], [[*range(12)]], [0], final_hidden="pre_norm")
    _, post = run(model, [seq], [[*range(12)]], [0], aux_layer_ids=[2], final_hidden="post_norm")
    torch.testing.assert_close(pre[0], last_layer_out["h"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(post[0, :, H:], ref[L][0], atol=1e-5, rtol=0)  # post-norm
    torch.testing.assert_close(post[0, :, :H], ref[2][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("which", TARGETS)
def test_rope_position_is_apart_from_the_cache_index(which, request):
    """Slots: the cache reads only `cache_pos`, the rotary only `rope_pos`. Tokens written at
    cache indices 0.. with RoPE positions 100.. give HF's logits at position_ids 100.."""
    path = request.getfixturevalue(which)
    model = native(path, max_seq_len=32)
    seq = rand_ids(9, 13)
    ids, rows = torch.tensor([seq[:6]]), torch.tensor([0])
    cache = torch.arange(6)[None]
    out = model(ids, Slots(rows, cache, rope_pos=cache + 100))
    ref = hf_model(str(path))(torch.tensor([seq]), position_ids=torch.arange(100, 109)[None])
    torch.testing.assert_close(out.logits[0], ref.logits[0, :6].float(), atol=ATOL, rtol=0)
    assert torch.equal(out.rope_pos, cache + 100)
    # Continue in the cache at index 6 with RoPE position 106.
    step = model(
        torch.tensor([seq[6:9]]),
        Slots(rows, torch.arange(6, 9)[None], rope_pos=torch.arange(106, 109)[None]),
    )
    torch.testing.assert_close(step.logits[0], ref.logits[0, 6:].float(), atol=ATOL, rtol=0)
    # Default RoPE positions of a text target are the cache indices (padding at 0).
    pad = model(ids, Slots(rows, torch.tensor([[0, 1, 2, -1, -1, -1]])))
    assert pad.rope_pos.tolist() == [[0, 1, 2, 0, 0, 0]]


@pytest.mark.parametrize("which", TARGETS)
def test_greedy_generate_matches_hf_generate(which, request):
    path = request.getfixturevalue(which)
    hf = hf_model(str(path))
    prompts = [rand_ids(5, 20), rand_ids(11, 21), rand_ids(1, 22), rand_ids(8, 23)]

    def hf_greedy(n, eos):
        """One left-padded HF batch; per request: new tokens up to and including eos."""
        T = max(map(len, prompts))
        ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
        rows = out[:, T:].tolist()
        return [r[: r.index(eos) + 1] if eos in r else r for r in rows]

    # No stop token: fixed length. Then stop on a token request 1 actually emits mid-run.
    refs = hf_greedy(12, None)
    assert greedy_generate(native(path), prompts, 12, []) == refs
    stop = refs[1][4]
    refs = hf_greedy(12, stop)
    assert len(refs[1]) <= 5 and refs[1][-1] == stop
    model = native(path, max_batch=3)  # 4 prompts: two groups
    assert greedy_generate(model, prompts, 12, [stop]) == refs


def test_greedy_generate_stops_at_max_seq_len(tiny_llama3_dir):
    model = native(tiny_llama3_dir, max_batch=2, max_seq_len=10)
    full = greedy_generate(native(tiny_llama3_dir), [rand_ids(3, 30), rand_ids(7, 31)], 20, [])
    out = greedy_generate(model, [rand_ids(3, 30), rand_ids(7, 31)], 20, [])
    assert [len(o) for o in out] == [7, 3]  # total length capped at max_seq_len
    assert out == [full[0][:7], full[1][:3]]
    assert greedy_generate(model, [rand_ids(10, 32)], 5, []) == [[]]
    with pytest.raises(ValueError, match="exceeds max_seq_len=10"):
        greedy_generate(model, [rand_ids(11, 32)], 5, [])


def test_positions_past_max_seq_len_raise(tiny_qwen3_dir):
    model = native(tiny_qwen3_dir, max_batch=2, max_seq_len=16)
    run(model, [rand_ids(16, 40)], [list(range(16))], [0])  # exactly fills the cache
    with pytest.raises(
        ValueError, match=r"cache index 16 is out of range.*holds 16 positions.*never wrap"
    ):
        run(model, [[5]], [[16]], [0])
    with pytest.raises(ValueError, match="cache index -2 is invalid"):
        run(model, [[5]], [[-2]], [0])
    with pytest.raises(ValueError, match=r"cache row 2 out of range 0\.\.1"):
        run(model, [[5]], [[3]], [2])
    with pytest.raises(ValueError, match="attn_len=17"):
        run(model, [[5]], [[3]], [0], attn_len=17)


def test_fixed_attn_len_equals_default(tiny_llama3_dir):
    """The sync-free static-shape path (attn_len=max_seq_len, for CUDA graphs) is the same
    computation over a longer, masked key range."""
    a, b = native(tiny_llama3_dir, max_seq_len=32), native(tiny_llama3_dir, max_seq_len=32)
    seq = rand_ids(9, 41)
    pos = [list(range(9)), [*range(4), -1, -1, -1, -1, -1]]
    la, _ = run(a, [seq, seq], pos, [0, 1])
    lb, _ = run(b, [seq, seq], pos, [0, 1], attn_len=32)
    torch.testing.assert_close(la[0], lb[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(la[1, :4], lb[1, :4], atol=1e-5, rtol=0)
    la, _ = run(a, [[3], [4]], [[9], [4]], [0, 1])
    lb, _ = run(b, [[3], [4]], [[9], [4]], [0, 1], attn_len=32)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)
    # greedy_generate with a caller-supplied step (what a compiled step looks like).
    prompts = [rand_ids(5, 42), rand_ids(2, 43), rand_ids(9, 44)]
    ref = greedy_generate(a, prompts, 7, [])
    assert (
        greedy_generate(
            b, prompts, 7, [], step_fn=lambda i, p, r, a: b(i, Slots(r, p, attn_len=32)).logits
        )
        == ref
    )


@pytest.mark.gpu
@pytest.mark.parametrize("which", TARGETS)
def test_compiled_cuda_graph_step_matches_eager_and_hf(which, request):
    """The bench's compiled decode step (torch.compile reduce-overhead over a fixed attn_len,
    applied from outside the model) decodes the same tokens as eager and HF (fp32, CUDA)."""
    path = request.getfixturevalue(which)
    model = load_native_target(path, "cuda", torch.float32, 4, 48)
    prompts = [rand_ids(5, 60), rand_ids(11, 61), rand_ids(1, 62)]
    eager = greedy_generate(model, prompts, 20, [])
    for layer in model.model.layers:
        torch._dynamo.mark_static_address(layer.self_attn.k_cache)
        torch._dynamo.mark_static_address(layer.self_attn.v_cache)
    step = torch.compile(
        lambda i, p, r, a: model(i, Slots(r, p, attn_len=48)).logits,
        mode="reduce-overhead",
        dynamic=False,
    )
    for _ in range(2):  # record, then replay
        assert greedy_generate(model, prompts, 20, [], step_fn=step) == eager
    hf = hf_model(str(path))
    for p, mine in zip(prompts, eager):
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert out[0, len(p) :].tolist() == mine


def test_config_facts_and_shared_embeddings(tiny_llama3_dir, tiny_qwen3_dir, tmp_path):
    llama, qwen = native(tiny_llama3_dir), native(tiny_qwen3_dir)
    c = llama.config
    assert (c.num_layers, c.hidden_size, c.vocab_size) == (6, 64, 512)
    assert c.max_position_embeddings == 512 and c.eos_token_ids == [2]
    assert c.rope_scaling["rope_type"] == "llama3" and not c.qk_norm
    assert qwen.config.qk_norm and qwen.config.tie_word_embeddings
    assert qwen.lm_head.weight is qwen.embed_tokens.weight  # tied head: one tensor
    assert llama.lm_head.weight is not llama.embed_tokens.weight
    hf = hf_model(str(tiny_llama3_dir))
    assert torch.equal(llama.embed_tokens.weight, hf.get_input_embeddings().weight)
    assert not any(p.requires_grad for p in llama.parameters())
    # generation_config.json's eos list wins over config.json's (what HF generate stops on).
    d = tmp_path / "t"
    shutil.copytree(tiny_llama3_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 2]}))
    assert native(d).config.eos_token_ids == [2, 7]
    bf = load_native_target(d, "cpu", torch.bfloat16, 1, 8)
    assert bf.embed_tokens.weight.dtype == torch.bfloat16
    assert bf.model.layers[0].self_attn.k_cache.shape == (1, 9, 2, 16)  # + scratch column
    logits, _ = run(bf, [[5, 6, 7]], [[0, 1, 2]], [0])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_sharded_index_checkpoint_loads_same_weights(tiny_llama3_dir, tmp_path):
    hf = hf_model(str(tiny_llama3_dir))
    hf.save_pretrained(str(tmp_path), max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert not (tmp_path / "model.safetensors").exists()
    seq = rand_ids(10, 50)
    a, _ = run(native(tmp_path), [seq], [list(range(10))], [0])
    b, _ = run(native(tiny_llama3_dir), [seq], [list(range(10))], [0])
    assert torch.equal(a, b)


def test_unsupported_architecture_is_one_line_config_error(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ConfigError) as e:
        native(tmp_path)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "\n" not in msg
    assert all(name in msg for name in FAMILIES.native_architectures())


def _broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_checkpoint_pieces_are_one_line_checkpoint_errors(tiny_qwen3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    def err(path) -> str:
        with pytest.raises(CheckpointError) as e:
            native(path)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "not found" in err(tmp_path / "nope")
    assert "not found" in err("./missing-dir")
    d = _broken_copy(tiny_qwen3_dir, tmp_path / "no_weights")
    (d / "model.safetensors").unlink()
    assert "no model.safetensors" in err(d)
    (d / "pytorch_model.bin").write_bytes(b"")
    assert "pickled weights are not loaded" in err(d)
    d = _broken_copy(tiny_qwen3_dir, tmp_path / "no_config")
    (d / "config.json").unlink()
    assert "no config.json" in err(d)

    sd = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    d = _broken_copy(tiny_qwen3_dir, tmp_path / "missing_tensor")
    save_file(
        {k: v for k, v in sd.items() if "layers.3.self_attn.k_norm" not in k},
        str(d / "model.safetensors"),
    )
    assert "lacks tensor(s) model.layers.3.self_attn.k_norm.weight" in err(d)
    d = _broken_copy(tiny_qwen3_dir, tmp_path / "extra_tensor")
    save_file({**sd, "model.layers.0.mlp.extra": torch.zeros(2)}, str(d / "model.safetensors"))
    assert "does not use: model.layers.0.mlp.extra" in err(d)
    d = _broken_copy(tiny_qwen3_dir, tmp_path / "bad_shape")
    bad = dict(sd, **{"model.norm.weight": torch.zeros(3)})
    save_file(bad, str(d / "model.safetensors"))
    assert "model.norm.weight has shape (3,)" in err(d)
