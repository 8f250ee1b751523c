"""The offline feature cache (`drafttrain.cache`) on the shipped zoo target: training from a
cache gives the per-step losses of online training on the same data without running the
target; writes resume after a kill to the same bytes; a cache that does not match the config,
or a damaged shard, is a one-line error before training writes anything; fp8 storage error is
bounded; bytes per token are exact.

Tolerances: a float32 cache of the (fp32, on CPU) target stores the live target's features
exactly, so per-step losses differ only by the batch-shape dependence of the target's own
matmuls (writer batches vs training batches): 1e-4 relative (measured: 2e-7 eagle3 and
ptd, 0 mtp). A bfloat16 cache rounds every feature and the head input once (2^-9 relative):
1e-3 relative on each step's loss (measured 4e-5). A float8 cache's features are checked
against the fp8 rounding bound (training from it: 1.2e-3 relative, measured, not asserted).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import drafttrain.trainer.shards as shards_mod
from drafttrain.cache import CachedTarget, bytes_per_token, decode, encode
from drafttrain.cache.format import FORMAT
from drafttrain.cache.writer import write_cache
from drafttrain.frozen.target import FrozenTarget
from drafttrain.jobs.errors import ConfigError, DataError
from drafttrain.jobs.train import train
from drafttrain.trainer.shards import MANIFEST, temp_path
from tests.support.no_target import forbid_target_forward
from tests.support.presets import compose_preset

REPO = Path(__file__).resolve().parents[2]
KIND_PRESET = {"eagle3": "eagle3", "ptd": "ptd_eagle3", "mtp": "mtp3"}
KIND_OVERRIDES = {
    "eagle3": ["drafter.ttt_steps=2", "drafter.draft_vocab_size=256"],
    "ptd": ["drafter.parallel_k=3", "drafter.draft_vocab_size=256"],
    "mtp": ["drafter.n_predict=2"],
}


def overrides(kind: str, out: Path, *extra: str) -> list[str]:
    """A few steps on 24 zoo conversations; shards of ~300 tokens (4 of them)."""
    return [
        "data.max_samples=24",
        "data.batch_size=4",
        "data.eval_split=null",
        "trainer.max_steps=3",
        "trainer.warmup_steps=1",
        "trainer.progress=false",
        "trainer.save_every=0",
        "trainer.log_every=1",
        "cache.shard_tokens=300",
        f"output_dir={out}",
        *KIND_OVERRIDES[kind],
        *extra,
    ]


def cfg_for(kind: str, out: Path, *extra: str):
    return compose_preset(KIND_PRESET[kind], overrides(kind, out, *extra))


EVAL = ("data.eval_split=test", "data.eval_batches=2")
_CACHES: dict[tuple, Path] = {}


@pytest.fixture(scope="module")
def cache_of(tmp_path_factory):
    """`cache_of(kind, dtype, *extra)` -> a cache directory written once per module."""

    def get(kind: str, dtype: str, *extra: str) -> Path:
        key = (kind, dtype, *extra)
        if key not in _CACHES:
            root = tmp_path_factory.mktemp(f"cache_{kind}_{dtype}")
            cfg = cfg_for(kind, root / "w", f"cache.dtype={dtype}", f"cache.dir={root}", *extra)
            write_cache(cfg)
            _CACHES[key] = root
        return _CACHES[key]

    yield get
    _CACHES.clear()


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    """`online(kind)` -> the summary of online training (eagle3 also evaluates): run once per
    module. Held-out evaluation runs after the last step, and `cache.*` does not enter online
    training, so every test of a kind compares against the same per-step losses."""
    runs: dict[str, dict] = {}

    def get(kind: str) -> dict:
        if kind not in runs:
            extra = EVAL if kind == "eagle3" else ()
            runs[kind] = train(cfg_for(kind, tmp_path_factory.mktemp(f"online_{kind}"), *extra))
        return runs[kind]

    return get


def _rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(a, b))


# ---- (1) + (2): same losses as online training, and the target never runs -------------------
@pytest.mark.parametrize(
    "kind, cache_kind, extra",
    [("eagle3", "eagle3", EVAL), ("ptd", "eagle3", ()), ("mtp", "mtp", ())],
    ids=["eagle3", "ptd-from-eagle3-cache", "mtp"],
)
def test_float32_cache_matches_online_training(
    kind, cache_kind, extra, cache_of, online, tmp_path, monkeypatch
):
    """ptd consumes the same taps as eagle3, so it trains from the eagle3 cache."""
    root = cache_of(cache_kind, "float32", *EVAL)
    online = online(kind)
    forbid_target_forward(monkeypatch)
    cached = train(
        cfg_for(kind, tmp_path / "cached", "cache.dtype=float32", f"data.cache={root}", *extra)
    )
    assert _rel_diff(online["losses"], cached["losses"]) < 1e-4, (
        online["losses"],
        cached["losses"],
    )
    assert online["losses"][-1] != online["losses"][0]  # the drafter did train
    evals = [k for k in online if k.startswith("eval_")]
    assert bool(extra) == bool(evals)
    for k in evals:  # held-out evaluation reads the cache's eval part
        assert cached[k] == pytest.approx(online[k], rel=1e-4, abs=1e-6), k


def test_bfloat16_cache_losses_close_to_online(cache_of, online, tmp_path, monkeypatch):
    root = cache_of("eagle3", "bfloat16")
    online = online("eagle3")
    forbid_target_forward(monkeypatch)
    cached = train(cfg_for("eagle3", tmp_path / "cached", f"data.cache={root}"))
    diff = _rel_diff(online["losses"], cached["losses"])
    assert 0 < diff < 1e-3, (online["losses"], cached["losses"])


# ---- (3) resume after an interrupted write ---------------------------------------------------
class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (not even `except Exception` handlers)."""


def test_interrupted_write_resumes_to_the_same_bytes(cache_of, tmp_path, monkeypatch):
    clean = cache_of("eagle3", "bfloat16")
    root = tmp_path / "cache"
    cfg = cfg_for("eagle3", tmp_path / "w", f"cache.dir={root}")
    real = shards_mod.write_atomic
    shards = []

    def dies_in_third_shard(path: Path, data: bytes) -> None:
        if path.name.startswith("shard_"):
            shards.append(path.name)
            if len(shards) == 3:  # killed halfway through writing the temp file
                temp_path(path).write_bytes(data[: len(data) // 2])
                raise Killed
        real(path, data)

    monkeypatch.setattr(shards_mod, "write_atomic", dies_in_third_shard)
    with pytest.raises(Killed):
        write_cache(cfg)
    monkeypatch.undo()
    # Two complete shards, recorded; the third exists only as a temp file nobody reads.
    m = FORMAT.read(root)
    assert not m["complete"] and m["splits"]["train"]["num_shards"] == m["num_shards"] == 4
    assert [(e["index"], e["split"]) for e in m["shards"]] == [(0, "train"), (1, "train")]
    assert {p.name for p in (root / "train").iterdir()} == {
        "shard_00000.safetensors",
        "shard_00001.safetensors",
        temp_path(root / "train" / "shard_00002.safetensors").name,
    }
    # Training refuses the incomplete cache (before writing anything).
    with pytest.raises(DataError, match="incomplete .2 of 4 train shards"):
        train(cfg_for("eagle3", tmp_path / "run", f"data.cache={root}"))
    assert not (tmp_path / "run").exists()

    mtimes = {p.name: p.stat().st_mtime_ns for p in (root / "train").glob("*.safetensors")}
    summary = write_cache(cfg)  # the rerun finishes the job
    assert summary["splits"]["train"]["shards"] == 4
    for name, t in mtimes.items():  # complete shards were kept, not rewritten
        assert (root / "train" / name).stat().st_mtime_ns == t
    files = sorted(p.name for p in (clean / "train").iterdir())
    assert sorted(p.name for p in (root / "train").iterdir()) == files
    for name in files:
        assert (root / "train" / name).read_bytes() == (clean / "train" / name).read_bytes(), name
    a, b = FORMAT.read(root), FORMAT.read(clean)
    assert a["splits"] == b["splits"] and a["shards"] == b["shards"]
    assert a["complete"] and b["complete"]
    assert not [p for p in root.rglob("*") if shards_mod.is_temp(p)]  # stale temp removed


# ---- (4) manifest mismatch, (5) damaged shards: one line, nothing written --------------------
def _one_line(exc: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


@pytest.mark.parametrize(
    "kind, extra, needle",
    [
        ("eagle3", ["data.max_length=64"], "data.max_length is 64 here but 256 in the cache"),
        ("eagle3", ["data.max_samples=20"], "data.max_samples is 20 here but 24 in the cache"),
        ("eagle3", ["cache.dtype=float8"], "cache.dtype is 'float8' here but 'bfloat16'"),
        ("eagle3", ["drafter.aux_layer_ids=[1,4,5]"], "consumes the target's layer_input.1"),
        ("mtp", [], "consumes the target's final_hidden.post_norm"),
        ("eagle3", ["data.eval_split=test"], "has no eval split"),
    ],
)
def test_cache_config_mismatch_is_one_line(kind, extra, needle, cache_of, tmp_path):
    root = cache_of("eagle3", "bfloat16")
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        train(cfg_for(kind, out, f"data.cache={root}", *extra))
    _one_line(e, needle, f"data.cache={root}")
    assert not out.exists()


def test_writer_refuses_other_settings_in_a_cache_dir(cache_of, tmp_path):
    root = cache_of("eagle3", "bfloat16")
    before = (root / MANIFEST).read_bytes()
    with pytest.raises(ConfigError) as e:
        write_cache(cfg_for("eagle3", tmp_path / "w", f"cache.dir={root}", "data.max_length=64"))
    _one_line(e, f"cache.dir={root} holds a feature cache written with other settings")
    assert (root / MANIFEST).read_bytes() == before


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x55
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, needle",
    [(_truncate, "is truncated or altered"), (_flip_byte, "fails its sha256 checksum")],
)
def test_damaged_shard_is_one_line_naming_it(damage, needle, cache_of, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(cache_of("eagle3", "bfloat16"), root)
    shard = root / "train" / "shard_00001.safetensors"
    damage(shard)
    out = tmp_path / "run"
    with pytest.raises(DataError) as e:
        train(cfg_for("eagle3", out, f"data.cache={root}"))
    _one_line(e, str(shard), needle)
    assert not out.exists()


# ---- (6) fp8: error bounded, bytes per token exact -------------------------------------------
def test_fp8_round_trip_error_is_bounded():
    torch.manual_seed(0)
    H, S = 96, 4
    # Segments four orders of magnitude apart (an embedding-level tap vs the late residual
    # stream), a zero row and a row with one outlier.
    x = torch.randn(33, S, H) * torch.tensor([1e-3, 1.0, 30.0, 300.0])[None, :, None]
    x[5] = 0
    x[7, 2, 11] = 5e4
    enc = encode(x.flatten(1), S, "float8")
    assert enc["hidden"].dtype == torch.float8_e4m3fn and enc["scale"].shape == (33, S)
    y = decode(enc["hidden"], enc["scale"], S, torch.float32).unflatten(-1, (S, H))
    scale = enc["scale"][..., None]
    # 3 mantissa bits: half an ulp is 2^-4 relative in the normal range, and below it (scaled
    # values under 2^-6) half the subnormal step, 2^-10, times the row's scale.
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    assert ((y - x).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(y[5], x[5])
    # Per-segment scales keep the small segment: its relative error is as small as the others'.
    rel = ((y - x).norm(dim=-1) / x.norm(dim=-1).clamp(min=1e-30))[torch.arange(33) != 5]
    assert rel.max() < 0.05
    # A single scale per token would have flushed most of segment 0 to zero.
    one = encode(x.reshape(33, 1, S * H).flatten(1), 1, "float8")
    y1 = decode(one["hidden"], one["scale"], 1, torch.float32).unflatten(-1, (S, H))
    assert (y1[:, 0] == 0).float().mean() > 0.5


def test_fp8_cache_reads_close_to_float32_cache(cache_of, tmp_path):
    """What training gets from a float8 cache, against a float32 cache of the same data:
    features within the fp8 bound (per segment scales, also for segments asked for out of
    order), the same positions and padding, and nearly the same target distribution."""
    from draftinfer.models.target import FeatureSpec
    from drafttrain.data import BatchStream
    from drafttrain.frozen.head import target_logits
    from drafttrain.jobs.setup import setup_training

    exact, fp8 = cache_of("eagle3", "float32", *EVAL), cache_of("eagle3", "float8")
    H, S = 256, 4  # zoo:llama-tiny; eagle3 stores 3 taps + the pre-norm final hidden
    for root, dtype in ((exact, "float32"), (fp8, "float8")):
        m = FORMAT.read(root)
        train = [e for e in m["shards"] if e["split"] == "train"]
        per = sum(e["bytes"] for e in train) / m["splits"]["train"]["num_tokens"]
        # measured = the per-token tensors + per-sample tensors and headers
        assert 0 < per - bytes_per_token(H, S, dtype)["total"] < 16, (dtype, per)
    assert bytes_per_token(H, S, "float8")["total"] == S * H + 4 * S + 4
    out = {}
    for name, root, dtype in (("exact", exact, "float32"), ("fp8", fp8, "float8")):
        cfg = cfg_for("eagle3", tmp_path / name, f"data.cache={root}", f"cache.dtype={dtype}")
        setup = setup_training(cfg, torch.device("cpu"))
        target = setup.target
        batch = BatchStream(setup.job.split, 4, 0, seed=0).next()
        out[name] = target.batch_output(batch, FeatureSpec(layer_inputs=(5, 2)))
    a, b = out["exact"], out["fp8"]
    real = batch["attention_mask"].bool()
    assert not real.all()  # the batch has padding
    assert torch.equal(a.rope_pos, b.rope_pos) and a.features.shape == b.features.shape
    assert not b.features[~real].any()
    x, y = a.features[real].unflatten(-1, (2, H)), b.features[real].unflatten(-1, (2, H))
    scale = x.abs().amax(-1, keepdim=True) / 448
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    assert ((y - x).abs() <= bound * (1 + 1e-4)).all()
    la, lb = target_logits(a), target_logits(b)  # computed from the stored head inputs
    p, q = torch.softmax(la[real], -1), torch.softmax(lb[real], -1)
    tv = 0.5 * (p - q).abs().sum(-1)  # total variation per token
    assert tv.mean() < 0.02 and tv.max() < 0.1, (tv.mean(), tv.max())  # measured 0.006, 0.021
    assert b.inputs_embeds.shape == (*real.shape, 0)


def test_bytes_per_token_llama3_8b():
    """docs/training.md's table: Llama-3.1-8B (H 4096), eagle3/ptd store 3 taps + the
    pre-norm head input, mtp its final hidden."""
    H = 4096
    assert bytes_per_token(H, 4, "bfloat16") == {
        "hidden": 32768,
        "scale": 0,
        "rope_pos": 4,
        "total": 32772,
    }
    assert bytes_per_token(H, 4, "float8")["total"] == 16384 + 16 + 4
    assert bytes_per_token(H, 1, "bfloat16")["total"] == 8192 + 4
    assert bytes_per_token(H, 1, "float8")["total"] == 4096 + 4 + 4
    assert bytes_per_token(H, 1, "float8", rope_axes=3)["total"] == 4096 + 4 + 12


# ---- the command line --------------------------------------------------------------------------
@pytest.mark.slow
def test_cache_cli_writes_and_reports(tmp_path):
    root = tmp_path / "cache"
    args = overrides("mtp", tmp_path / "w", f"cache.dir={root}", "cache.dtype=float8")
    r = subprocess.run(
        [sys.executable, "-m", "drafttrain.cache", "conf=mtp3", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"feature cache: {root}" in r.stdout
    assert "bytes/token (stored tensors): hidden 256, scale 4, rope_pos 4 = 264" in r.stdout
    m = json.loads((root / MANIFEST).read_text())
    assert m["complete"] and m["layout"]["segments"] == ["final_hidden.post_norm"]
    with pytest.raises(ConfigError) as e:  # the CLI prints this one line and exits 2
        write_cache(cfg_for("mtp", tmp_path / "w", "cache.dtype=int4"))
    _one_line(e, "cache.dtype must be one of ['bfloat16', 'float32', 'float8'], got 'int4'")
    assert not (tmp_path / "w" / "feature_cache").exists()


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_cached_target_frees_the_target_body(kind, cache_of, tmp_path, monkeypatch):
    """`setup_training` swaps in the cache after the drafter's initialisation, and keeps only the
    target's final norm and output embedding: its decoder layers are freed."""
    import gc
    import weakref

    from drafttrain.jobs.setup import setup_training

    refs = []
    init = FrozenTarget.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        refs.append((weakref.ref(self), [weakref.ref(layer) for layer in self.layers]))

    root = cache_of(kind, "float32", *EVAL)  # built first (it runs a target of its own)
    monkeypatch.setattr(FrozenTarget, "__init__", spy)
    cfg = cfg_for(kind, tmp_path / "run", f"data.cache={root}", "cache.dtype=float32")
    target = setup_training(cfg, torch.device("cpu")).target
    gc.collect()
    assert isinstance(target, CachedTarget)
    [(frozen, layers)] = refs
    assert frozen() is None and all(r() is None for r in layers)
    assert target.head.weight.shape == (4096, 256)
