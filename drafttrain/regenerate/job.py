"""`regenerate(cfg)`: the job behind `python -m drafttrain.regenerate`.

Rewrites the assistant turns of a chat dataset with the target's own responses, so a drafter
trains on what the target actually says (the distribution it will verify against when served).

Per conversation (`regenerate.turns`):
- `all` (default): every assistant turn, in order; the prompt of turn `m` is the chat
  template over the messages before it, *with the regenerated earlier assistant turns*, and
  `add_generation_prompt=True`;
- `last`: only the last assistant turn; earlier turns keep the dataset's text.
System, user and tool messages, messages after the last assistant turn and the dataset's other
columns are kept as they are. A regenerated assistant message is `{"role": "assistant",
"content": <decoded response>}` (the stop token is not part of the content: the template
writes its own end-of-turn marker when the row is rendered for training), or what the target
family makes of the response (`TrainFamily.assistant_message`: gpt-oss splits its harmony
channels into `thinking` and `content`).

Skipped conversations (not written; counted per reason in the manifest and the summary):
- `no_assistant_turn`: nothing to regenerate, and training would drop the row anyway;
- `prompt_too_long`: a turn's prompt leaves no room for one new token in `max_model_len`;
- `template_error`: the chat template raised on the conversation.

Batching: a shard's conversations advance turn by turn; the prompts of one turn index are
sorted by length (stable) and decoded `batch_size` at a time. Everything is a function of the
shard's rows and the settings, so a rerun reproduces a shard exactly (resume,
`drafttrain.regenerate.manifest`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from draftinfer.decoding.sampling import SamplingParams
from draftinfer.evaluation.chat import normalize_messages
from drafttrain.data.chat import end_of_turn_marker, load_data
from drafttrain.frozen.target import resolve_dtype
from drafttrain.jobs.errors import DataError
from drafttrain.jobs.setup import job_device, setup_target, single_process
from drafttrain.regenerate.backends import (
    HFBackend,
    NativeBackend,
    model_eos_ids,
    pick_backend,
)
from drafttrain.regenerate.config import RegenConfig, check_regen_config
from drafttrain.regenerate.manifest import Manifest
from drafttrain.trainer.shards import sha256_bytes

OUTPUT_FIELD = "messages"
META_FIELD = "regen"


def turn_seed(seed: int, row: int, message: int) -> int:
    """A 63-bit seed for the assistant message `message` of source row `row`."""
    h = hashlib.sha256(f"{seed}:{row}:{message}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def turns_to_regenerate(messages: list[dict[str, Any]], mode: str) -> list[int]:
    """Indices of the assistant messages to regenerate, in order."""
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return idx[-1:] if mode == "last" else idx


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` rendered by the chat template with the generation prompt."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = enc["input_ids"] if hasattr(enc, "keys") else enc
    return [int(t) for t in ids]


def stop_token_ids(tokenizer: Any, eos_ids: list[int]) -> list[int]:
    """What ends a turn: the target's EOS ids, the tokenizer's EOS and the template's
    end-of-turn marker when it is one token (`<|eot_id|>`, `<|im_end|>`)."""
    out = list(eos_ids)
    if tokenizer.eos_token_id is not None:
        out.append(int(tokenizer.eos_token_id))
    marker = end_of_turn_marker(tokenizer)
    if marker:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1:
            out.append(int(ids[0]))
    return list(dict.fromkeys(out))


def regenerate_rows(
    convs: list[list[dict[str, Any]]],
    source_rows: list[int],
    tokenizer: Any,
    backend: Any,
    cfg: Any,  # RegenerateConfig
    max_model_len: int,
    on_done=None,
    message=None,
) -> tuple[list[tuple[int, list[dict[str, Any]], list[dict[str, Any]]] | None], dict]:
    """Regenerate the conversations `convs` (source row ids `source_rows`). `message(text)`:
    a decoded response as the assistant message (the target family's `assistant_message`;
    default `{"role": "assistant", "content": text}`).

    Returns `(results, skipped)`: per conversation `(source_row, messages, turns)` or None
    when skipped, `turns` = `[{"message", "finish_reason", "num_tokens"}]` per regenerated
    turn; `skipped` counts the skipped conversations by reason. `on_done(n)` is called as
    conversations finish (progress bars)."""
    stop = set(backend.stop_ids)
    message = message or (lambda text: {"role": "assistant", "content": text})
    msgs = [normalize_messages(c) for c in convs]
    plan = [turns_to_regenerate(m, cfg.turns) for m in msgs]
    turns: list[list[dict[str, Any]]] = [[] for _ in msgs]
    alive = [bool(p) for p in plan]
    skipped: dict[str, int] = {}

    def skip(i: int, reason: str) -> None:
        alive[i] = False
        skipped[reason] = skipped.get(reason, 0) + 1
        if on_done:
            on_done(1)

    empty = sum(1 for p in plan if not p)
    if empty:
        skipped["no_assistant_turn"] = empty
        if on_done:
            on_done(empty)
    step = 0
    while True:
        pending = [i for i in range(len(msgs)) if alive[i] and step < len(plan[i])]
        if not pending:
            break
        prompts: dict[int, list[int]] = {}
        for i in pending:
            m = plan[i][step]
            try:
                ids = render_prompt(tokenizer, msgs[i][:m])
            except Exception:  # a template's own error (raise_exception, bad roles): skip
                skip(i, "template_error")
                continue
            if not ids or len(ids) >= max_model_len:
                skip(i, "prompt_too_long")
                continue
            prompts[i] = ids
        order = sorted(prompts, key=lambda i: len(prompts[i]))  # stable: ties keep row order
        for b in range(0, len(order), cfg.batch_size):
            group = order[b : b + cfg.batch_size]
            params = [
                SamplingParams(
                    cfg.temperature,
                    cfg.top_k,
                    cfg.top_p,
                    turn_seed(cfg.seed, source_rows[i], plan[i][step]),
                )
                for i in group
            ]
            outs = backend.generate([prompts[i] for i in group], params, cfg.max_new_tokens)
            finished = 0
            for i, (tokens, reason) in zip(group, outs):
                m = plan[i][step]
                body = tokens[:-1] if tokens and tokens[-1] in stop else tokens
                text = tokenizer.decode(body, skip_special_tokens=False)
                msgs[i][m] = message(text)
                turns[i].append({"message": m, "finish_reason": reason, "num_tokens": len(tokens)})
                finished += step == len(plan[i]) - 1
            if on_done and finished:
                on_done(finished)
        step += 1
    results = [(source_rows[i], msgs[i], turns[i]) if alive[i] else None for i in range(len(msgs))]
    return results, skipped


def _source_sha256(convs: list[Any]) -> str:
    return sha256_bytes(json.dumps(convs, sort_keys=True, default=str).encode())


def _settings(cfg: RegenConfig, num_rows: int, backend: str, dtype: torch.dtype, mml: int):
    """Everything that changes the output rows: the manifest's fingerprint covers it."""
    r, t, d = cfg.regenerate, cfg.target, cfg.data
    return {
        "target": {"name_or_path": t.name_or_path, "revision": t.revision},
        "data": {
            "path": d.path,
            "split": d.split,
            "name": d.name,
            "messages_field": d.messages_field,
            "max_samples": d.max_samples,
            "num_rows": num_rows,
        },
        "regenerate": {
            "turns": r.turns,
            "max_new_tokens": r.max_new_tokens,
            "max_model_len": mml,
            "batch_size": r.batch_size,
            "shard_size": r.shard_size,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k,
            "seed": r.seed,
            "backend": backend,
            "dtype": str(dtype).removeprefix("torch."),
        },
    }


def regenerate(cfg: RegenConfig) -> dict[str, Any]:
    """Regenerate (or resume regenerating) `data.split` of `data.path` into
    `regenerate.output_dir`. Returns a summary (`output_dir`, `complete`, totals).

    Bad input (config, target, tokenizer without a chat template, data, a different config
    against an existing output) fails with a one-line `DraftError` before anything is written.
    """
    from draftinfer.evaluation.threads import torch_threads

    check_regen_config(cfg)
    with torch_threads(cfg.regenerate.num_threads):
        return _regenerate(cfg)


def _regenerate(cfg: RegenConfig) -> dict[str, Any]:
    from tqdm.auto import tqdm

    r = cfg.regenerate
    single_process("regeneration")
    ts = setup_target(cfg.target, chat_template=True)  # the job setup training shares
    # Prompts rendered as the family renders training chat (gpt-oss: the harmony date pinned).
    tokenizer, target_path = ts.family.chat_tokenizer(ts.tokenizer), ts.path
    device = job_device(r.device)
    dtype = resolve_dtype(cfg.target.dtype, device)
    backend_name = pick_backend(
        r.backend, target_path, cfg.target.trust_remote_code, cfg.target.revision
    )
    text_cfg = getattr(ts.config, "text_config", None) or ts.config
    limit = getattr(text_cfg, "max_position_embeddings", None)
    max_model_len = min(r.max_model_len, limit) if limit else r.max_model_len
    stop_ids = stop_token_ids(tokenizer, model_eos_ids(target_path, cfg.target))
    if not stop_ids:
        raise DataError(
            f"target {cfg.target.name_or_path!r} declares no EOS token and its chat template "
            "no single-token end-of-turn marker: a turn could never stop"
        )

    data = load_data(cfg.data)
    n = len(data)
    if n == 0:
        raise DataError(f"dataset {cfg.data.path!r} split {cfg.data.split!r} has no rows")
    field = cfg.data.messages_field
    settings = _settings(cfg, n, backend_name, dtype, max_model_len)
    info = {
        "output_field": OUTPUT_FIELD,
        "stop_token_ids": stop_ids,
        "device": device.type,
        "config": {
            "target": asdict(cfg.target),
            "data": asdict(cfg.data),
            "regenerate": asdict(r),
        },
    }
    output = Manifest.open(r.output_dir, settings, cfg.data.split, n, r.shard_size, info)
    todo = [i for i in range(output.num_shards) if i not in output.done()]
    # Source rows of completed shards must be the rows that were regenerated.
    for s in output.shards:
        a, b = s["rows"]
        if _source_sha256(data[a:b][field]) != s["source_sha256"]:
            raise DataError(
                f"source rows {a}..{b - 1} of {cfg.data.path!r} changed since shard {s['index']} "
                f"was written to {r.output_dir!r}; start over in a new regenerate.output_dir"
            )
    summary = {"output_dir": str(output.root), "backend": backend_name}
    if not todo:
        output.remove_temp_files()
        return {**summary, "complete": True, **output.manifest["totals"]}

    if backend_name == "native":
        backend = NativeBackend(target_path, device, dtype, r.batch_size, max_model_len, stop_ids)
    else:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
        backend = HFBackend(
            target_path, ts.family.target_config(cfg.target), device, dtype, max_model_len,
            stop_ids, pad,
        )  # fmt: skip

    output.remove_temp_files()
    output.save()  # the output directory is claimed (fingerprinted) before the first shard
    done_rows = sum(b - a for a, b in (s["rows"] for s in output.shards))
    bar = tqdm(
        total=n,
        initial=done_rows,
        disable=not r.progress,
        desc="regenerating",
        unit="row",
        dynamic_ncols=True,
        file=sys.stderr,
    )
    columns = [c for c in data.column_names if c not in (field, OUTPUT_FIELD, META_FIELD)]
    try:
        for index in todo:
            a, b = output.shard_rows(index)
            chunk = data[a:b]
            convs = chunk[field]
            results, skipped = regenerate_rows(
                convs,
                list(range(a, b)),
                tokenizer,
                backend,
                r,
                max_model_len,
                bar.update,
                ts.family.assistant_message,
            )
            rows, reasons = [], {}
            for j, res in enumerate(results):
                if res is None:
                    continue
                src, messages, turns = res
                row = {c: chunk[c][j] for c in columns}
                row[OUTPUT_FIELD] = messages
                row[META_FIELD] = {"source_row": src, "turns": turns}
                rows.append(row)
                for t in turns:
                    reasons[t["finish_reason"]] = reasons.get(t["finish_reason"], 0) + 1
            stats = {"skipped": skipped, "finish_reasons": reasons}
            output.commit_shard(index, rows, _source_sha256(convs), stats)
    finally:
        bar.close()
    return {**summary, "complete": output.complete, **output.manifest["totals"]}


def format_summary(s: dict[str, Any]) -> str:
    """The lines `python -m drafttrain.regenerate` prints last."""
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(s.get("skipped", {}).items())) or "none"
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.get("finish_reasons", {}).items()))
    return "\n".join(
        [
            f"rows written       {s.get('written', 0)} of {s.get('rows', 0)} ({s['backend']})",
            f"skipped            {skipped}",
            f"turn finish        {reasons or 'none'}",
            f"output             {Path(s['output_dir'])}",
        ]
    )
