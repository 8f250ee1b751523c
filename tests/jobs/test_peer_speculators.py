"""The speculators 0.9.0 training-step peer (draftbench/peer_speculators.py) on CPU, tiny shapes.

speculators 0.9.0 pins transformers<=5.19, so it lives in its own virtualenv
(`tests/support/speculators_env.py`, created by `.ci/run`): where this process cannot import
it, the benches run in that venv's python. They skip only when neither has it (never in CI);
the OOM contract needs no peer and always runs."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from draftbench import peer_speculators as peer
from tests.support.bench_train import dflash_trainable
from tests.support.speculators_env import run_peer_bench, speculators_python

# hidden 64 = 4 heads x 16; prime-ish sequence length (not a multiple of flex's 128 blocks).
TINY = dict(
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    vocab=512,
    draft_vocab=256,
    steps=2,
    warmup=1,
    device="cpu",
    seed=0,
)
KEYS = {"peer", "seq_len", "tokens_per_s", "step_ms", "peak_gib", "param_dtype", "notes"}


def _bench(name: str, module: str = "peer_speculators", **kwargs) -> dict:
    """`draftbench.<module>.<name>(**kwargs)` in this process when speculators imports here,
    else in the speculators venv."""
    mod = importlib.import_module(f"draftbench.{module}")
    reason = mod.available()
    if reason is None:
        return getattr(mod, name)(**kwargs)
    if speculators_python() is None:
        pytest.skip(f"speculators 0.9.0 peer unavailable: {reason}; no speculators venv")
    return run_peer_bench(name, module=module, **kwargs)


def _eagle3_trainable(h, inter, heads, kv, hd):
    """fc [H, 3H] + input_norm [3H] + the first layer (q/k/v over [emb, hidden] = 2H inputs,
    o, gate/up/down, input/post-attention/hidden norms) + final norm; lm_head and embeddings
    are frozen in speculators 0.9.0."""
    fc = 3 * h * h + 3 * h
    attn = 2 * h * (heads * hd + 2 * kv * hd) + heads * hd * h
    return fc + attn + 3 * h * inter + 3 * h + h


@pytest.mark.slow  # ~10 s: subprocesses in the speculators venv
def test_eagle3_step_on_cpu():
    r = _bench("eagle3_train_step_bench", seq_len=37, ttt_steps=3, **TINY)
    assert KEYS <= r.keys()
    assert r["peer"] == "speculators 0.9.0" and r["ttt_steps"] == 3 and not r["oom"]
    assert len(r["step_ms"]) == 2 and all(ms > 0 for ms in r["step_ms"])
    assert r["tokens_per_s"] > 0 and r["peak_gib"] == 0.0
    assert r["param_dtype"] == "float32" and r["optimizer"] == "Muon+AdamW"
    assert (
        _bench("eagle3_train_step_bench", seq_len=37, ttt_steps=2, optimizer="adamw", **TINY)[
            "optimizer"
        ]
        == "AdamW"
    )  # the CLI's --optimizer adamw: one AdamW over every trainable parameter
    assert math.isfinite(r["loss"]) and r["loss"] > 0  # KL of a random draft is positive
    assert r["trainable_params"] == _eagle3_trainable(64, 128, 4, 2, 16)
    # Its step's GEMMs replayed alone (draftbench/gemm_floor.py; AdamW: no Newton-Schulz
    # products). On the CPU its loss is eager, so the head's products are among them: the
    # verifier's head over the draft vocabulary only (37 rows x 64 -> 256, not the 512-token
    # vocabulary) once, and in each of the 3 TTT steps the draft head and its input gradient;
    # no weight gradient (the head is frozen).
    f = _bench(
        "eagle3_train_step_bench",
        seq_len=37,
        ttt_steps=3,
        optimizer="adamw",
        gemm_floor=True,
        **TINY,
    )
    calls = {s["gemm"]: s["calls"] for s in f["gemm_floor"]["by_shape"]}
    assert f["gemm_floor"]["floor_ms"] > 0 and sum(calls.values()) == f["gemm_floor"]["calls"]
    assert calls["mm [37,64]x[64,256] NT BFloat16"] == 1 + 3
    assert calls["mm [37,256]x[256,64] NN BFloat16"] == 3
    assert not [g for g in calls if "x[64,512]" in g or "[256,37]" in g], calls


@pytest.mark.slow  # ~5 s: a subprocess in the speculators venv
def test_peagle_step_on_cpu():
    r = _bench("peagle_train_step_bench", seq_len=37, k=4, **TINY)
    assert KEYS <= r.keys() and r["k"] == 4 and not r["oom"]
    assert r["tokens_per_s"] > 0 and math.isfinite(r["loss"])
    # P-EAGLE trains the embeddings [V, H] and a learned mask hidden state [3H] on top.
    assert r["trainable_params"] >= 512 * 64 + 3 * 64


@pytest.mark.slow  # ~11 s: a subprocess in the speculators venv
def test_dflash_step_on_cpu():
    """speculators' DFlash at the shape of our dflash row (5 layers over 5 taps, a block of 8,
    the whole vocabulary): it computes max_anchors blocks and trains exactly the parameters
    our drafter trains (the same independent count as tests/jobs/test_bench_train_step.py)."""
    kw = dict(TINY, draft_vocab=None, seq_len=64, block_size=8, num_layers=5)
    kw.update(target_layer_ids=[1, 2, 3, 4, 5], max_anchors=6)
    r = _bench("dflash_train_step_bench", module="peer_speculators_dflash", **kw)
    assert KEYS <= r.keys() and r["kind"] == "dflash" and not r["oom"]
    assert r["anchors"] == 6 and r["block_rows"] == 6 * 8 and r["draft_vocab"] == 512
    assert r["tokens_per_s"] > 0 and r["optimizer"] == "Muon+AdamW"
    assert math.isfinite(r["loss"]) and r["loss"] > 0  # CE of a random draft
    assert r["trainable_params"] == dflash_trainable(64, 128, 4, 2, 16, layers=5, taps=5)


def test_oom_becomes_a_result():
    """No peer needed: an allocation failure is reported, not raised; other errors raise."""

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    base = {"peer": peer.PEER, "seq_len": 32768, "oom": False}
    r = peer._run_guarded(oom, device=torch.device("cpu"), base=base)
    assert r["oom"] is True and r["tokens_per_s"] is None and r["seq_len"] == 32768
    assert "Tried to allocate" in r["error"]

    def bug():
        raise ValueError("not a memory problem")

    with pytest.raises(ValueError):
        peer._run_guarded(bug, device=torch.device("cpu"), base=base)
