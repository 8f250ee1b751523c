"""`run_eval(cfg)`: the job behind `python -m draftinfer`.

Loads an exported drafter from disk and its target, decodes the prompts twice (plain greedy
decoding of the target alone, then speculative decoding), and reports in one run:
acceptance length, per-position acceptance, whether the speculative output is lossless,
tokens/s of both and the speedup. The report is JSON, with a PNG of per-position acceptance
beside it.

Prompts come from the same `messages` data training reads: a target with a processor
(Qwen3-VL) takes image+text conversations (`draftinfer.evaluation.prompts.load_prompts`), and the plain
baseline, the speculative run and the reference loop all feed the images through the
target's `prefill_plan`, so the lossless check covers image prompts.

Lossless means: at temperature 0, every request's tokens equal plain greedy decoding
token for token; at temperature > 0 (where equality with plain sampling is not the
criterion), the fast path equals the reference loop on the same seeds and the sampler's
distribution is pinned by tests (T2).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from draftinfer.conventions.metrics import (
    acceptance_length,
    choose_k,
    per_position_acceptance,
)
from draftinfer.conventions.slots import Slots
from draftinfer.decoding.baseline import PlainStep
from draftinfer.decoding.compiled import unknown_inductor_settings
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.sampling import SamplingParams
from draftinfer.evaluation.calibration import calibration_report, threshold_sweep
from draftinfer.evaluation.config import InferConfig
from draftinfer.evaluation.prompts import load_prompts
from draftinfer.evaluation.ranks import is_writer, join_ranks
from draftinfer.evaluation.report import RunReport
from draftinfer.files.checkpoint import (
    NATIVE_DRAFTER,
    load_drafter,
    load_released_drafter,
    read_drafter_config,
    released_drafter_config,
)
from draftinfer.files.errors import ConfigError
from draftinfer.files.paths import resolve_path
from draftinfer.models.rope import POSITION_MODES, serve_positions_1d
from draftinfer.registry import family_spec


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


BASELINES = ("auto", "compiled", "eager")


def resolve_fast_path(cfg: InferConfig, device: torch.device) -> InferConfig:
    """`cfg` with the device's defaults filled in (`compile` and `cuda_graphs` null: on for
    CUDA, graphs with compile; off on the CPU) and its plain baseline named (`auto`: compiled
    when the fast path is on, else eager)."""
    cuda = device.type == "cuda"
    comp = cuda if cfg.compile is None else bool(cfg.compile)
    graphs = (cuda and comp) if cfg.cuda_graphs is None else bool(cfg.cuda_graphs)
    base = cfg.baseline
    if base == "auto":
        base = "compiled" if comp else "eager"
    return replace(cfg, compile=comp, cuda_graphs=graphs, baseline=base)


def check_infer_config(cfg: InferConfig) -> None:
    """One-line `ConfigError`s for values that would fail later (after loading and decoding)."""
    from draftinfer.decoding.verify import VERIFY_MODES

    if cfg.baseline not in BASELINES:
        raise ConfigError(f"baseline must be one of {list(BASELINES)}, got {cfg.baseline!r}")
    if not cfg.drafter:
        raise ConfigError(
            "drafter=DIR is required (an exported drafter directory, or native: the target's "
            "own drafter layers)"
        )
    if cfg.mode not in ("fast", "reference"):
        raise ConfigError(f"mode must be fast or reference, got {cfg.mode!r}")
    if cfg.verify not in VERIFY_MODES:
        raise ConfigError(f"verify must be one of {VERIFY_MODES}, got {cfg.verify!r}")
    for name in ("k", "batch_size", "num_prompts", "max_new_tokens", "prefill_chunk"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.drafter_positions not in POSITION_MODES:
        raise ConfigError(
            f"drafter_positions must be one of {POSITION_MODES}, got {cfg.drafter_positions!r}"
        )
    if cfg.max_model_len < 4:
        raise ConfigError(f"max_model_len must be >= 4, got {cfg.max_model_len}")
    if cfg.compile_options is not None and not isinstance(cfg.compile_options, dict):
        raise ConfigError(
            f"compile_options must be a mapping of inductor settings (or null), got "
            f"{cfg.compile_options!r}"
        )
    if cfg.compile_options:
        if not cfg.compile:
            raise ConfigError("compile_options are inductor settings for compile=true; it is false")
        if bad := unknown_inductor_settings(cfg.compile_options):
            raise ConfigError(
                f"compile_options: {bad[0]!r} is not an inductor setting (torch._inductor.config)"
            )
    if cfg.tp < 1:
        raise ConfigError(f"tp must be >= 1, got {cfg.tp}")
    tau = cfg.verify_threshold
    if tau is not None and not 0.0 < tau <= 1.0:
        raise ConfigError(f"verify_threshold must be in (0, 1] or null (off), got {tau}")
    if (tau is not None or cfg.confidence_report) and cfg.mode != "fast":
        raise ConfigError(
            "verify_threshold / confidence_report need mode=fast (the reference loop verifies "
            "whole blocks and records no confidences)"
        )
    temps = cfg.temperatures or [cfg.temperature]
    if tau is not None and cfg.eval.suites and cfg.eval.check_sampled and max(temps) > 0:
        raise ConfigError(
            "verify_threshold at temperature > 0: the suites' reference-loop check verifies "
            "whole blocks and draws other samples; set eval.check_sampled=false"
        )
    if any(not 0.0 < t <= 1.0 for t in cfg.threshold_sweep):
        raise ConfigError(f"threshold_sweep values must be in (0, 1], got {cfg.threshold_sweep}")
    if cfg.tp > 1:
        if cfg.eval.suites:
            raise ConfigError(
                f"tp={cfg.tp} runs the held-out prompts (eval=greedy|sampling); acceptance "
                "suites are not served tensor-parallel yet"
            )
        if cfg.fuse_projections or cfg.skinny_gemm:
            raise ConfigError(
                f"tp={cfg.tp}: fuse_projections and skinny_gemm are not built for a sharded "
                "target yet (set them false)"
            )
    if not cfg.temperature >= 0.0 or not 0.0 < cfg.top_p <= 1.0 or cfg.top_k < -1:
        raise ConfigError(
            f"sampling needs temperature >= 0, 0 < top_p <= 1, top_k >= -1; got "
            f"{cfg.temperature}, {cfg.top_p}, {cfg.top_k}"
        )


def read_round_costs(path: str) -> dict[int, float]:
    """`{K: cost in plain steps}` from a `round_costs=` file; a one-line `ConfigError` when it
    is missing or not of that shape."""
    try:
        table = json.loads(Path(path).read_text())["round_cost"]
        costs = {int(k): float(v) for k, v in table.items()}
    except FileNotFoundError:
        raise ConfigError(f"round_costs: no file {path}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f'round_costs: {path} is not {{"round_cost": {{K: plain steps}}}} ({e!r})'
        ) from None
    if not costs or any(k < 1 or not v > 0 for k, v in costs.items()):
        raise ConfigError(f"round_costs: {path} needs K >= 1 with costs > 0, got {costs}")
    return costs


def served_drafter_config(cfg: InferConfig) -> tuple[Any, Any, dict[str, Any]]:
    """(kind spec, architecture config, meta) of the drafter `cfg.drafter` names: an exported
    directory, or `native`, the drafter layers the target ships in its own files (then
    `target=` is required; `draftinfer.files.checkpoint.released_drafter_config`)."""
    if cfg.drafter != NATIVE_DRAFTER:
        return read_drafter_config(cfg.drafter)
    if not cfg.target:
        raise ConfigError(
            f"drafter={NATIVE_DRAFTER} serves the target's own drafter layers: target=... is "
            "required"
        )
    return released_drafter_config(resolve_path(cfg.target))


def load_served_drafter(cfg: InferConfig, target, device: torch.device, dtype: torch.dtype):
    """The exported drafter (or, `drafter=native`, the target's own drafter layers read from
    its files), attached to the target's shared weights, rotating positions as
    `cfg.drafter_positions` says."""
    if cfg.drafter == NATIVE_DRAFTER:
        drafter, _ = load_released_drafter(
            resolve_path(cfg.target), target.shared_weights(), device=device, dtype=dtype
        )
    else:
        drafter, _ = load_drafter(cfg.drafter, target.shared_weights(), device=device, dtype=dtype)
    if cfg.drafter_positions == "1d":
        serve_positions_1d(drafter)
    return drafter


def serving_transforms(cfg: InferConfig, target, drafter, device: torch.device) -> None:
    """How the runner's kernels run (`draftinfer.models.transforms`; the same weights and
    maths): q/k/v and gate/up fused into one GEMM each in target and drafter
    (`cfg.fuse_projections`), the skinny-GEMM kernel for both (`cfg.skinny_gemm`); null = on
    for CUDA. And programmatic dependent launch for what is compiled and launched from here on
    (`cfg.pdl`; a process-wide switch, this job's); null = on for CUDA with `cfg.compile`
    (measured there, between inductor's kernels), elsewhere as the process has it
    (`DRAFTKERNELS_PDL`).

    The target is transformed once: what was applied is recorded on it (`SERVED_WITH`), so a
    suite or a sweep serving several drafters (or several K) over one target calls this for
    each drafter and the target is left as it is; a call asking the same target for other
    transforms is a one-line `ConfigError` (load the target again for them). `target=None` or
    `drafter=None` skips that side."""
    from draftkernels.runtime import enable_pdl

    from draftinfer.models.transforms import fuse_projections, use_skinny_gemm

    cuda = device.type == "cuda"
    if cfg.pdl is not None or (cuda and cfg.compile):
        enable_pdl(True if cfg.pdl is None else cfg.pdl)
    default = cuda and cfg.tp == 1  # not yet for a sharded target (`check_infer_config`)
    fuse = default if cfg.fuse_projections is None else bool(cfg.fuse_projections)
    skinny = default if cfg.skinny_gemm is None else bool(cfg.skinny_gemm)
    want = {"fuse_projections": fuse, "skinny_gemm": skinny}
    models = [drafter]
    if target is not None:
        done = getattr(target, SERVED_WITH, None)
        if done is None:
            models.append(target)
            setattr(target, SERVED_WITH, want)
        elif done != want:
            raise ConfigError(
                f"this target is already served with {done}; {want} needs it loaded again"
            )
    for model in (m for m in models if m is not None):
        if fuse:
            fuse_projections(model)
        if skinny:
            use_skinny_gemm(model)


# The attribute a served target records its serving transforms in (`serving_transforms`).
SERVED_WITH = "draftinfer_serving_transforms"


def runner_prompts(cfg: InferConfig, target, target_path) -> tuple[list, object]:
    """(prompts, tokenizer) of a run: `cfg.prompts` rendered by the target's family (text
    families through the tokenizer's chat template, a multimodal one through its processor,
    each prompt carrying `mm_inputs`), each at most `max_model_len - 2` tokens."""
    return load_prompts(
        cfg.prompts,
        cfg.prompts_split,
        cfg.num_prompts,
        family_spec(target.info.family),
        target_path,
        cfg.max_model_len - 2,
    )


def spec_decoder(cfg: InferConfig, target, drafter, tokenizer) -> SpecDecoder:
    """The speculative decoder the runner's config describes (`run_eval`, the suites)."""
    return SpecDecoder(
        target,
        drafter,
        cfg.k,
        max_batch=cfg.batch_size,
        max_model_len=cfg.max_model_len,
        verify=cfg.verify,
        prefill_chunk=cfg.prefill_chunk,
        tokenizer=tokenizer,
        compile=bool(cfg.compile),
        compile_options=None if cfg.compile_options is None else dict(cfg.compile_options),
        cuda_graphs=bool(cfg.cuda_graphs),
        pipeline=cfg.pipeline,
        verify_threshold=cfg.verify_threshold,
        record_confidence=cfg.confidence_report,
    )


def plain_step(cfg: InferConfig, target) -> PlainStep | None:
    """The plain decode step the report's baseline runs (`cfg.baseline`, resolved by
    `resolve_fast_path`): `PlainStep` compiled as the round is (and graph-replayed when the
    round is), or None for the eager loop."""
    if cfg.baseline == "eager":
        return None
    return PlainStep(
        target,
        compile=True,
        cuda_graphs=bool(cfg.cuda_graphs),
        compile_options=None if cfg.compile_options is None else dict(cfg.compile_options),
    )


def load_target(cfg: InferConfig, target_path, device: torch.device, dtype: torch.dtype):
    """The native target with a cache of `batch_size` rows x `max_model_len`; under `tp > 1`
    this rank's shard of it (its family's plan, `draftinfer.models.tensor_parallel`)."""
    from draftinfer.files.loading import load_native_target
    from draftinfer.models.tensor_parallel import apply_tensor_parallel

    target = load_native_target(
        target_path, device, dtype, max_batch=cfg.batch_size, max_seq_len=cfg.max_model_len
    )
    if cfg.tp > 1:
        apply_tensor_parallel(target)
    return target


def run_eval(cfg: InferConfig) -> RunReport:
    from tqdm.auto import tqdm

    from draftinfer.decoding.baseline import greedy_generate
    from draftinfer.decoding.reference import reference_generate

    device = pick_device(cfg.device)
    cfg = resolve_fast_path(cfg, device)
    check_infer_config(cfg)
    device = join_ranks(cfg.tp, device)  # tp > 1: this rank's device, the process group joined
    round_costs = read_round_costs(cfg.round_costs) if cfg.round_costs else None
    dtype = pick_dtype(cfg.dtype, device)
    spec, arch, meta = served_drafter_config(cfg)
    target_name = cfg.target or meta.get("target") or ""
    if not target_name:
        raise ConfigError("target=... is required: the drafter does not record its target")
    target_path = resolve_path(target_name)
    target = load_target(cfg, target_path, device, dtype)
    spec.check_fit(arch, target.info)
    spec.check_k(arch, cfg.k)
    drafter = load_served_drafter(cfg, target, device, dtype)
    serving_transforms(cfg, target, drafter, device)
    loaded, tokenizer = runner_prompts(cfg, target, target_path)
    prompts = [p.ids for p in loaded]
    mm = [p.mm_inputs for p in loaded]
    eos = list(target.config.eos_token_ids)
    requests = [
        Request(
            p.ids,
            SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed + i),
            max_tokens=cfg.max_new_tokens,
            stop_token_ids=tuple(eos),
            mm_inputs=p.mm_inputs,
        )
        for i, p in enumerate(loaded)
    ]
    bar = tqdm(
        total=2 * len(prompts),
        disable=not cfg.progress or not is_writer(),
        desc="draftinfer",
        unit="req",
        dynamic_ncols=True,
    )

    # Warm-up, paid once per process (and, for what inductor compiles, once per machine: its
    # caches persist across processes): the plain step's and the decoder's compiles and
    # CUDA-graph captures, on the first prompt.
    step = plain_step(cfg, target)
    decoder = spec_decoder(cfg, target, drafter, tokenizer)
    t0 = time.perf_counter()
    greedy_generate(target, prompts[:1], cfg.max_new_tokens, eos, step_fn=step, mm_inputs=mm[:1])
    _sync(device)
    t1 = time.perf_counter()
    if cfg.mode == "fast":
        decoder.generate(requests[:1])
    _sync(device)
    warmup_s, warmup_plain_s = time.perf_counter() - t0, t1 - t0

    # Plain greedy decoding of the target alone: the lossless reference and the speed baseline.
    plain_stats: dict = {}
    plain = greedy_generate(
        target, prompts, cfg.max_new_tokens, eos, step_fn=step, mm_inputs=mm, stats=plain_stats
    )
    bar.update(len(prompts))

    if cfg.mode == "fast":
        outs, stats = decoder.generate(requests, on_finish=lambda: bar.update(1))
        rounds_s = stats["round_seconds"]
    else:
        t0 = time.perf_counter()
        outs = reference_generate(
            target, drafter, requests, cfg.k, cfg.max_model_len, cfg.verify, tokenizer
        )
        rounds_s = [time.perf_counter() - t0]  # one span: the reference loop has no rounds
        bar.update(len(prompts))
    bar.close()

    accepted = [a for o in outs for a in o.accepted]
    proposed = [p for o in outs for p in o.proposed]
    al = acceptance_length(accepted)
    per_pos = per_position_acceptance(accepted, proposed, cfg.k)
    mismatches, near_ties = [], []
    if cfg.temperature == 0.0:
        for i, (o, p) in enumerate(zip(outs, plain)):
            if o.token_ids != p:
                first = next(
                    (j for j, (a, b) in enumerate(zip(o.token_ids, p)) if a != b),
                    min(len(o.token_ids), len(p)),
                )
                row = {"prompt": i, "first_mismatch": first}
                # Below fp32 a K + 1-row verify and a one-token step round differently: where
                # the plain side's top-2 logits are within NEAR_TIE, either token is the
                # target's (T1's bf16 rule); a wider margin is a real mismatch.
                if dtype != torch.float32 and first < len(p):
                    row["margin"] = top2_margin(target, loaded[i], p[:first])
                    if row["margin"] < NEAR_TIE:
                        near_ties.append(row)
                        continue
                mismatches.append(row)
        lossless_check = "plain_greedy" if dtype == torch.float32 else "plain_greedy_margin"
    elif cfg.verify_threshold is not None:
        # The reference loop verifies whole blocks: at T > 0 it draws other (equally exact)
        # samples than a cut round, so token equality is no check here; the joint-distribution
        # test (tests/infer/test_confidence_verify.py) is.
        lossless_check = "unchecked (verify_threshold at T > 0)"
    else:
        lossless_check = "reference_loop"
    compare = cfg.check_reference or (cfg.temperature != 0.0 and cfg.mode == "fast")
    if compare and not (cfg.verify_threshold is not None and cfg.temperature != 0.0):
        refs = reference_generate(
            target, drafter, requests, cfg.k, cfg.max_model_len, cfg.verify, tokenizer
        )
        for i, (o, r) in enumerate(zip(outs, refs)):
            if o.token_ids != r.token_ids and not any(m["prompt"] == i for m in mismatches):
                mismatches.append({"prompt": i, "reference_mismatch": True})
    n_plain = sum(len(p) for p in plain)
    n_spec = sum(len(o.token_ids) for o in outs)
    # Decode throughput, prefill excluded on both sides (each request's first token is the
    # prefill's): plain steps against speculative rounds.
    t_plain = plain_stats.get("decode_seconds", 0.0)
    t_spec = sum(rounds_s)
    tps_plain = max(n_plain - len(prompts), 0) / t_plain if t_plain > 0 else 0.0
    tps_spec = max(n_spec - len(prompts), 0) / t_spec if t_spec > 0 else 0.0
    report = RunReport(
        drafter=str(cfg.drafter),
        target=target_name,
        drafter_kind=spec.name,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        dtype=str(dtype).removeprefix("torch."),
        mode=cfg.mode,
        k=cfg.k,
        temperature=cfg.temperature,
        verify=cfg.verify,
        num_prompts=len(prompts),
        image_prompts=sum(m is not None for m in mm),
        batch_size=cfg.batch_size,
        max_new_tokens=cfg.max_new_tokens,
        rounds=len(accepted),
        acceptance_length=al,
        per_position_acceptance=per_pos,
        lossless=not mismatches,
        lossless_check=lossless_check,
        mismatches=mismatches,
        tokens_plain=n_plain,
        tokens_spec=n_spec,
        tokens_per_s_plain=tps_plain,
        tokens_per_s_spec=tps_spec,
        speedup=tps_spec / tps_plain if tps_plain > 0 else 0.0,
        baseline=step.name if step is not None else "eager",
        t_plain_step_ms=1e3 * t_plain / max(plain_stats.get("steps", 0), 1),
        t_round_ms=1e3 * t_spec / max(len(rounds_s), 1),
        warmup_s=warmup_s,
        verified_rows_per_round=sum(p + 1 for p in proposed) / max(len(proposed), 1),
        verify_threshold=cfg.verify_threshold,
        fast_path="compiled+graphs"
        if cfg.cuda_graphs
        else ("compiled" if cfg.compile else "eager"),
        extra={
            **({} if cfg.drafter_positions == "native" else {"drafter_positions": "1d"}),
            **({"tp": cfg.tp} if cfg.tp > 1 else {}),
            **({"near_ties": near_ties} if near_ties else {}),
            **({"compile": compile_stats()} if cfg.compile else {}),
            "warmup_plain_s": warmup_plain_s,
            **(
                {"k_choice": {**choose_k(per_pos, round_costs), "costs": cfg.round_costs}}
                if round_costs
                else {}
            ),
            **(confidence_extra(cfg, outs, round_costs) if cfg.confidence_report else {}),
        },
    )
    if not is_writer():  # tp > 1: rank 0 writes
        return report
    if cfg.report:
        report.write(cfg.report)
    plot = plot_path(cfg)
    if plot is not None:
        save_acceptance_plot(
            per_pos, al, f"{spec.name} k={cfg.k} on {Path(target_name).name}", plot
        )
    return report


# Logits: below fp32, a first mismatch where the plain side's top-2 margin is smaller than this
# is a near tie (both tokens the target's up to rounding), not a lossless failure (T1, bf16).
NEAR_TIE = 0.1


@torch.no_grad()
def top2_margin(target, prompt, tokens: list[int]) -> float:
    """The target's top-2 logit margin for the token after `prompt` + `tokens` (the plain
    side's choice at a first mismatch), from one prefill of that prefix through the target's
    own prefill seam (its multimodal inputs included) in cache row 0."""
    dev = next(target.parameters()).device
    ids = torch.tensor([list(prompt.ids) + list(tokens)], device=dev)
    pos = torch.arange(ids.shape[1], device=dev)[None]
    rows = torch.zeros(1, dtype=torch.long, device=dev)
    inputs, rope = target.prefill_plan(ids, pos, rows, [prompt.mm_inputs]).chunk(slice(None))
    last = torch.tensor([[ids.shape[1] - 1]], device=dev)
    logits = target(inputs, Slots(rows, pos, rope), logit_index=last).logits[0, -1].float()
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1])


def compile_stats() -> dict:
    """What this process compiled: dynamo's graphs and inductor's cache hits / misses /
    bypasses (`torch._dynamo.utils.counters`), and seconds per compile phase."""
    from torch._dynamo.utils import compile_times, counters

    keep = {
        "stats": ("unique_graphs", "calls_captured"),
        "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
        "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
    }
    out = {f"{k}.{n}": counters[k][n] for k, names in keep.items() for n in names}
    try:
        names, times = compile_times(repr="csv", aggregate=True)
        out["seconds"] = {str(n): float(s) for n, s in zip(names, times)}
    except Exception as e:  # the helper's shape changes between torch versions
        out["seconds"] = f"unavailable ({type(e).__name__})"
    return out


def plot_path(cfg: InferConfig) -> Path | None:
    """Where the per-position acceptance plot goes: `cfg.plot`, else beside the report (same
    stem, `.png`); none without either, or with `plot=none`."""
    if cfg.plot == "none":
        return None
    if cfg.plot:
        return Path(cfg.plot)
    return Path(cfg.report).with_suffix(".png") if cfg.report else None


def confidence_extra(cfg: InferConfig, outs, round_costs: dict[int, float] | None) -> dict:
    """The report's calibration of the per-draft confidences and, from whole-block rounds,
    the threshold sweep (`draftinfer.evaluation.calibration`)."""
    out: dict = {"calibration": calibration_report(outs)}
    if cfg.verify_threshold is None:  # a sweep replays whole blocks; cut rounds are not
        sweep = threshold_sweep(outs, cfg.threshold_sweep, round_costs)
        out["threshold_sweep"] = {**sweep, "costs": cfg.round_costs or None}
    return out


def format_confidence(r: RunReport) -> list[tuple[str, str]]:
    """Report rows of the confidence cut, the calibration and the sweep."""
    rows = [
        (
            "verified rows / round",
            f"{r.verified_rows_per_round:.3f} (verify_threshold "
            f"{'off' if r.verify_threshold is None else r.verify_threshold})",
        )
    ]
    cal = r.extra.get("calibration")
    if cal:
        rows.append(
            (
                "confidence calibration",
                f"ECE {cal['ece']:.3f}, AUROC {cal['auroc']:.3f}, Brier {cal['brier']:.3f} "
                f"over {cal['drafts']} reached drafts (accept rate {cal['accept_rate']:.3f}, "
                f"mean confidence {cal['mean_confidence']:.3f})",
            )
        )
    sweep = r.extra.get("threshold_sweep")
    if sweep:
        parts = []
        for tau, v in sweep["by_tau"].items():
            s = f"{tau}: AL {v['al']:.2f} rows {v['verified_rows_per_round']:.2f}"
            if "expected_speedup" in v:
                s += f" {v['expected_speedup']:.2f}x"
            parts.append(s)
        rows.append(("threshold sweep", "; ".join(parts)))
        if sweep["best"] is not None:
            rows.append(("best threshold", f"{sweep['best']} (costs {sweep['costs']})"))
    return rows


def format_k_choice(choice: dict) -> str:
    """`K=5: 2.31 tokens a round at 1.08 plain steps = 2.14x; K=3 1.95x, ...` (or why none)."""
    by_k = {int(k): v for k, v in choice["by_k"].items()}
    if choice["k"] is None:
        return f"none: no K has both a measured acceptance and a cost in {choice['costs']}"
    b = by_k[int(choice["k"])]
    rest = ", ".join(f"K={k} {v['expected_speedup']:.2f}x" for k, v in by_k.items())
    return (
        f"K={choice['k']}: {b['tokens_per_round']:.2f} tokens a round at "
        f"{b['round_cost']:.2f} plain steps = {b['expected_speedup']:.2f}x ({rest})"
    )


def format_report(r: RunReport) -> str:
    """The short table `python -m draftinfer` prints last."""
    pos = " ".join(f"{v:.2f}" for v in r.per_position_acceptance)
    n_img = r.image_prompts
    images = f" ({n_img} with images)" if n_img else ""
    rows = [
        ("drafter", f"{r.drafter_kind} {r.drafter}"),
        ("target", f"{r.target} ({r.device}, {r.dtype})"),
        ("k / temperature", f"{r.k} / {r.temperature}"),
        ("prompts / rounds", f"{r.num_prompts}{images} / {r.rounds}"),
        ("acceptance length", f"{r.acceptance_length:.3f}"),
        *(
            [("drafter positions", f"{r.extra['drafter_positions']} (engine without M-RoPE)")]
            if "drafter_positions" in r.extra
            else []
        ),
        ("per-position acceptance", pos),
        ("lossless", f"{r.lossless} ({r.lossless_check})"),
        *(
            [("near ties", f"{len(r.extra['near_ties'])} prompt(s) (top-2 margin < {NEAR_TIE})")]
            if r.extra.get("near_ties")
            else []
        ),
        ("decode", f"{r.fast_path}; plain baseline {r.baseline}"),
        ("ms per plain step | round", f"{r.t_plain_step_ms:.3f} | {r.t_round_ms:.3f}"),
        ("tokens/s plain | spec", f"{r.tokens_per_s_plain:.1f} | {r.tokens_per_s_spec:.1f}"),
        ("speedup", f"{r.speedup:.2f}x (decode tokens/s, prefill excluded)"),
        ("warm-up", f"{r.warmup_s:.1f} s (compiles and graph captures, once per process)"),
        *([("best K", format_k_choice(r.extra["k_choice"]))] if "k_choice" in r.extra else []),
        *format_confidence(r),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)
