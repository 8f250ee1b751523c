"""Training from hidden states a serving engine extracted (`data.hidden_states`,
`drafttrain.sources.engine`) on the shipped zoo target `zoo:llama-tiny` (L = 8).

Producer files are written in the engines' own layout (`tests.support.hs_producer`: vLLM's
`ExampleHiddenStatesConnector` @015a95c8 and speculators 0.9.0's offline generator) and read
back by hs_connectors 0.9.0's own reader (`FileTransfer.get_cached`), which the source uses.

1. The tap rule: vLLM slot k < L = HF `output_hidden_states[k]` = our `layer_input.k`, slot L =
   the final norm's input (pre-norm; HF's `hidden_states[L]` is post-norm): the features the
   source returns from a file built from transformers' own outputs equal the live target's.
2. Acceptance: a run on a directory in the engines' layout has the per-step losses of the same
   run on our own feature cache, bitwise (float32 and bfloat16 files: the same numbers).
3. Faults and checks: a producer killed mid-sample leaves a truncated file under a released lock; the
   streaming trainer does not consume it, waits, and finishes with the offline run's losses
   after the producer restarts; a trainer killed mid-epoch resumes from its checkpoint with
   the uninterrupted run's rows and losses (nothing lost, nothing seen twice); a sample with
   wrong shapes or tokens is a one-line error naming the field; files whose slots are other
   layers than `layer_ids` says are refused at setup, naming the slot and the layer it holds
   (the one target forward of these runs).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftinfer.models.target import FeatureSpec
from drafttrain.cache.format import FORMAT
from drafttrain.cache.writer import write_cache
from drafttrain.frozen.target import FrozenTarget
from drafttrain.jobs.errors import ConfigError, DataError
from drafttrain.jobs.setup import setup_target
from drafttrain.jobs.train import train
from drafttrain.sources import engine
from drafttrain.sources.engine import EngineTarget, check_sample, slot_feature
from drafttrain.sources.rows import write_rows
from tests.support.hs_producer import engine_sample, produce
from tests.support.presets import compose_preset

pytest.importorskip("hs_connectors", reason="the dev extra installs it: pip install -e .[dev]")

REPO = Path(__file__).resolve().parents[2]
L = 8  # zoo:llama-tiny's decoder layers
SLOTS = [2, 4, 5, 8]  # speculators' default for L = 8: eagle3's taps (2, L//2, L-3) and L


def overrides(out: Path, *extra: str) -> list[str]:
    """Three steps of eagle3 on 24 zoo conversations, batches of 4 (6 batches an epoch)."""
    return [
        "data.max_samples=24",
        "data.batch_size=4",
        "data.eval_split=null",
        "drafter.ttt_steps=2",
        "drafter.draft_vocab_size=256",
        "trainer.max_steps=3",
        "trainer.warmup_steps=1",
        "trainer.progress=false",
        "trainer.save_every=0",
        "trainer.log_every=1",
        "trainer.num_threads=1",
        "export.enabled=false",
        f"output_dir={out}",
        *extra,
    ]


def cfg_for(out: Path, *extra: str):
    return compose_preset("eagle3", overrides(out, *extra))


def rows_of_split(cfg) -> list[list[int]]:
    ts = setup_target(cfg.target)
    data = ts.family.data(cfg.target.name_or_path, ts.tokenizer).tokenize(cfg.data).data
    return [list(r) for r in data["input_ids"]]


def cache_rows(root: Path) -> tuple[list[str], dict[int, torch.Tensor]]:
    """A feature cache's segments and its training rows' `hidden [T, S*H]` (storage dtype)."""
    m = FORMAT.read(root)
    out = {}
    for e in m["shards"]:
        with safe_open(str(root / e["file"]), framework="pt") as f:
            off, rows, hid = f.get_tensor("offsets"), f.get_tensor("rows"), f.get_tensor("hidden")
        for i, r in enumerate(rows.tolist()):
            out[r] = hid[off[i] : off[i + 1]]
    return list(m["layout"]["segments"]), out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Per dtype: our feature cache, the engine's payload of each row (`row_<i>`), and the
    per-step losses of training from the cache."""
    made: dict[str, dict] = {}

    def get(dtype: str) -> dict:
        if dtype not in made:
            root = tmp_path_factory.mktemp(f"engine_{dtype}")
            cache = root / "cache"
            write_cache(cfg_for(root / "w", f"cache.dtype={dtype}", f"cache.dir={cache}"))
            # The rows the producer sends: `python -m drafttrain.sources.rows`'s directory, read
            # the way speculators' generator reads its preprocessed data (torch format).
            rows = write_rows(cfg_for(root / "w", f"data.hidden_states.rows={root / 'rows'}"))
            sent = load_from_disk(rows["dir"])
            tokens = [sent[i]["input_ids"].tolist() for i in range(len(sent))]
            assert tokens == rows_of_split(cfg_for(root / "w"))
            assert [int(sent[i]["seq_len"]) for i in range(len(sent))] == [len(t) for t in tokens]
            segments, hidden = cache_rows(cache)
            payload = root / "payload"
            payload.mkdir()
            tdt = torch.float32 if dtype == "float32" else torch.bfloat16
            for r, h in hidden.items():
                t = engine_sample(h, segments, SLOTS, L, tokens[r], tdt)
                save_file(t, str(payload / f"row_{r}.safetensors"))
            ref = train(cfg_for(root / "cached", f"cache.dtype={dtype}", f"data.cache={cache}"))
            made[dtype] = {"root": root, "payload": payload, "losses": ref["losses"]}
        return made[dtype]

    return get


def engine_cfg(out: Path, hs_dir: Path, *extra: str):
    return cfg_for(
        out, f"data.hidden_states.path={hs_dir}", f"data.hidden_states.layer_ids={SLOTS}", *extra
    )


# ---- 1. the tap rule against transformers -----------------------------------------------------
def test_slot_rule_against_transformers(tmp_path):
    """The oracle is transformers' `output_hidden_states` (and the final norm's input) on the
    same tokens; the source reads a connector-layout file of them through hs_connectors."""

    cfg = cfg_for(tmp_path / "w")
    ts = setup_target(cfg.target)
    target: FrozenTarget = ts.family.target(cfg.target, torch.device("cpu"))
    model = target.model
    ids = torch.tensor([[1, 17, 230, 99, 4000, 8, 512, 3, 77, 1023, 5]])
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, a: captured.setdefault("pre", a[0]))
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True).hidden_states  # L + 1 of [1, T, H]
    hook.remove()
    pre = captured["pre"]
    # HF's hidden_states[L] is the post-norm state, not slot L.
    assert not torch.equal(hf[L], pre)
    assert torch.equal(hf[L], model.model.norm(pre))
    slots = [0, 1, 2, 4, 5, 7, 8]
    # What vLLM writes: slot k < L = HF hidden_states[k]; slot L = the final norm's input.
    hs = torch.stack([hf[k][0] if k < L else pre[0] for k in slots], dim=1)  # [T, S, H]
    d = tmp_path / "hs"
    from tests.support.hs_producer import vllm_write

    vllm_write(d / "hs_0.safetensors", {"hidden_states": hs, "token_ids": ids[0]})
    assert [slot_feature(k, L) for k in slots] == [
        "layer_input.0", "layer_input.1", "layer_input.2", "layer_input.4",
        "layer_input.5", "layer_input.7", "final_hidden.pre_norm",
    ]  # fmt: skip
    src = EngineTarget(
        d, engine.transfer_for("file", d), engine.engine_layout(slots, L, 256), None,
        [{"input_ids": ids[0].tolist()}], torch.float32, False, 0.1, 1.0, 1,
    )  # fmt: skip
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "index": torch.tensor([0])}
    spec = FeatureSpec((0, 1, 2, 4, 5, 7), "pre_norm")
    got = src.batch_output(batch, spec)
    live = target.batch_output({**batch, "position_ids": torch.arange(ids.shape[1])[None],
                                "loss_mask": torch.ones_like(ids)}, spec)  # fmt: skip
    assert torch.equal(got.features, live.features)
    assert torch.equal(got.head.hidden, pre)
    with pytest.raises(ConfigError, match="slot 9 out of range"):
        slot_feature(9, L)


# ---- 2. acceptance: the same losses as our own feature cache --------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_directory_trains_like_the_feature_cache(dtype, world, tmp_path, monkeypatch):
    w = world(dtype)
    hs_dir = tmp_path / "hs"
    produce(w["payload"], hs_dir, "generator")  # speculators' offline generator's layout
    assert sorted(p.name for p in hs_dir.iterdir())[:2] == ["hs_0.safetensors", "hs_1.safetensors"]
    calls = []
    real = FrozenTarget.batch_output

    def counted(self, batch, features):
        calls.append(tuple(batch["input_ids"].shape))
        return real(self, batch, features)

    monkeypatch.setattr(FrozenTarget, "batch_output", counted)
    got = train(engine_cfg(tmp_path / "run", hs_dir))
    assert len(calls) == 1 and calls[0][0] == 1  # the tap check's one row; training ran none
    assert got["losses"] == w["losses"]  # bitwise
    assert got["losses"][-1] != got["losses"][0]


# ---- 3. faults --------------------------------------------------------------------------------
@pytest.mark.slow
def test_streaming_survives_a_producer_killed_mid_sample(world, tmp_path):
    w = world("float32")
    hs_dir = tmp_path / "hs"
    cmd = [sys.executable, "-m", "tests.support.hs_producer", str(w["payload"]), str(hs_dir),
           "--mode", "connector", "--delay", "0.02"]  # fmt: skip
    first = subprocess.Popen([*cmd, "--die-at", "7"], cwd=REPO)
    done = threading.Event()
    seen = {}

    def restart():
        first.wait(timeout=120)
        seen["rc"] = first.returncode
        half = hs_dir / "hs_7.safetensors"
        seen["half"] = half.exists() and not engine.whole(half)
        time.sleep(2.0)  # the trainer is waiting for it meanwhile
        seen["trainer_done_before_restart"] = done.is_set()
        seen["second"] = subprocess.run(cmd, cwd=REPO, timeout=120).returncode

    t = threading.Thread(target=restart)
    t.start()
    try:
        got = train(
            engine_cfg(
                tmp_path / "run",
                hs_dir,
                "data.hidden_states.stream=true",
                "data.hidden_states.poll_s=0.05",
                "data.hidden_states.timeout_s=120",
                "data.hidden_states.queue_batches=2",
            )  # fmt: skip
        )
    finally:
        done.set()
        t.join()
    assert seen == {"rc": -9, "half": True, "trainer_done_before_restart": False, "second": 0}
    assert got["losses"] == w["losses"]


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


def test_trainer_killed_mid_epoch_resumes_without_loss_or_repeat(world, tmp_path, monkeypatch):
    w = world("float32")
    hs_dir = tmp_path / "hs"
    produce(w["payload"], hs_dir, "connector")
    extra = ("trainer.max_steps=4", "trainer.save_every=2", "data.hidden_states.stream=true",
             "data.hidden_states.queue_batches=3")  # fmt: skip
    taken: list[list[int]] = []
    real = EngineTarget.batch_output

    def recording(self, batch, features):
        if kill_at and len(taken) == kill_at:
            raise Killed
        taken.append(batch["index"].tolist())
        return real(self, batch, features)

    monkeypatch.setattr(EngineTarget, "batch_output", recording)
    kill_at = 0
    full = train(engine_cfg(tmp_path / "full", hs_dir, *extra))
    full_rows, taken[:] = list(taken), []
    kill_at = 3  # after the step-2 checkpoint, with batches already read ahead
    with pytest.raises(Killed):
        train(engine_cfg(tmp_path / "killed", hs_dir, *extra))
    before, taken[:] = list(taken[:2]), []
    kill_at = 0
    resumed = train(engine_cfg(tmp_path / "killed", hs_dir, *extra, "resume=true"))
    assert before + taken == full_rows  # nothing lost, nothing twice
    assert len({r for b in full_rows for r in b}) == 16  # 4 batches of an epoch of 6
    assert resumed["losses"] == full["losses"][2:]


def test_bad_samples_are_one_line_errors_naming_the_field():
    good = {"hidden_states": torch.zeros(3, 4, 8), "token_ids": torch.tensor([1, 2, 3])}

    def err(sample, tokens=(1, 2, 3)) -> str:
        with pytest.raises(DataError) as e:
            check_sample(sample, list(tokens), 4, 8, "hs_5.safetensors")
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("hs_5.safetensors: ")
        return msg

    check_sample(good, [1, 2, 3], 4, 8, "hs_5.safetensors")
    assert "hidden_states is (3, 3, 8), expected (3, 4, 8)" in err(
        {**good, "hidden_states": torch.zeros(3, 3, 8)}
    )  # a producer launched with other taps
    assert "hidden_states is (3, 4, 16)" in err({**good, "hidden_states": torch.zeros(3, 4, 16)})
    assert "token_ids" in err(good, (1, 2, 4))
    assert "no token_ids" in err({"hidden_states": good["hidden_states"]})
    assert "non-finite" in err({**good, "hidden_states": torch.full((3, 4, 8), float("nan"))})
    assert "token_ids is torch.float32" in err({**good, "token_ids": torch.ones(3)})


def test_bad_settings_are_one_line_errors(world, tmp_path):
    w = world("float32")
    hs_dir = tmp_path / "hs"
    produce(w["payload"], hs_dir, "connector")
    cases = {
        ("data.hidden_states.layer_ids=[2,4,6,8]",): "layer_input.5",  # a tap the drafter needs
        ("data.hidden_states.layer_ids=[2,4,5]",): "has no slot 8",
        ("data.hidden_states.layer_ids=[2,4,5,9]",): "slot 9 out of range",
        ("data.hidden_states.backend=mooncake",): "backend=mooncake is not supported",
        ("data.eval_split=test",): "holds the training split only",
    }
    for extra, needle in cases.items():
        cfg = compose_preset(
            "eagle3",
            overrides(
                tmp_path / "r",
                f"data.hidden_states.path={hs_dir}",
                f"data.hidden_states.layer_ids={SLOTS}",
                *extra,
            ),  # fmt: skip
        )
        with pytest.raises(ConfigError) as e:
            train(cfg)
        assert needle in str(e.value) and "\n" not in str(e.value), (extra, str(e.value))
    # A server launched with the same number of slots in another order: slot 2 holds layer 4's.
    for p in hs_dir.glob("hs_*.safetensors"):
        t = load_file(str(p))
        t["hidden_states"] = t["hidden_states"][:, [1, 0, 2, 3]].contiguous()
        save_file(t, str(p))
    with pytest.raises(DataError) as e:
        train(engine_cfg(tmp_path / "r", hs_dir))
    msg = str(e.value)
    assert "\n" not in msg and "hidden_states[:, 0] is not slot 2 (layer_input.2)" in msg, msg
    assert "closest: slot 4 = layer_input.4 (0)" in msg, msg
    (hs_dir / "hs_3.safetensors").unlink()
    with pytest.raises(DataError, match="lacks 1 of 24 rows' files .first: hs_3.safetensors"):
        train(engine_cfg(tmp_path / "r", hs_dir))
    assert not (tmp_path / "r").exists()


def test_fp8_connector_files_read_through_hs_connectors_fp8_reader(tmp_path):
    """hs_connectors' `FP8HiddenStatesConnector` layout (its own quantizer: one fp32 scale per
    token, `hidden_states_scales [T, 1, 1]`): `backend=fp8` returns hs_connectors' own
    dequantization; `backend=file` refuses the file naming the field."""
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    from tests.support.hs_producer import vllm_write

    torch.manual_seed(0)
    T, slots = 7, [2, 4, 5, 8]
    hs = torch.randn(T, len(slots), 16) * torch.tensor([0.1, 1.0, 4.0, 30.0])[None, :, None]
    q, scales = quantize_tensor_to_fp8(hs)
    ids = torch.arange(T) + 10
    vllm_write(tmp_path / "hs_0.safetensors",
               {"hidden_states": q, "hidden_states_scales": scales, "token_ids": ids})  # fmt: skip
    batch = {"input_ids": ids[None], "attention_mask": torch.ones(1, T), "index": torch.tensor([0])}
    spec = FeatureSpec((2, 4, 5))

    def source(backend: str) -> EngineTarget:
        return EngineTarget(
            tmp_path, engine.transfer_for(backend, tmp_path), engine.engine_layout(slots, L, 16),
            None, [{"input_ids": ids.tolist()}], torch.float32, False, 0.1, 1.0, 1,
        )  # fmt: skip

    got = source("fp8").batch_output(batch, spec)
    want = dequantize_fp8_tensor(q, scales, torch.bfloat16).float()  # [T, S, H]
    assert torch.equal(got.features[0], want[:, :3].flatten(-2))
    assert torch.equal(got.head.hidden[0], want[:, 3])
    assert (want - hs).abs().max() <= 2**-3 * hs.abs().amax()  # fp8 + bf16 rounding, per token
    with pytest.raises(DataError, match=r"^hs_0.safetensors: hidden_states_scales present"):
        source("file").batch_output(batch, spec)


def test_read_ahead_stops_while_waiting_for_a_file(tmp_path):
    """`Prefetched.close` (the end of training, a resume's restore) ends a reader thread that is
    waiting for a file nobody writes, instead of blocking until `timeout_s`."""
    from drafttrain.sources.engine import Prefetched

    class OneRow:  # a batch stream whose next batch is row 0, forever
        def next(self):
            return {"index": torch.tensor([0])}

        def state(self):
            return {"epoch": 0, "index": 0}

    src = EngineTarget(
        tmp_path, engine.transfer_for("file", tmp_path), engine.engine_layout(SLOTS, L, 8),
        None, [{"input_ids": [1, 2]}], torch.float32, True, 0.01, 600.0, 2,
    )  # fmt: skip
    pre = Prefetched(OneRow(), src, 2)
    time.sleep(0.1)
    t0 = time.monotonic()
    pre.close()
    assert time.monotonic() - t0 < 2 and not pre._thread.is_alive()
