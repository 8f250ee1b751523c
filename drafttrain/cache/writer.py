"""`write_cache(cfg)`: run the frozen target once over the training data (and the rows
held-out evaluation runs) and store what training would ask of it, in the format of
`drafttrain.cache.format`.

For each shard of the plan (contiguous samples, `cache.shard_tokens` each): forward the
target over the shard's samples in length-sorted batches (`cache.batch_size`) through the
target interface, asking for the drafter's `FeatureSpec` plus the head input; keep the real
tokens; encode (`cache.dtype`); serialize; write `shard.tmp`, fsync, rename; record the
shard's size, sha256, sample range and token count in `manifest.json` (itself replaced
atomically). A rerun with the same settings keeps every shard whose file matches its
manifest entry and writes the rest, so a killed write continues where it stopped; a rerun
with other settings into the same directory is a one-line `ConfigError`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from drafttrain.cache.fingerprint import common_fingerprint, split_fingerprint
from drafttrain.cache.format import (
    FORMAT,
    VERSION,
    Layout,
    bytes_per_token,
    encode,
    first_mismatch,
    plan_shards,
    read_manifest,
    sha256_file,
    shard_name,
    storage_dtype,
    write_atomic,
    write_manifest,
)
from drafttrain.config import TrainConfig
from drafttrain.errors import ConfigError, TargetError
from drafttrain.target import FrozenTarget, batch_slots
from drafttrain.target_head import TargetHead


def cache_root(cfg: TrainConfig) -> Path:
    return Path(cfg.cache.dir) if cfg.cache.dir else Path(cfg.output_dir) / "feature_cache"


def _encode_shard(
    target: FrozenTarget,
    head: TargetHead,
    ask,
    layout: Layout,
    data,
    rows: list[int],
    batch_size: int,
    pad_id: int,
    check_head: bool,
    bar,
) -> dict[str, torch.Tensor]:
    """The shard tensors of dataset rows `rows` (module docstring of `format`)."""
    from drafttrain.data import collate

    lengths = [int(data[r]["length"]) for r in rows]
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    N, S = int(offsets[-1]), layout.num_segments
    parts: dict[str, torch.Tensor] = {}
    rope = torch.zeros(layout.rope_axes, N, dtype=torch.int32)
    # Length-sorted batches waste little on padding; results land at each sample's offset.
    order = sorted(range(len(rows)), key=lambda i: lengths[i])
    for lo in range(0, len(order), batch_size):
        idx = order[lo : lo + batch_size]
        batch = collate([data[rows[i]] for i in idx], pad_id)
        batch = {k: v.to(target.device) for k, v in batch.items()}
        out = target.forward(batch["input_ids"], batch_slots(batch), ask)
        if check_head and lo == 0:
            _check_head(head, out, batch["attention_mask"].bool(), layout)
        # Encoded on the target's device, copied to the host once per batch.
        enc = {k: v.cpu() for k, v in encode(out.features.flatten(0, 1), S, layout.dtype).items()}
        T = batch["input_ids"].shape[1]
        pos = out.rope_pos if layout.rope_axes > 1 else out.rope_pos[None]  # [A, B, T]
        pos = pos.cpu().to(torch.int32)
        for b, i in enumerate(idx):
            a, n = int(offsets[i]), lengths[i]
            for name, t in enc.items():  # hidden [B*T, S*H], scale [B*T, S]
                if name not in parts:
                    parts[name] = torch.zeros(N, t.shape[-1], dtype=t.dtype)
                parts[name][a : a + n] = t[b * T : b * T + n]
            rope[:, a : a + n] = pos[:, b, :n]
        bar.update(len(idx))
    return {
        **{k: v.contiguous() for k, v in parts.items()},
        "rope_pos": rope,
        "offsets": offsets,
        "rows": torch.tensor(rows, dtype=torch.long),
    }


def _check_head(head: TargetHead, out, real: torch.Tensor, layout: Layout) -> None:
    """The logits the cache will recompute equal the target's own: a target whose head does
    more than `lm_head(norm(h))` (logit soft-capping, scaling) cannot be cached this way."""
    H = layout.hidden_size
    h = out.features[..., -H:]  # the head input is the last segment
    got, ref = head.logits(h)[real], out.logits[real]
    err = float((got - ref).abs().max()) if ref.numel() else 0.0
    if err > 1e-2 * float(ref.abs().max()) + 1e-4:
        raise TargetError(
            f"the target's logits are not lm_head(final_norm(h)) (max difference {err:.3g}): "
            "its head does more (soft-capping, scaling) and cannot be recomputed from a cache"
        )


def _verified(root: Path, entry: dict[str, Any] | None, plan: tuple[int, int]) -> bool:
    if entry is None or tuple(entry["samples"]) != plan:
        return False
    path = root / entry["file"]
    return (
        path.is_file()
        and path.stat().st_size == entry["bytes"]
        and sha256_file(path) == entry["sha256"]
    )


def write_cache(cfg: TrainConfig) -> dict[str, Any]:
    """Write (or finish) the feature cache of `cfg` into `cache.dir`. Returns a summary:
    `dir`, `bytes_per_token` (from the layout) and per split `samples`, `tokens`, `bytes`."""
    from draftinfer.threads import torch_threads

    with torch_threads(cfg.trainer.num_threads):
        return _write_cache(cfg)


def _write_cache(cfg: TrainConfig) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from drafttrain.cache import check_family
    from drafttrain.data.batching import held_out_batches
    from drafttrain.families import target_family
    from drafttrain.registry import InitContext, train_spec
    from drafttrain.target import load_tokenizer
    from drafttrain.train import prepare_data

    spec = train_spec(getattr(cfg.drafter, "kind", None) or "")
    storage_dtype(cfg.cache.dtype)
    root = cache_root(cfg)
    if cfg.data.cache:
        raise ConfigError("data.cache is what training reads; the cache writer writes cache.dir")
    family = target_family(cfg.target.name_or_path)
    check_family(family, cfg.target.name_or_path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(cfg.target.name_or_path)
    target = family.target(cfg.target, device)
    data = prepare_data(cfg, family.data(cfg.target.name_or_path, tokenizer)).data
    ctx_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output_dir) / "cache"
    features = spec.features(cfg.drafter, InitContext(target, tokenizer, data, ctx_dir))
    layout, ask = Layout.for_features(
        features, target.info.hidden_size, target.info.rope_axes, cfg.cache.dtype
    )
    ask.check(target.info.num_layers)
    head = TargetHead.of(target, layout.head_input)
    splits = {"train": (data, list(range(len(data))))}
    if cfg.data.eval_split:
        eval_data, batches = held_out_batches(cfg.data, tokenizer, cfg.seed)
        splits["eval"] = (eval_data, sorted({i for b in batches for i in b}))

    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": common_fingerprint(cfg, tokenizer, target),
        "layout": layout.to_dict(),
        "shard_tokens": cfg.cache.shard_tokens,
        "complete": False,
        "splits": {},
        "info": {"target_dtype": str(target.model.dtype).removeprefix("torch.")},
    }
    plans = {}
    for split, (ds, rows) in splits.items():
        lengths = [int(n) for n in ds.select(rows)["length"]] if rows else []
        plans[split] = plan_shards(lengths, cfg.cache.shard_tokens)
        manifest["splits"][split] = {
            "fingerprint": split_fingerprint(cfg, split, ds, rows),
            "num_samples": len(rows),
            "num_tokens": sum(lengths),
            "shards": [None] * len(plans[split]),
        }

    old = read_manifest(root)
    if old is not None:  # resume: same settings, keep the shards that verify
        want = {**manifest["fingerprint"], "layout": manifest["layout"]}
        have = {**old["fingerprint"], "layout": old["layout"]}
        want["cache.shard_tokens"], have["cache.shard_tokens"] = (
            cfg.cache.shard_tokens,
            old.get("shard_tokens"),
        )
        want["splits"], have["splits"] = sorted(splits), sorted(old["splits"])
        for split in splits:
            want.update(manifest["splits"][split]["fingerprint"])
            have.update(old["splits"].get(split, {}).get("fingerprint", {}))
        bad = first_mismatch(want, have)
        if bad:
            raise ConfigError(
                f"cache.dir={root} holds a feature cache written with other settings ({bad}): "
                "use another cache.dir or delete it"
            )
        for split in splits:
            olds = old["splits"][split]["shards"]
            new = manifest["splits"][split]["shards"]
            for i, plan in enumerate(plans[split]):
                if i < len(olds) and _verified(root, olds[i], plan):
                    new[i] = olds[i]
    for split in splits:
        (root / split).mkdir(parents=True, exist_ok=True)
        for stale in (root / split).glob("*.tmp"):  # a write killed before its rename
            stale.unlink()
    write_manifest(root, manifest)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch_size = cfg.cache.batch_size or cfg.data.batch_size
    check_head = True
    for split, (ds, rows) in splits.items():
        entries = manifest["splits"][split]["shards"]
        done = sum(b - a for (a, b), e in zip(plans[split], entries) if e is not None)
        bar = tqdm(
            total=len(rows),
            initial=done,
            disable=not cfg.trainer.progress,
            desc=f"cache {split}",
            unit="sample",
            dynamic_ncols=True,
        )
        for i, (a, b) in enumerate(plans[split]):
            if entries[i] is not None:
                continue
            tensors = _encode_shard(
                target, head, ask, layout, ds, rows[a:b], batch_size, pad_id, check_head, bar
            )
            check_head = False
            blob = save(tensors)
            name = shard_name(split, i)
            write_atomic(root / name, blob)
            entries[i] = {
                "file": name,
                "samples": [a, b],
                "tokens": int(tensors["offsets"][-1]),
                "bytes": len(blob),
                "sha256": hashlib.sha256(blob).hexdigest(),
            }
            write_manifest(root, manifest)
        bar.close()
    manifest["complete"] = True
    write_manifest(root, manifest)
    return summarize(root, manifest)


def summarize(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    lay = Layout.from_dict(manifest["layout"])
    out: dict[str, Any] = {
        "dir": str(root),
        "layout": lay.to_dict(),
        "bytes_per_token": bytes_per_token(
            lay.hidden_size, lay.num_segments, lay.dtype, lay.rope_axes
        ),
        "splits": {},
    }
    for split, s in manifest["splits"].items():
        shards = [e for e in s["shards"] if e is not None]
        out["splits"][split] = {
            "samples": s["num_samples"],
            "tokens": sum(e["tokens"] for e in shards),
            "bytes": sum(e["bytes"] for e in shards),
            "shards": len(shards),
        }
    return out
