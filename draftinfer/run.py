"""`run_eval(cfg)`: the job behind `python -m draftinfer`.

Loads an exported drafter from disk and its target, decodes the prompts twice (plain greedy
decoding of the target alone, then speculative decoding), and reports in one run:
acceptance length, per-position acceptance, whether the speculative output is lossless,
tokens/s of both and the speedup. The report is JSON, with a PNG of per-position acceptance
beside it.

Lossless means: at temperature 0, every request's tokens equal plain greedy decoding
token for token; at temperature > 0 (where equality with plain sampling is not the
criterion), the fast path equals the reference loop on the same seeds and the sampler's
distribution is pinned by tests (T2).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from draftinfer.checkpoint import load_drafter, read_drafter_config
from draftinfer.config import InferConfig
from draftinfer.engine import Request, SpecDecoder
from draftinfer.errors import CheckpointError, ConfigError
from draftinfer.metrics import acceptance_length, per_position_acceptance
from draftinfer.paths import resolve_path
from draftinfer.sampling import SamplingParams


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise ConfigError(f"dtype must be auto or one of {sorted(table)}, got {name!r}")
    return table[name]


def check_fit(drafter_cfg, target) -> None:
    """One-line errors when the drafter was not made for this target."""
    tc = target.config
    if drafter_cfg.vocab_size != tc.vocab_size:
        raise CheckpointError(
            f"drafter vocabulary {drafter_cfg.vocab_size} does not match the "
            f"target's {tc.vocab_size}"
        )
    if drafter_cfg.target_hidden_size != tc.hidden_size:
        raise CheckpointError(
            f"drafter expects target hidden size "
            f"{drafter_cfg.target_hidden_size}, target has {tc.hidden_size}"
        )
    bad = [j for j in drafter_cfg.aux_layer_ids if not 0 <= j < tc.num_layers]
    if bad:
        raise CheckpointError(
            f"drafter taps target layers {bad}; the target has {tc.num_layers} layers"
        )


def load_prompts(cfg: InferConfig, tokenizer) -> list[list[int]]:
    """Token ids of each prompt, rendered with the target's chat template."""
    path = resolve_path(cfg.prompts)
    if path.endswith(".txt"):
        if not Path(path).is_file():
            raise ConfigError(f"prompts file not found: {cfg.prompts}")
        convs = [
            [{"role": "user", "content": ln}]
            for ln in Path(path).read_text().splitlines()
            if ln.strip()
        ]
    else:
        from drafttrain.config import DataConfig  # the same loader training uses
        from drafttrain.data import load_chat_dataset, normalize_messages

        ds = load_chat_dataset(DataConfig(path=cfg.prompts, split=cfg.prompts_split))
        convs = []
        for row in ds:
            msgs = normalize_messages(row["messages"])
            first_asst = next(
                (i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs)
            )
            if first_asst:
                convs.append(msgs[:first_asst])
    convs = convs[: cfg.num_prompts]
    if not convs:
        raise ConfigError(f"no prompts in {cfg.prompts!r}")
    out = []
    for c in convs:
        enc = tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        out.append([int(t) for t in ids][: cfg.max_model_len - 2])
    return out


def save_acceptance_plot(per_pos: list[float], al: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    xs = list(range(1, len(per_pos) + 1))
    ax.bar(xs, per_pos, color="#3b7dd8")
    for x, v in zip(xs, per_pos):
        ax.text(x, v + 0.02, f"{v:.2f}", ha="center", fontsize=8)
    ax.set_ylim(0, 1.08)
    ax.set_xticks(xs)
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(drafts 1..j all accepted)")
    ax.set_title(f"{title}\nAL = {al:.3f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_eval(cfg: InferConfig) -> dict[str, Any]:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from draftinfer.models import greedy_generate, load_native_target
    from draftinfer.reference import reference_generate

    if not cfg.drafter:
        raise ConfigError("drafter=DIR is required (an exported drafter directory)")
    if cfg.mode not in ("fast", "reference"):
        raise ConfigError(f"mode must be fast or reference, got {cfg.mode!r}")
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    _, arch, meta = read_drafter_config(cfg.drafter)
    target_name = cfg.target or meta.get("target") or ""
    if not target_name:
        raise ConfigError("target=... is required: the drafter does not record its target")
    target_path = resolve_path(target_name)
    target = load_native_target(
        target_path, device, dtype, max_batch=cfg.batch_size, max_seq_len=cfg.max_model_len
    )
    check_fit(arch, target)
    drafter, _ = load_drafter(
        cfg.drafter, embed_tokens=target.embed_tokens.weight, device=device, dtype=dtype
    )
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    prompts = load_prompts(cfg, tokenizer)
    eos = list(target.config.eos_token_ids)
    requests = [
        Request(
            p,
            SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed + i),
            max_tokens=cfg.max_new_tokens,
            stop_token_ids=tuple(eos),
        )
        for i, p in enumerate(prompts)
    ]
    bar = tqdm(
        total=2 * len(prompts),
        disable=not cfg.progress,
        desc="draftinfer",
        unit="req",
        dynamic_ncols=True,
    )

    # Plain greedy decoding of the target alone: the lossless reference and the speed baseline.
    greedy_generate(target, prompts[:1], 2, eos)  # warm-up (allocations, kernels)
    _sync(device)
    t0 = time.perf_counter()
    plain = greedy_generate(target, prompts, cfg.max_new_tokens, eos)
    _sync(device)
    t_plain = time.perf_counter() - t0
    bar.update(len(prompts))

    decoder = SpecDecoder(
        target,
        drafter,
        cfg.k,
        max_batch=cfg.batch_size,
        max_model_len=cfg.max_model_len,
        verify=cfg.verify,
        prefill_chunk=cfg.prefill_chunk,
        tokenizer=tokenizer,
    )
    if cfg.mode == "fast":
        decoder.generate(requests[:1])  # warm-up
        outs, stats = decoder.generate(requests, on_finish=lambda: bar.update(1))
        t_spec = stats["seconds"]
    else:
        t0 = time.perf_counter()
        outs = reference_generate(
            target, drafter, requests, cfg.k, cfg.max_model_len, cfg.verify, tokenizer
        )
        t_spec = time.perf_counter() - t0
        bar.update(len(prompts))
    bar.close()

    accepted = [a for o in outs for a in o.accepted]
    proposed = [p for o in outs for p in o.proposed]
    al = acceptance_length(accepted)
    per_pos = per_position_acceptance(accepted, proposed, cfg.k)
    mismatches = []
    if cfg.temperature == 0.0:
        for i, (o, p) in enumerate(zip(outs, plain)):
            if o.token_ids != p:
                first = next(
                    (j for j, (a, b) in enumerate(zip(o.token_ids, p)) if a != b),
                    min(len(o.token_ids), len(p)),
                )
                mismatches.append({"prompt": i, "first_mismatch": first})
        lossless_check = "plain_greedy"
    else:
        lossless_check = "reference_loop"
    if cfg.check_reference or (cfg.temperature != 0.0 and cfg.mode == "fast"):
        refs = reference_generate(
            target, drafter, requests, cfg.k, cfg.max_model_len, cfg.verify, tokenizer
        )
        for i, (o, r) in enumerate(zip(outs, refs)):
            if o.token_ids != r.token_ids and not any(m["prompt"] == i for m in mismatches):
                mismatches.append({"prompt": i, "reference_mismatch": True})
    n_plain = sum(len(p) for p in plain)
    n_spec = sum(len(o.token_ids) for o in outs)
    report = {
        "drafter": str(cfg.drafter),
        "target": target_name,
        "drafter_kind": arch.kind,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "mode": cfg.mode,
        "k": cfg.k,
        "temperature": cfg.temperature,
        "verify": cfg.verify,
        "num_prompts": len(prompts),
        "batch_size": cfg.batch_size,
        "max_new_tokens": cfg.max_new_tokens,
        "rounds": len(accepted),
        "acceptance_length": al,
        "per_position_acceptance": per_pos,
        "lossless": not mismatches,
        "lossless_check": lossless_check,
        "mismatches": mismatches,
        "tokens_plain": n_plain,
        "tokens_spec": n_spec,
        "tokens_per_s_plain": n_plain / t_plain,
        "tokens_per_s_spec": n_spec / t_spec,
        "speedup": (n_spec / t_spec) / (n_plain / t_plain),
    }
    if cfg.report:
        path = Path(cfg.report)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        save_acceptance_plot(
            per_pos,
            al,
            f"{arch.kind} k={cfg.k} on {Path(target_name).name}",
            path.with_suffix(".png"),
        )
    return report


def format_report(r: dict[str, Any]) -> str:
    """The short table `python -m draftinfer` prints last."""
    pos = " ".join(f"{v:.2f}" for v in r["per_position_acceptance"])
    rows = [
        ("drafter", f"{r['drafter_kind']} {r['drafter']}"),
        ("target", f"{r['target']} ({r['device']}, {r['dtype']})"),
        ("k / temperature", f"{r['k']} / {r['temperature']}"),
        ("prompts / rounds", f"{r['num_prompts']} / {r['rounds']}"),
        ("acceptance length", f"{r['acceptance_length']:.3f}"),
        ("per-position acceptance", pos),
        ("lossless", f"{r['lossless']} ({r['lossless_check']})"),
        ("tokens/s plain | spec", f"{r['tokens_per_s_plain']:.1f} | {r['tokens_per_s_spec']:.1f}"),
        ("speedup", f"{r['speedup']:.2f}x"),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)
