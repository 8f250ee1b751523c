"""`run_suites(cfg)`: acceptance suites through the runner, the job behind
`python -m draftinfer drafter=DIR eval=<suite>|standard [temperatures=[0,1]]`.

The target and the drafter (read from disk) load once. Every suite (`draftinfer.evaluation.suites`) is
read, checked and its first-turn prompts rendered before anything is decoded; then, per
suite, per temperature and per turn, the pending requests are decoded in batches of
`batch_size` (`draftinfer.evaluation.suite_decode.decode_batch`: plain decoding of the target alone,
greedy at T=0 and seeded sampling at T>0, then speculative decoding of the same requests and
the lossless check). Each batch is written atomically under
`<out_dir>/requests/<suite>/t<T>/` as soon as it is done, so an interrupted run resumes where
it stopped: a re-run with the same settings reads those back and decodes only what is missing
(`eval.resume`; more prompts than last time decode only the new ones).

A suite with several turns (`first_turn_only: false`) decodes turn t+1 after turn t; its
conversation holds the drafter-decoded replies of the turns before (equal to the target's own
replies at T=0, where the output is lossless).

Out: `<out_dir>/suites.json` (`draftinfer.evaluation.suite_report.SuitesReport`), `suites.png`, the table
(printed by `__main__`) and, when the drafter directory has a model card, its "Acceptance by
benchmark" section.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import torch

from draftinfer.evaluation.config import InferConfig
from draftinfer.evaluation.suite_decode import (
    Decoding,
    PromptRenderer,
    SuiteStore,
    decode_batch,
    suite_result,
)
from draftinfer.evaluation.suite_report import (
    PLOT_NAME,
    SUITES_DIR,
    SuitesReport,
    card_section,
    save_suites_plot,
    splice_card_section,
)
from draftinfer.evaluation.suites import SuiteConfig, SuiteRow, load_suite, suite_rows, suite_source
from draftinfer.files.checkpoint import NATIVE_DRAFTER
from draftinfer.files.errors import ConfigError
from draftinfer.files.paths import resolve_path

# Request seeds: `seed + row + TURN_STRIDE * turn` (a request's randomness is its own, T4).
TURN_STRIDE = 1_000_003


def check_suites_config(cfg: InferConfig) -> list[float]:
    """One-line errors before any loading; returns the temperatures to run."""
    from draftinfer.evaluation.run import check_infer_config

    check_infer_config(cfg)
    if cfg.drafter == NATIVE_DRAFTER and not cfg.eval.out_dir:
        raise ConfigError(
            f"drafter={NATIVE_DRAFTER}: give eval.out_dir=DIR (the results of the target's own "
            "drafter layers have no export directory to go in)"
        )
    if cfg.report:
        raise ConfigError(
            "report= is the held-out run's JSON; a suite run writes <eval.out_dir>/suites.json"
        )
    default = InferConfig()
    for name, instead in (
        ("prompts", "eval.path= (a local copy) or a suite"),
        ("prompts_split", "a suite's split"),
        ("num_prompts", "eval.num_prompts="),
        ("max_new_tokens", "eval.max_new_tokens="),
    ):
        if getattr(cfg, name) != getattr(default, name):
            raise ConfigError(f"{name}= is for the held-out run (no suite); suites take {instead}")
    temps = [float(t) for t in (cfg.temperatures or [cfg.temperature])]
    if any(not t >= 0.0 for t in temps) or len(set(temps)) != len(temps):
        raise ConfigError(f"temperatures must be distinct and >= 0, got {temps}")
    names = list(cfg.eval.suites)
    if len(set(names)) != len(names):
        raise ConfigError(f"eval.suites names a suite twice: {names}")
    e = cfg.eval
    for name in ("num_prompts", "max_new_tokens"):
        v = getattr(e, name)
        if v is not None and v < 1:
            raise ConfigError(f"eval.{name} must be >= 1, got {v}")
    return temps


def _with_overrides(suite: SuiteConfig, cfg: InferConfig) -> SuiteConfig:
    e = cfg.eval
    over = {
        k: v
        for k, v in (
            ("num_prompts", e.num_prompts),
            ("max_new_tokens", e.max_new_tokens),
            ("enable_thinking", e.enable_thinking),
        )
        if v is not None
    }
    return dataclasses.replace(suite, **over)


def _drafter_identity(drafter: str) -> dict[str, object]:
    """What identifies the drafter's files: config.json's hash and each weight file's size and
    modification time (a re-export invalidates stored results)."""
    d = Path(drafter)
    return {
        "path": str(d.resolve()),
        "config_sha256": hashlib.sha256((d / "config.json").read_bytes()).hexdigest(),
        "weights": sorted(
            [p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in d.glob("*.safetensors")
        ),
    }


def _base_dir(source: str) -> Path | None:
    from draftinfer.evaluation.chat import data_base_dir

    return None if source.startswith(("http://", "https://")) else data_base_dir(source)


def run_suites(cfg: InferConfig) -> SuitesReport:
    from tqdm.auto import tqdm

    from draftinfer.evaluation.run import (
        load_served_drafter,
        pick_device,
        pick_dtype,
        plain_step,
        resolve_fast_path,
        served_drafter_config,
        serving_transforms,
        spec_decoder,
    )
    from draftinfer.files.loading import load_native_target
    from draftinfer.registry import family_of

    device = pick_device(cfg.device)
    cfg = resolve_fast_path(cfg, device)
    temps = check_suites_config(cfg)
    suites = [_with_overrides(load_suite(n), cfg) for n in cfg.eval.suites]
    dtype = pick_dtype(cfg.dtype, device)
    spec, arch, meta = served_drafter_config(cfg)
    target_name = cfg.target or meta.get("target") or ""
    if not target_name:
        raise ConfigError("target=... is required: the drafter does not record its target")
    target_path = resolve_path(target_name)
    family = family_of(target_path)  # from config.json alone: refusals before any loading
    for s in suites:
        if s.image and not family.takes_images:
            raise ConfigError(
                f"suite {s.name!r} has image prompts; target {target_name!r} "
                f"(family {family.name!r}) takes text only"
            )
    # Every suite's rows before any decoding: a bad suite fails in seconds, not after hours.
    sources = [suite_source(s, cfg.eval.path, len(suites)) for s in suites]
    rows = [suite_rows(s, src) for s, src in zip(suites, sources)]

    target = load_native_target(
        target_path, device, dtype, max_batch=cfg.batch_size, max_seq_len=cfg.max_model_len
    )
    spec.check_fit(arch, target.info)
    spec.check_k(arch, cfg.k)
    drafter = load_served_drafter(cfg, target, device, dtype)
    serving_transforms(cfg, target, drafter, device)  # as `run_eval`
    renderer = PromptRenderer(family, target_path, cfg.max_model_len)
    first_turns = [
        {
            r.row: renderer.render(
                r.conversation([]),
                f"suite {s.name!r} row {r.row}",
                {"enable_thinking": s.enable_thinking},
                _base_dir(src),
            )
            for r in rs
        }
        for s, src, rs in zip(suites, sources, rows)
    ]
    decoder = spec_decoder(cfg, target, drafter, renderer.tokenizer)
    d = Decoding(
        target,
        drafter,
        decoder,
        renderer.tokenizer,
        cfg.k,
        cfg.verify,
        cfg.top_k,
        cfg.top_p,
        cfg.max_model_len,
        cfg.mode,
        cfg.check_reference,
        cfg.eval.check_sampled,
        tuple(target.config.eos_token_ids),
        plain_step=plain_step(cfg, target),
    )
    out_dir = Path(cfg.eval.out_dir or Path(cfg.drafter) / SUITES_DIR)
    # The files the drafter is read from: an export, or the target's own (drafter=native).
    identity = _drafter_identity(target_path if cfg.drafter == NATIVE_DRAFTER else cfg.drafter)
    stores = {}
    for s, src in zip(suites, sources):
        for t in temps:
            settings = {
                "drafter": identity,
                "target": target_name,
                "device": device.type,
                "dtype": str(dtype),
                "mode": cfg.mode,
                "k": cfg.k,
                "verify": cfg.verify,
                "top_k": cfg.top_k,
                "top_p": cfg.top_p,
                "seed": cfg.seed,
                "temperature": t,
                "max_model_len": cfg.max_model_len,
                "source": src,
                # Drafts differ when the drafter rotates 1-D (absent when native: old stores
                # keep resuming).
                **(
                    {}
                    if cfg.drafter_positions == "native"
                    else {"drafter_positions": cfg.drafter_positions}
                ),
                # Every field that changes a request's output; more prompts resume.
                "suite": {k: v for k, v in dataclasses.asdict(s).items() if k != "num_prompts"},
            }
            stores[s.name, t] = SuiteStore(
                out_dir / "requests" / s.name / f"t{t:g}", settings, cfg.eval.resume
            )
    todo = sum(len(r.turns) for rs in rows for r in rs) * len(temps) - sum(
        len(st.records) for st in stores.values()
    )
    bar = tqdm(total=max(todo, 0), disable=not cfg.progress, desc="suites", unit="req")
    results = []
    for s, src, rs, firsts in zip(suites, sources, rows, first_turns):
        for t in temps:
            store = stores[s.name, t]
            skipped = _run_suite(s, t, rs, firsts, store, d, renderer, cfg, _base_dir(src), bar)
            results.append(
                suite_result(
                    s,
                    t,
                    src,
                    store,
                    len(rs),
                    skipped,
                    cfg.k,
                    "greedy" if t == 0.0 else f"rejection sampling (q {cfg.verify})",
                    "plain_greedy" if t == 0.0 else "reference_loop",
                )
            )
    bar.close()
    report = SuitesReport(
        drafter=str(cfg.drafter),
        drafter_kind=spec.name,
        target=target_name,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        dtype=str(dtype).removeprefix("torch."),
        mode=cfg.mode,
        k=cfg.k,
        verify=cfg.verify,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        batch_size=cfg.batch_size,
        max_model_len=cfg.max_model_len,
        results=results,
    )
    report.write(out_dir)
    plot = save_suites_plot(report, out_dir / PLOT_NAME)
    card = Path(cfg.drafter) / "README.md"
    if cfg.eval.card and cfg.drafter != NATIVE_DRAFTER and card.is_file():
        rel = os.path.relpath(plot, card.parent)
        splice_card_section(card, card_section(report, None if rel.startswith("..") else rel))
    return report


def _run_suite(
    suite: SuiteConfig,
    temperature: float,
    rows: list[SuiteRow],
    firsts: dict,
    store: SuiteStore,
    d: Decoding,
    renderer: PromptRenderer,
    cfg: InferConfig,
    base_dir: Path | None,
    bar,
) -> int:
    """Decode what `store` lacks of `suite` at `temperature`, turn by turn; returns how many
    requests were skipped (prompts that do not fit `max_model_len`)."""
    skipped = 0
    dead: set[int] = set()  # rows whose earlier turn was skipped
    for turn in range(max(len(r.turns) for r in rows)):
        todo = []
        for r in rows:
            if len(r.turns) <= turn:
                continue
            if r.row in dead:
                skipped += 1
                continue
            if f"r{r.row}t{turn}" in store.records:
                continue
            if turn == 0:
                prompt = firsts[r.row]
            else:
                history = [store.records[f"r{r.row}t{j}"].text for j in range(turn)]
                prompt = renderer.render(
                    r.conversation(history),
                    f"suite {suite.name!r} row {r.row} turn {turn}",
                    {"enable_thinking": suite.enable_thinking},
                    base_dir,
                )
            if prompt is None:
                skipped += 1
                dead.add(r.row)
                continue
            todo.append((r.row, prompt))
        for i in range(0, len(todo), cfg.batch_size):
            batch = todo[i : i + cfg.batch_size]
            d.warm_up(batch[0][1])
            records, _, t_plain, t_spec = decode_batch(
                d,
                [p for _, p in batch],
                [(row, turn) for row, _ in batch],
                temperature,
                suite.max_new_tokens,
                [cfg.seed + row + TURN_STRIDE * turn for row, _ in batch],
            )
            store.add(records, t_plain, t_spec)
            bar.update(len(batch))
    return skipped
