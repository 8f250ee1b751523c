"""Hidden states a serving engine extracted, as training's feature source
(`data.hidden_states.path=DIR`, `drafttrain.sources.registry`): the target runs in the engine a
user already serves with (vLLM, tensor/expert parallel over several nodes), the trainer never
runs it.

What the directory holds (the layout read from the producers' code):
- vLLM `extract_hidden_states` with hs_connectors' `file` backend
  (`vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py` @015a95c8,
  `ExampleHiddenStatesConnector`): one safetensors file per request, tensors
  `hidden_states [T, S, H]` (the target dtype; `S = len(eagle_aux_hidden_state_layer_ids)`, in
  that order: `vllm/v1/spec_decode/extract_hidden_states.py` @025cafb6 stacks the aux states on
  dim 1) and `token_ids [T]` int64 (the prompt's tokens); it is written while the writer holds
  `LOCK_EX` on `<file>.lock`, which a reader waits on;
- hs_connectors' `fp8` backend (`hs_connectors/fp8_hidden_states_connector.py`, 0.9.0): the same
  with `hidden_states` in float8_e4m3fn and `hidden_states_scales [T, 1, 1]` fp32;
- speculators' offline generator (`speculators/cli/generate_offline_data.py`, 0.9.0) moves each
  finished request's file to `hs_<i>.safetensors`, `i` the row of the tokenized dataset it sent,
  which is what hs_connectors' reader reads back by index (`FileTransfer.get_cached(i)`).

So a directory is `hs_<row>.safetensors` per row of our tokenized training split (row `i` of the
split = `index` in training batches), and this source reads each file with hs_connectors' own
transfer for `data.hidden_states.backend` (`HiddenStatesBackend.registry`); hs_connectors is
then a requirement (`pip install hs_connectors`).

The tap rule (slot numbering of `eagle_aux_hidden_state_layer_ids`, REFERENCES A3 / 1.4): vLLM
captures slot `k` before decoder layer `k` runs, as `hidden + residual`, so slot `k < L` is the
input layer `k` receives = HF `output_hidden_states[k]` = our `layer_input.k` (convention 2), and
slot `L` (speculators' `--include-last-layer`, which its trainer reads as
`verifier_last_hidden_states`) is the residual stream after the last layer, before the final
norm = our `final_hidden.pre_norm`, from which the target's distribution is recomputed
(`TargetHead`). `slot_feature` is the one function; `tests/train/test_engine_features.py` pins
it against transformers. Slots outside `0..L` are refused; the post-norm final hidden (HF
`hidden_states[L]`) is not something vLLM extracts, so a drafter that consumes it cannot train
from this source.

Taps: at setup, one row's file (the shortest; streaming, the first to arrive) is compared slot
by slot with the loaded target's own features of that row (`check_taps`, one forward, before the
target's body is freed): a server launched with other `eagle_aux_hidden_state_layer_ids`, or
another order, is a one-line `DataError` naming the slot and the layer it matches (a vLLM file
does not record its layer ids, so this is the only way to see them).

Checks: each sample is refused with a one-line `DataError` naming the field when its keys,
shapes or dtype are not the ones above, its `token_ids` are not the row's tokens, or its values
are not finite. Offline, a missing file is an error at setup; streaming
(`data.hidden_states.stream`), the reader waits for it: a file counts only once its lock is free
and it opens whole (a producer killed mid-write leaves a lock it no longer holds and a truncated
file; that file is never consumed, and the producer's restart, which regenerates unreadable
files as speculators' generator does, replaces it). Reading runs ahead of the loop by at most
`queue_batches` batches (`Prefetched`).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from draftinfer.models.target import FeatureSpec, TargetOutput
from drafttrain.cache.format import Layout, feature_name
from drafttrain.frozen.head import HeadLogits, TargetHead, TrainTargetOutput
from drafttrain.jobs.errors import ConfigError, DataError
from drafttrain.sources.registry import FeatureSource, register_source

FILE = "hs_{}.safetensors"
KEY = "data.hidden_states"


# ---- the tap rule ------------------------------------------------------------------------
def default_layer_ids(num_layers: int) -> list[int]:
    """speculators' `launch_vllm.py` default: the EAGLE-3 taps and the last layer."""
    L = num_layers
    return [2, L // 2, L - 3, L]


def slot_feature(slot: int, num_layers: int) -> str:
    """Our feature name of vLLM's aux slot `slot` on a target of `num_layers` decoder layers:
    `layer_input.k` for `k < L`, `final_hidden.pre_norm` for `k == L` (module docstring)."""
    if 0 <= slot < num_layers:
        return feature_name(slot)
    if slot == num_layers:
        return feature_name(final_hidden="pre_norm")
    raise ConfigError(
        f"{KEY}.layer_ids: slot {slot} out of range: the target has {num_layers} decoder "
        f"layers (slots 0..{num_layers})"
    )


def engine_layout(layer_ids: list[int], num_layers: int, hidden_size: int) -> Layout:
    """The segments a file holds, in slot order (the head input is the pre-norm final hidden)."""
    names = [slot_feature(k, num_layers) for k in layer_ids]
    if len(set(names)) != len(names):
        raise ConfigError(f"{KEY}.layer_ids has a slot twice: {list(layer_ids)}")
    return Layout(tuple(names), "pre_norm", hidden_size, 1, "float32")


# ---- hs_connectors -------------------------------------------------------------------------
def transfer_for(backend: str, path: Path):
    """hs_connectors' reader (`HiddenStatesTransfer`) of `backend` over directory `path`."""
    try:
        from hs_connectors import HiddenStatesBackend
    except ImportError:
        raise ConfigError(
            f"{KEY}.path needs hs_connectors to read the engine's files: pip install hs_connectors"
        ) from None
    if backend == "mooncake":
        installed = importlib.util.find_spec("mooncake") is not None
        raise ConfigError(
            f"{KEY}.backend=mooncake is not supported: Mooncake hands samples over by vLLM's "
            "response (transfer params), not by dataset row"
            + ("" if installed else " (and mooncake-transfer-engine is not installed)")
        )
    registry = HiddenStatesBackend.registry
    if backend not in registry:
        raise ConfigError(f"{KEY}.backend must be one of {sorted(registry)}, got {backend!r}")
    args = argparse.Namespace(hidden_states_path=str(path))
    return registry[backend].from_train_args(args, str(path))


def lock_free(path: Path) -> bool:
    """No writer holds `LOCK_EX` on `path`'s companion `.lock` (vLLM's completion marker)."""
    lock = Path(str(path) + ".lock")
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def whole(path: Path) -> bool:
    """`path` exists and opens: safetensors checks its header against the file's size, so a
    file cut short by a killed writer does not."""
    try:
        with safe_open(str(path), framework="pt"):
            return True
    except Exception:  # noqa: BLE001 - missing, truncated, corrupt: not a complete sample
        return False


# ---- one sample ---------------------------------------------------------------------------
def check_sample(
    sample: dict[str, torch.Tensor], tokens: list[int], num_slots: int, hidden: int, name: str
) -> torch.Tensor:
    """`hidden_states [T, S, H]` of a producer's sample after its checks (one-line `DataError`s
    naming the field)."""
    for key in ("hidden_states", "token_ids"):
        if key not in sample:
            raise DataError(f"{name}: no {key} (it holds {', '.join(sorted(sample))})")
    hs, ids = sample["hidden_states"], sample["token_ids"]
    T = len(tokens)
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise DataError(f"{name}: token_ids is {ids.dtype} {tuple(ids.shape)}, expected int64 [T]")
    if ids.tolist() != tokens:
        raise DataError(
            f"{name}: token_ids ({len(ids)} tokens) are not the tokens of its training row "
            f"({T} tokens): the producer ran other data"
        )
    if "hidden_states_scales" in sample:  # hs_connectors' fp8 reader removes them
        raise DataError(
            f"{name}: hidden_states_scales present (an fp8 connector's file): read it with "
            f"{KEY}.backend=fp8"
        )
    if not hs.is_floating_point() or hs.element_size() == 1:
        raise DataError(
            f"{name}: hidden_states is {hs.dtype}, expected float32, bfloat16 or float16"
        )
    if tuple(hs.shape) != (T, num_slots, hidden):
        raise DataError(
            f"{name}: hidden_states is {tuple(hs.shape)}, expected ({T}, {num_slots}, {hidden}) "
            f"= (tokens, len({KEY}.layer_ids), hidden size)"
        )
    lo, hi = torch.aminmax(hs.float())
    if not bool(torch.isfinite(torch.stack((lo, hi))).all()):
        raise DataError(f"{name}: hidden_states holds non-finite values")
    return hs


class Stopped(Exception):
    """A read-ahead thread's wait ended by `Prefetched.close`."""


class EngineTarget:
    """The engine's hidden states standing in for the frozen target of training: answers
    `batch_output(batch, features)` like `drafttrain.cache.CachedTarget` (module docstring)."""

    def __init__(self, root: Path, transfer, layout: Layout, head: TargetHead, data, dtype,
                 stream: bool, poll_s: float, timeout_s: float, queue_batches: int):  # fmt: skip
        self.root, self.transfer, self.layout, self.head = root, transfer, layout, head
        self.data, self.dtype = data, dtype
        self.stream, self.poll_s, self.timeout_s = stream, poll_s, timeout_s
        self.queue_batches = queue_batches
        # The rows of the batch the loop took last, read ahead (`Prefetched`): replaced at each
        # batch, so rows another rank consumes do not pile up.
        self._ready: dict[int, torch.Tensor] = {}

    def path(self, row: int) -> Path:
        return self.root / FILE.format(row)

    def _read(self, row: int) -> dict[str, torch.Tensor] | None:
        path = self.path(row)
        if self.stream and not (path.exists() and lock_free(path) and whole(path)):
            return None
        try:
            return self.transfer.get_cached(row)
        except Exception as e:  # noqa: BLE001 - a lock held past hs_connectors' wait, a cut file
            if self.stream:
                return None
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise DataError(f"{path}: unreadable: {first}") from None

    def load(self, row: int, stop: threading.Event | None = None) -> torch.Tensor:
        """Row `row`'s `hidden_states [T, S, H]`, checked; streaming, after waiting for it
        (a reader thread's wait ends when `stop` is set: `Stopped`)."""
        ready = self._ready.pop(row, None) if stop is None else None  # the loop's thread only
        if ready is not None:
            return ready
        deadline = time.monotonic() + self.timeout_s
        while True:
            sample = self._read(row)
            if sample is not None:
                break
            if not self.stream:
                raise DataError(f"{self.path(row)}: missing (row {row} of the training split)")
            if stop is not None and stop.is_set():
                raise Stopped
            if time.monotonic() > deadline:
                raise DataError(
                    f"{self.path(row)}: not written after {self.timeout_s:g} s "
                    f"({KEY}.timeout_s): is the producer running?"
                )
            time.sleep(self.poll_s)
        tokens = list(self.data[row]["input_ids"])
        lay = self.layout
        return check_sample(sample, tokens, lay.num_segments, lay.hidden_size, self.path(row).name)

    def for_split(self, split: str) -> EngineTarget:
        if split != "train":
            raise ConfigError(f"{KEY}.path holds the training split only, not {split!r}")
        return self

    def stream_batches(self, stream):
        """The loop's batch stream with this source's rows read ahead (streaming only)."""
        return Prefetched(stream, self, self.queue_batches) if self.stream else stream

    @torch.no_grad()
    def batch_output(self, batch: dict[str, torch.Tensor], features: FeatureSpec) -> TargetOutput:
        """The target's output for a collated batch: rows `index [B]`, right-padded to its
        `input_ids [B, T]`; features in the target dtype, rope positions `0..n-1`."""
        ids = batch["input_ids"]
        B, T = ids.shape
        dev = ids.device
        lay = self.layout
        H, S = lay.hidden_size, lay.num_segments
        hidden = torch.zeros(B, T, S, H, dtype=self.dtype)
        rope = torch.zeros(B, T, dtype=torch.long)
        real = batch["attention_mask"].sum(-1).cpu()
        for b, row in enumerate(batch["index"].tolist()):
            hs = self.load(row)
            n = hs.shape[0]
            if n != int(real[b]):
                raise DataError(
                    f"{self.path(row).name}: {n} tokens, the batch row has {int(real[b])}"
                )
            hidden[b, :n] = hs.to(self.dtype)
            rope[b, :n] = torch.arange(n)
        hidden = hidden.to(dev)
        cols = lay.columns(features, f"{KEY}.path={self.root}")
        feats = hidden[:, :, cols].flatten(-2) if cols else None
        head_col = lay.segments.index(feature_name(final_hidden="pre_norm"))
        head = HeadLogits(hidden[:, :, head_col], self.head)
        empty = torch.zeros(B, T, 0, dtype=self.dtype, device=dev)
        return TrainTargetOutput(None, feats, rope.to(dev), empty, head=head)


class Prefetched:
    """A batch stream (`drafttrain.data.BatchStream`) whose batches' rows a reader thread loads
    ahead of the loop, at most `depth` batches ahead (a bounded queue). `state()` is the
    cursor after the last batch the loop *took*, so a checkpoint never counts a batch that was
    only read ahead: a resumed run takes the same batches."""

    def __init__(self, stream, source: EngineTarget, depth: int):
        self.stream, self.source, self.depth = stream, source, depth
        self._state = stream.state()
        self._start()

    def _start(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hs-prefetch")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self.stream.next()
                state = self.stream.state()
                rows = {r: self.source.load(r, self._stop) for r in batch["index"].tolist()}
                item = (batch, state, rows, None)
            except Stopped:
                return
            except BaseException as e:  # noqa: BLE001 - handed to the loop, raised there
                item = (None, None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[3] is not None:
                return

    def next(self) -> dict[str, torch.Tensor]:
        batch, state, rows, err = self._queue.get()
        if err is not None:
            raise err
        self._state = state
        self.source._ready = rows  # the global batch's rows; this rank's are popped
        return batch

    def state(self) -> dict[str, Any]:
        return dict(self._state)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def restore(self, st: dict[str, Any]) -> None:
        self.close()
        self.source._ready = {}
        self.stream.restore(st)
        self._state = self.stream.state()
        self._start()


# ---- the taps, against the target ---------------------------------------------------------
def first_row(src: EngineTarget, n: int) -> int:
    """The row the tap check reads: offline the shortest; streaming the shortest whose file is
    complete, waiting for one up to `timeout_s`."""
    order = sorted(range(n), key=lambda i: len(src.data[i]["input_ids"]))
    if not src.stream:
        return order[0]
    deadline = time.monotonic() + src.timeout_s
    while True:
        for i in order:
            p = src.path(i)
            if p.exists() and lock_free(p) and whole(p):
                return i
        if time.monotonic() > deadline:
            raise DataError(
                f"{KEY}.path={src.root}: no file written after {src.timeout_s:g} s "
                f"({KEY}.timeout_s): is the producer running?"
            )
        time.sleep(src.poll_s)


@torch.no_grad()
def check_taps(target, src: EngineTarget, split, layer_ids: list[int], pad_id: int, tol: float):
    """Each slot of one row's file against the target's own features of that row (one
    forward): a slot further than `tol` (relative) from the feature `layer_ids` names is a
    one-line `DataError` naming the slot and the target feature it is closest to."""
    L = target.info.num_layers
    row = first_row(src, len(split.data))
    hs = src.load(row).float()  # [T, S, H]
    dev = next(target.model.parameters()).device
    batch = {k: v.to(dev) for k, v in split.collate([row], pad_id).items()}
    spec = FeatureSpec(tuple(range(L)), "pre_norm")  # every slot 0..L, in slot order
    live = target.batch_output(batch, spec).features[0].float()  # [T, (L+1)*H]
    live = live.unflatten(-1, (L + 1, -1)).transpose(0, 1)  # [L+1, T, H]
    norm = live.flatten(1).norm(dim=-1).clamp(min=1e-30)  # [L+1]
    for i, k in enumerate(layer_ids):
        err = (hs[:, i][None] - live).flatten(1).norm(dim=-1) / norm  # [L+1]: vs every slot
        if err[k] > tol:
            best = int(err.argmin())
            raise DataError(
                f"{src.path(row).name}: hidden_states[:, {i}] is not slot {k} "
                f"({slot_feature(k, L)}): {float(err[k]):.3g} relative from the target's "
                f"(> {KEY}.tap_tolerance={tol:g}); closest: slot {best} = "
                f"{slot_feature(best, L)} ({float(err[best]):.3g}): the server's eagle_aux_hidden_state_layer_ids are not "
                f"{KEY}.layer_ids={list(layer_ids)}"
            )


# ---- the source ---------------------------------------------------------------------------
def _check(cfg) -> None:
    if cfg.data.eval_split:
        raise ConfigError(f"{KEY}.path holds the training split only: set data.eval_split=null")


def open_engine(cfg, job, features: FeatureSpec) -> EngineTarget:
    """The source for `cfg.data.hidden_states`, checked against the target (its layer count and
    hidden size), the drafter's `features` and, offline, the directory's files."""
    hcfg = cfg.data.hidden_states
    root = Path(hcfg.path).expanduser()
    info = job.target.info
    L, H = info.num_layers, info.hidden_size
    layer_ids = list(hcfg.layer_ids) if hcfg.layer_ids is not None else default_layer_ids(L)
    layout = engine_layout(layer_ids, L, H)
    layout.columns(features, f"{KEY}.path={root} (slots {layer_ids})")
    if feature_name(final_hidden="pre_norm") not in layout.segments:
        raise ConfigError(
            f"{KEY}.layer_ids {layer_ids} has no slot {L} (the final hidden state before the "
            "norm), from which the target's distribution is recomputed: launch the extraction "
            "with it (speculators: --include-last-layer)"
        )
    transfer = transfer_for(hcfg.backend, root)
    data = job.split.data
    if not hcfg.stream:
        missing = [i for i in range(len(data)) if not (root / FILE.format(i)).is_file()]
        if missing:
            raise DataError(
                f"{KEY}.path={root} lacks {len(missing)} of {len(data)} rows' files "
                f"(first: {FILE.format(missing[0])}); set {KEY}.stream=true if a producer "
                "is still writing"
            )
    head = TargetHead.of(job.target, "pre_norm")
    src = EngineTarget(
        root, transfer, layout, head, data, job.target.model.dtype,
        hcfg.stream, hcfg.poll_s, hcfg.timeout_s, hcfg.queue_batches,
    )  # fmt: skip
    if hcfg.check_taps:
        check_taps(job.target, src, job.split, layer_ids, job.pad_id, hcfg.tap_tolerance)
    return src


register_source(
    FeatureSource(
        "engine", f"{KEY}.path", lambda cfg: bool(cfg.data.hidden_states.path), open_engine, _check
    )  # fmt: skip
)
