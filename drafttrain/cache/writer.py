"""`write_cache(cfg)`: run the frozen target once over the training data (and the rows
held-out evaluation runs) and store what training would ask of it, in the format of
`drafttrain.cache.format`.

For each shard of the plan (contiguous samples, `cache.shard_tokens` each): forward the
target over the shard's samples in length-sorted batches (`cache.batch_size`) through the
target interface, asking for the drafter's `FeatureSpec` plus the head input; keep the real
tokens; encode (`cache.dtype`); serialize; commit it (`drafttrain.trainer.shards.ShardedOutput`:
written atomically, then listed in `manifest.json` with its size, sha256, split, sample range
and token count; the manifest itself is replaced atomically). A rerun with the same settings
keeps every shard whose file matches its manifest entry and writes the rest, so a killed write
continues where it stopped; a rerun with other settings into the same directory is a one-line
`ConfigError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from drafttrain.cache.fingerprint import common_fingerprint, split_fingerprint
from drafttrain.cache.format import (
    FORMAT,
    SPLITS,
    Layout,
    bytes_per_token,
    encode,
    mismatch,
    plan_shards,
    shard_name,
    storage_dtype,
)
from drafttrain.data import collate, held_out_batches
from drafttrain.frozen.head import TargetHead
from drafttrain.frozen.target import FrozenTarget, batch_slots
from drafttrain.jobs.config import TrainConfig
from drafttrain.jobs.errors import ConfigError, TargetError
from drafttrain.jobs.setup import job_device, setup_drafter_job, single_process
from drafttrain.trainer.shards import ShardedOutput, remove_temp_files


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


def write_cache(cfg: TrainConfig) -> dict[str, Any]:
    """Write (or finish) the feature cache of `cfg` into `cache.dir`. Returns a summary:
    `dir`, `bytes_per_token` (from the layout) and per split `samples`, `tokens`, `bytes`."""
    from draftinfer.evaluation.threads import torch_threads

    with torch_threads(cfg.trainer.num_threads):
        return _write_cache(cfg)


def _write_cache(cfg: TrainConfig) -> dict[str, Any]:
    from tqdm.auto import tqdm

    storage_dtype(cfg.cache.dtype)
    if cfg.data.cache:
        raise ConfigError("data.cache is what training reads; the cache writer writes cache.dir")
    single_process("the feature-cache writer")
    root = cache_root(cfg)
    job = setup_drafter_job(cfg, job_device(), feature_cache=True)
    target, data = job.target, job.split.data
    features = job.spec.features(cfg.drafter, job.init_context())
    layout, ask = Layout.for_features(
        features, target.info.hidden_size, target.info.rope_axes, cfg.cache.dtype
    )
    ask.check(target.info.num_layers)
    head = TargetHead.of(target, layout.head_input)
    splits = {"train": (data, list(range(len(data))))}
    if cfg.data.eval_split:
        eval_data, batches = held_out_batches(cfg.data, job.tokenizer, cfg.seed)
        splits["eval"] = (eval_data, sorted({i for b in batches for i in b}))

    # One plan over both splits: shard `index` is (split, its number in the split, samples).
    plan: list[tuple[str, int, int, int]] = []
    info: dict[str, Any] = {}
    for split, (ds, rows) in splits.items():
        lengths = [int(n) for n in ds.select(rows)["length"]] if rows else []
        cuts = plan_shards(lengths, cfg.cache.shard_tokens)
        plan += [(split, j, a, b) for j, (a, b) in enumerate(cuts)]
        info[split] = {
            "fingerprint": split_fingerprint(cfg, split, ds, rows),
            "num_samples": len(rows),
            "num_tokens": sum(lengths),
            "num_shards": len(cuts),
        }
    out = ShardedOutput(
        root,
        FORMAT,
        FORMAT.new(
            len(plan),
            fingerprint=common_fingerprint(cfg, job.tokenizer, target),
            layout=layout.to_dict(),
            shard_tokens=cfg.cache.shard_tokens,
            splits=info,
            info={"target_dtype": str(target.model.dtype).removeprefix("torch.")},
        ),
    )

    old = FORMAT.read(root)
    if old is not None:  # resume: same settings, keep the shards that verify
        bad = mismatch(_settings(out.manifest), _settings(old))
        if bad:
            raise ConfigError(
                f"cache.dir={root} holds a feature cache written with other settings ({bad}): "
                "use another cache.dir or delete it"
            )

        def same(e: dict[str, Any]) -> bool:
            i = e["index"]
            return i < len(plan) and [e["split"], *e["samples"]] == [plan[i][0], *plan[i][2:]]

        out.keep_verified(old, same)
    remove_temp_files(*(root / split for split in SPLITS))
    out.save()

    check_head = True
    done = out.done()
    for split, (ds, rows) in splits.items():
        mine = [(i, j, a, b) for i, (s, j, a, b) in enumerate(plan) if s == split]
        bar = tqdm(
            total=len(rows),
            initial=sum(b - a for i, _, a, b in mine if i in done),
            disable=not cfg.trainer.progress,
            desc=f"cache {split}",
            unit="sample",
            dynamic_ncols=True,
        )
        for i, j, a, b in mine:
            if i in done:
                continue
            tensors = _encode_shard(
                target,
                head,
                ask,
                layout,
                ds,
                rows[a:b],
                batch_size(cfg),
                job.pad_id,
                check_head,
                bar,
            )
            check_head = False
            tokens = int(tensors["offsets"][-1])
            out.commit(
                i, shard_name(split, j), save(tensors), split=split, samples=[a, b], tokens=tokens
            )
        bar.close()
    out.save()
    return summarize(root, out.manifest)


def batch_size(cfg: TrainConfig) -> int:
    return cfg.cache.batch_size or cfg.data.batch_size


def _settings(m: dict[str, Any]) -> dict[str, Any]:
    """What must agree for a rerun to continue a cache: the fingerprints, layout, shard size
    and splits."""
    out = {**m["fingerprint"], "layout": m["layout"], "cache.shard_tokens": m["shard_tokens"]}
    out["splits"] = sorted(m["splits"])
    for s in m["splits"].values():
        out.update(s["fingerprint"])
    return out


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
        shards = [e for e in manifest["shards"] if e["split"] == split]
        out["splits"][split] = {
            "samples": s["num_samples"],
            "tokens": sum(e["tokens"] for e in shards),
            "bytes": sum(e["bytes"] for e in shards),
            "shards": len(shards),
        }
    return out
