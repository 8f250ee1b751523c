"""The drift demonstration job (`python -m drafttrain conf=online_drift`): a target that moves,
a drafter that stays (stale) and one that follows it (online), the same prompts, AL over time.

    t = 0        the zoo target; a drafter trained on it for `online.base_steps` steps is
                 published as version 0 (the stale drafter, and the online one's start)
    t = 1..S     the target is fine-tuned `online.target_steps / S` more steps on the shifted
                 data mix (`drafttrain.online.shift`), as a policy moves under RL; the online
                 runner decodes `online.train_prompts` new questions of that mix with the moved
                 target and its current version, emitting the target features of the tokens
                 it commits (`SpecDecoder(emit_features=True)`: the drafter's features and the
                 head input, written as training samples by `drafttrain.cache.emitted`); the
                 online trainer runs its step quota (`online.steps_per_publish`) on those
                 rollouts (`data.emitted`: no target forward of its own) and publishes the
                 next version (weights only, atomically, `drafttrain.online.publish`); then
                 both drafters decode the same held-out prompts with the moved target. The online runner is
                 one `SpecDecoder` for the whole job: its target's weights are reloaded in
                 place and its drafter takes each version as a hot swap between rounds
                 (`VersionWatcher`), never rebuilt.

Every measurement checks losslessness (the speculative tokens equal plain greedy decoding of the
same target). Outputs in `output_dir`: `al_over_time.json` (the table), `al_over_time.png`
(the plot), `versions/` (the published versions and their `manifest.json`), `targets/` (the
target after each segment), `emitted/t_NN/` (the rollouts each quota trained on),
`drafter/` (the online trainer's run). Resumable: killed anywhere and started again with the
same `output_dir`, it reuses every finished target segment and rollout set (each written
atomically), resumes the trainer from its checkpoint, continues the versions from the manifest
and measures only the time points it has not measured; the table it ends with is the
uninterrupted run's. A rollout set is decoded with the newest published version (the one the
uninterrupted run's runner holds at that point), so a redone one is the same.

The version-0 drafter is trained on the original target with the live target (an offline
start); every later version trains on the runner's rollouts alone.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.files.checkpoint import atomic_write_text, load_drafter
from draftinfer.files.loading import load_native_target, load_weights
from draftinfer.files.paths import resolve_path
from draftinfer.files.target_dir import weight_files
from drafttrain.jobs.config import TrainConfig, check_online_config
from drafttrain.jobs.errors import DataError
from drafttrain.online.publish import VersionWatcher, publish_checkpoint, read_manifest
from drafttrain.online.shift import shifted

TABLE = "al_over_time.json"
PLOT = "al_over_time.png"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _rows(path: Path) -> list[dict]:
    from drafttrain.zoo.text_data import read_jsonl

    if not path.is_file():
        raise DataError(f"the drift job reads local chat jsonl files; no {path}")
    return read_jsonl(path)


def _write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def drafter_run_config(
    cfg: TrainConfig, run: Path, target: str, data: str, steps: int, emitted: Path | None = None
):
    """The online trainer's config for a quota ending at `steps`: the preset's drafter and
    trainer, resumed in `run/drafter` (its checkpoints carry the optimizer and the data cursor
    across quotas), on `target` and `data` (the runner's samples `emitted`, when given);
    nothing but training (no export, eval or walk)."""
    o = cfg.online
    r = dataclasses.replace
    em = None if emitted is None else str(emitted)
    return r(
        cfg,
        target=r(cfg.target, name_or_path=target),
        data=r(
            cfg.data,
            path=data,
            eval_split=None,
            cache_dir=str(run / "drafter_cache"),
            cache=None,
            emitted=em,
        ),
        trainer=r(
            cfg.trainer,
            max_steps=steps,
            save_every=max(1, o.steps_per_publish // 2),
            keep_last=2,
        ),
        eval=r(cfg.eval, every_n_steps=0, walk=False),
        export=r(cfg.export, enabled=False, verify=False),
        output_dir=str(run / "drafter"),
        resume=True,
    )


def fine_tune_segment(prev: str, out: Path, examples, pad_id: int, o, seed: int) -> Path:
    """The target of the next segment: `prev` fine-tuned `target_steps / segments` steps on
    the shifted mix (the zoo's own target trainer, fresh AdamW seeded per segment, so a
    restarted job redoes a segment bit for bit), saved in fp32 atomically to `out`."""
    from transformers import AutoModelForCausalLM

    from drafttrain.zoo.text_train import TrainArgs, train

    model = AutoModelForCausalLM.from_pretrained(prev, dtype=torch.float32)
    steps = o.target_steps // o.segments
    args = TrainArgs(
        steps=steps,
        tokens_per_batch=o.target_tokens_per_batch,
        lr=o.target_lr,
        min_lr_ratio=1.0,
        warmup=min(10, steps // 4),
        weight_decay=0.0,
        seed=seed,
    )
    train(model, examples, pad_id, args)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(prev) / name).is_file():
            shutil.copyfile(Path(prev) / name, tmp / name)
    tmp.rename(out)
    return out


def rollouts(decoder, prompts, o, eos, target_name: str, out: Path, max_length: int) -> Path:
    """The online trainer's data: `prompts` decoded greedily by the runner (`decoder`, built
    with `emit_features=True`), written with the features it emitted to `out` (atomically;
    kept when already there)."""
    from drafttrain.cache.emitted import EmittedSample, write_emitted

    if (out / "manifest.json").is_file():
        return out
    reqs = [Request(p, max_tokens=o.max_new_tokens, stop_token_ids=tuple(eos)) for p in prompts]
    outs, _ = decoder.generate(reqs)
    samples = [EmittedSample.of(p, r) for p, r in zip(prompts, outs, strict=True)]
    t = decoder.target.info
    spec = decoder.features
    write_emitted(
        out, samples, spec, t.hidden_size, target_name, t.rope_axes, "float32", max_length
    )
    return out


def measure(decoder, target, prompts, o, eos, watcher=None) -> dict[str, Any]:
    """Decode `prompts` greedily with `decoder` (the watcher, if any, swaps the newest version
    in between rounds) and check the tokens against plain greedy decoding."""
    reqs = [Request(p, max_tokens=o.max_new_tokens, stop_token_ids=tuple(eos)) for p in prompts]
    cb = None if watcher is None else watcher.between_rounds
    t0 = time.perf_counter()
    outs, stats = decoder.generate(reqs, between_rounds=cb)
    seconds = time.perf_counter() - t0
    plain = greedy_generate(target, prompts, o.max_new_tokens, eos)
    lossless = all(out.token_ids == g for out, g in zip(outs, plain, strict=True))
    by = stats["al_by_version"]
    rounds = sum(v["rounds"] for v in by.values())
    al = sum(v["al"] * v["rounds"] for v in by.values()) / max(rounds, 1)
    return {
        "al": round(al, 4),
        "version": decoder.drafter_version,
        "al_by_version": {str(v): round(x["al"], 4) for v, x in by.items()},
        "rounds": rounds,
        "lossless": lossless,
        "seconds": round(seconds, 2),
    }


def save_plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["target_step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(x, [r["stale"]["al"] for r in rows], "o-", label="stale drafter (version 0)")
    ax.plot(x, [r["online"]["al"] for r in rows], "s-", label="online drafter (hot-swapped)")
    for r in rows:
        ax.annotate(
            f"v{r['online']['version']}",
            (r["target_step"], r["online"]["al"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=7,
        )
    ax.set_xlabel("target fine-tune steps on the shifted mix")
    ax.set_ylabel("acceptance length (same prompts)")
    ax.set_title("A drafter following a moving target")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def format_table(rows: list[dict]) -> str:
    lines = [
        "| t | target steps | stale AL | online AL | online version | lossless |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r["stale"]["lossless"] and r["online"]["lossless"]
        lines.append(
            f"| {r['time']} | {r['target_step']} | {r['stale']['al']:.3f} | "
            f"{r['online']['al']:.3f} | v{r['online']['version']} | {ok} |"
        )
    return "\n".join(lines)


def run_online_drift(cfg: TrainConfig) -> dict[str, Any]:
    """The job (module docstring). Returns the summary: `run_dir`, `rows` (the table),
    `table` / `plot` paths, `versions` (the manifest's)."""
    from tqdm.auto import tqdm

    from drafttrain.jobs.train import train, write_resolved_config
    from drafttrain.zoo.text_data import encode_with_mask

    check_online_config(cfg)
    o = cfg.online
    t_start = time.perf_counter()
    run = Path(cfg.output_dir)
    run.mkdir(parents=True, exist_ok=True)
    write_resolved_config(cfg, run / "training_args.yaml")
    versions = run / "versions"
    data_dir = Path(resolve_path(cfg.data.path))
    base_rows = _rows(data_dir / f"{cfg.data.split}.jsonl")[: cfg.data.max_samples]
    test_rows = _rows(data_dir / "test.jsonl")

    # The shifted mix (train split; the held-out prompts are the test split's questions).
    shifted_dir = run / "shifted"
    if not (shifted_dir / "train.jsonl").is_file():
        _write_jsonl(shifted(base_rows, o.shift, o.shift_fraction), shifted_dir / "train.jsonl")

    # t = 0: the stale drafter (version 0), trained on the original target and data.
    base_target = cfg.target.name_or_path
    per_step = cfg.data.batch_size
    if read_manifest(versions)["latest"] < 0:
        print(f"online_drift: training the drafter on the original target ({o.base_steps} steps)")
        train(drafter_run_config(cfg, run, base_target, cfg.data.path, o.base_steps))
        publish_checkpoint(versions, run / "drafter", per_step, target_step=0)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_path(base_target))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    from drafttrain.zoo.text_data import render_chat

    def prompt_ids(msgs: list[dict]) -> list[int]:
        first_answer = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        text = render_chat(msgs[:first_answer], add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    prompts = [prompt_ids(r["messages"]) for r in test_rows[: o.prompts]]
    # The online trainer's questions: new ones of the shifted mix at every time point.
    need = o.segments * o.train_prompts
    pool: list[list[int]] = []
    for r in _rows(shifted_dir / "train.jsonl"):
        q = prompt_ids(r["messages"])
        if len(q) < cfg.data.max_length:
            pool.append(q)
        if len(pool) == need:
            break
    if len(pool) < need:
        raise DataError(
            f"online.train_prompts={o.train_prompts} x {o.segments} segments needs {need} "
            f"questions of the shifted mix; it has {len(pool)} (data.max_samples)"
        )
    max_len = max(len(p) for p in prompts + pool[:need]) + o.max_new_tokens + o.k + 2

    # The runner: one native target (weights reloaded in place per segment), the stale
    # drafter and the online one (hot-swapped), each its own decoder.
    target = load_native_target(
        resolve_path(base_target), max_batch=o.batch_size, max_seq_len=max_len
    )
    eos = list(target.config.eos_token_ids)
    v0 = versions / read_manifest(versions)["versions"][0]["dir"]
    stale, _ = load_drafter(v0, target.shared_weights())
    online, _ = load_drafter(v0, target.shared_weights())
    kw = dict(max_batch=o.batch_size, max_model_len=max_len)
    stale_dec = SpecDecoder(target, stale, o.k, **kw)
    online_dec = SpecDecoder(target, online, o.k, emit_features=True, **kw)
    watcher = VersionWatcher(versions)

    table_path = run / TABLE
    rows: list[dict] = json.loads(table_path.read_text())["rows"] if table_path.is_file() else []
    done = {r["time"] for r in rows}
    seg_steps = o.target_steps // o.segments
    examples = None
    prev = resolve_path(base_target)
    bar = tqdm(range(o.segments + 1), desc="online_drift", disable=not cfg.trainer.progress)
    for t in bar:
        step = t * seg_steps
        if t > 0:
            snap = run / "targets" / f"step_{step:05d}"
            if not snap.is_dir():
                if examples is None:
                    mix = _rows(shifted_dir / "train.jsonl")
                    examples = [encode_with_mask(tok, r["messages"]) for r in mix]
                    examples = [e for e in examples if len(e[0]) <= cfg.data.max_length]
                fine_tune_segment(prev, snap, examples, pad_id, o, cfg.seed + t)
            prev = str(snap)
        quota_end = o.base_steps + t * o.steps_per_publish
        quota = t > 0 and read_manifest(versions)["versions"][-1]["steps"] < quota_end
        if t in done and not quota:
            continue
        load_weights(target, weight_files(Path(prev)))  # the moved target, in place
        for dec in (stale_dec, online_dec):  # the embedding / head the drafters share
            dec.target_weights_updated()
        if quota:
            # The online runner decodes new questions of the mix on the moved target with its
            # current version (the newest published: what it holds here in an uninterrupted
            # run), emitting the features of what it commits; the trainer's quota trains on
            # them alone, then an atomic publish.
            watcher.between_rounds(online_dec)
            qs = pool[(t - 1) * o.train_prompts : t * o.train_prompts]
            em = rollouts(
                online_dec, qs, o, eos, prev, run / "emitted" / f"t_{t:02d}", cfg.data.max_length
            )
            train(drafter_run_config(cfg, run, prev, str(shifted_dir), quota_end, em))
            publish_checkpoint(versions, run / "drafter", per_step, target_step=step)
        if t in done:
            continue
        row = {
            "time": t,
            "target_step": step,
            "stale": measure(stale_dec, target, prompts, o, eos),
            "online": measure(online_dec, target, prompts, o, eos, watcher),
        }
        rows.append(row)
        bar.set_postfix(stale=row["stale"]["al"], online=row["online"]["al"])
        atomic_write_text(table_path, json.dumps({"rows": rows}, indent=2) + "\n")
    rows.sort(key=lambda r: r["time"])
    plot = save_plot(rows, run / PLOT)
    table = format_table(rows)
    (run / "al_over_time.md").write_text(table + "\n")
    print(table)
    manifest = read_manifest(versions)
    return {
        "run_dir": str(run),
        "rows": rows,
        "table": str(table_path),
        "plot": str(plot),
        "versions": manifest["versions"],
        "seconds": round(time.perf_counter() - t_start, 1),
        "main_process": True,
    }
