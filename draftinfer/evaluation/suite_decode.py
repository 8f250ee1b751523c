"""The pieces of an acceptance-suite run (`draftinfer.evaluation.suite_run`), also used by training's
runner evaluation (`drafttrain.jobs.runner_eval`): prompt rendering, one batch of plain and
speculative decoding with its lossless check (`decode_batch`), the per-batch store a re-run
resumes from (`SuiteStore`), and the aggregation into a `SuiteResult`.

Lossless: at T=0 every request's tokens equal plain greedy decoding; at T>0 the fast path
equals the reference loop on the same seeds (`draftinfer.decoding.reference`; `check_sampled`), the
sampled verification itself being pinned statistically by tests (T2).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftinfer.conventions.metrics import (
    acceptance_length,
    macro_acceptance_length,
    per_position_acceptance,
)
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.sampling import SamplingParams
from draftinfer.evaluation.prompts import Prompt
from draftinfer.evaluation.suite_report import SuiteResult
from draftinfer.evaluation.suites import SuiteConfig
from draftinfer.files.checkpoint import atomic_write_text
from draftinfer.files.errors import ConfigError

SETTINGS = "settings.json"


# --------------------------------------------------------------------------- prompts


class PromptRenderer:
    """Conversations -> prompts through the target family's prompt encoder
    (`FamilySpec.prompt_encoder`: the tokenizer's chat template, or a processor that also reads
    image parts). A prompt that leaves no room for a new token in `max_model_len` is None (the
    caller counts it as skipped; cutting it would cut the generation prompt or an image)."""

    def __init__(self, family, target_path: str, max_model_len: int):
        self.max_len = max_model_len - 2
        self.encoder = family.prompt_encoder(target_path)
        self.tokenizer = self.encoder.tokenizer

    def render(
        self, conv: list[dict], name: str, template_kwargs: dict, base_dir: Path | None = None
    ) -> Prompt | None:
        prompt = self.encoder.encode(conv, name, template_kwargs, base_dir)
        return prompt if len(prompt.ids) <= self.max_len else None


# --------------------------------------------------------------------------- decoding


@dataclass
class RequestRecord:
    """One decoded request (a row's turn) as stored per batch and read back on resume."""

    id: str  # "r{row}t{turn}"
    row: int
    turn: int
    prompt_tokens: int
    tokens_plain: int
    tokens_spec: int
    accepted: list[int]  # per round
    proposed: list[int]  # per round
    finish: str
    capped: bool  # stopped by max_model_len (not by EOS or max_new_tokens)
    lossless: bool | None  # None: not checked
    first_mismatch: int | None
    text: str  # the speculative output, decoded (the next turn's history)


@dataclass
class Decoding:
    """What a batch decode needs: the loaded target and drafter, and the decoding settings."""

    target: Any
    drafter: Any
    decoder: SpecDecoder
    tokenizer: Any
    k: int
    verify: str
    top_k: int
    top_p: float
    max_model_len: int
    mode: str = "fast"
    check_reference: bool = False
    check_sampled: bool = True
    eos: tuple[int, ...] = ()
    # The plain baseline's decode step (`draftinfer.evaluation.run.plain_step`; None: eager).
    plain_step: Any = None
    warm: bool = field(default=False, repr=False)

    def warm_up(self, prompt: Prompt) -> None:
        """One short plain and speculative decode (allocations, kernels) before timed work."""
        from draftinfer.decoding.baseline import greedy_generate

        if self.warm:
            return
        mm = [prompt.mm_inputs]
        greedy_generate(
            self.target, [prompt.ids], 8, self.eos, step_fn=self.plain_step, mm_inputs=mm
        )
        if self.mode == "fast":
            self.decoder.generate([Request(prompt.ids, max_tokens=8, mm_inputs=prompt.mm_inputs)])
        self.warm = True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_batch(
    d: Decoding,
    prompts: list[Prompt],
    keys: list[tuple[int, int]],  # (row, turn) of each prompt
    temperature: float,
    max_new_tokens: int,
    seeds: list[int],
    plain: list[list[int]] | None = None,
) -> tuple[list[RequestRecord], list[list[int]], float, float]:
    """Plain and speculative decoding of one batch: (records, the plain outputs, plain
    seconds, spec seconds). `plain`: the plain outputs of an earlier call on the same prompts
    (a frozen target's do not change), which are then not decoded again (0 plain seconds)."""
    from draftinfer.decoding.baseline import greedy_generate, sample_generate
    from draftinfer.decoding.reference import reference_generate

    device = next(d.target.parameters()).device
    params = [SamplingParams(temperature, d.top_k, d.top_p, s) for s in seeds]
    reqs = [
        Request(p.ids, sp, max_tokens=max_new_tokens, stop_token_ids=d.eos, mm_inputs=p.mm_inputs)
        for p, sp in zip(prompts, params)
    ]
    ids, mm = [p.ids for p in prompts], [p.mm_inputs for p in prompts]
    t_plain = 0.0
    if plain is None:
        _sync(device)
        t0 = time.perf_counter()
        if temperature == 0.0:
            plain = greedy_generate(
                d.target, ids, max_new_tokens, d.eos, step_fn=d.plain_step, mm_inputs=mm
            )
        else:
            plain = sample_generate(
                d.target, ids, max_new_tokens, d.eos, params, step_fn=d.plain_step, mm_inputs=mm
            )
        _sync(device)
        t_plain = time.perf_counter() - t0
    if d.mode == "fast":
        outs, stats = d.decoder.generate(reqs)
        t_spec = stats["seconds"]
    else:
        t0 = time.perf_counter()
        outs = reference_generate(
            d.target, d.drafter, reqs, d.k, d.max_model_len, d.verify, d.tokenizer
        )
        t_spec = time.perf_counter() - t0
    # The oracle of each request's tokens: plain greedy at T=0; the reference loop at T>0 (the
    # same seeds), or also at T=0 with `check_reference`.
    oracle: list[list[int] | None] = [None] * len(reqs)
    if temperature == 0.0:
        oracle = list(plain)
    refs = None
    if d.check_reference or (temperature != 0.0 and d.check_sampled and d.mode == "fast"):
        refs = reference_generate(
            d.target, d.drafter, reqs, d.k, d.max_model_len, d.verify, d.tokenizer
        )
    records = []
    for i, (o, (row, turn)) in enumerate(zip(outs, keys)):
        want = [oracle[i]] if oracle[i] is not None else []
        want += [refs[i].token_ids] if refs is not None else []
        first = None
        for w in want:
            if o.token_ids != w:
                first = next(
                    (j for j, (a, b) in enumerate(zip(o.token_ids, w)) if a != b),
                    min(len(o.token_ids), len(w)),
                )
                break
        records.append(
            RequestRecord(
                id=f"r{row}t{turn}",
                row=row,
                turn=turn,
                prompt_tokens=len(ids[i]),
                tokens_plain=len(plain[i]),
                tokens_spec=len(o.token_ids),
                accepted=list(o.accepted),
                proposed=list(o.proposed),
                finish=o.finish_reason,
                capped=o.finish_reason == "length"
                and len(o.token_ids) < max_new_tokens
                and len(ids[i]) + len(o.token_ids) >= d.max_model_len,
                lossless=(first is None) if want else None,
                first_mismatch=first,
                text=o.text or "",
            )
        )
    return records, plain, t_plain, t_spec


# --------------------------------------------------------------------------- store


class SuiteStore:
    """The per-request results of one suite at one temperature, one JSON file per batch."""

    def __init__(self, root: Path, settings: dict[str, Any], resume: bool):
        self.root = root
        path = root / SETTINGS
        if path.is_file():
            old = json.loads(path.read_text())
            if old != settings and resume:
                key = next(k for k in sorted({*old, *settings}) if old.get(k) != settings.get(k))
                raise ConfigError(
                    f"{root} holds results made with other settings ({key}: "
                    f"{old.get(key)!r} there, {settings.get(key)!r} now); set eval.resume=false "
                    "to decode them again, or eval.out_dir= for a new folder"
                )
            if old != settings or not resume:
                shutil.rmtree(root)
        elif root.exists() and not resume:
            shutil.rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(settings, indent=1, sort_keys=True) + "\n")
        self.batches: list[dict[str, Any]] = []
        for f in sorted(root.glob("*.json")):
            if f.name != SETTINGS:
                self.batches.append(json.loads(f.read_text()))
        self.records = {r["id"]: RequestRecord(**r) for b in self.batches for r in b["requests"]}
        self.resumed = len(self.records)

    def add(self, records: list[RequestRecord], t_plain: float, t_spec: float) -> None:
        batch = {
            "requests": [dataclasses.asdict(r) for r in records],
            "seconds_plain": t_plain,
            "seconds_spec": t_spec,
        }
        atomic_write_text(self.root / f"{records[0].id}.json", json.dumps(batch) + "\n")
        self.batches.append(batch)
        self.records.update({r.id: r for r in records})


def suite_result(
    suite: SuiteConfig,
    temperature: float,
    source: str,
    store: SuiteStore,
    rows: int,
    skipped: int,
    k: int,
    verification: str,
    check: str,
) -> SuiteResult:
    recs = sorted(store.records.values(), key=lambda r: (r.turn, r.row))
    accepted = [a for r in recs for a in r.accepted]
    proposed = [p for r in recs for p in r.proposed]
    checked = [r for r in recs if r.lossless is not None]
    return SuiteResult(
        suite=suite.name,
        temperature=temperature,
        protocol=suite.protocol,
        source=source,
        rows=rows,
        requests=len(recs),
        skipped=skipped,
        capped=sum(r.capped for r in recs),
        rounds=len(accepted),
        al_micro=acceptance_length(accepted),
        al_macro=macro_acceptance_length([r.accepted for r in recs]),
        per_position=per_position_acceptance(accepted, proposed, k),
        lossless=all(r.lossless for r in checked) if checked else None,
        lossless_check=check if checked else "none",
        verification=verification,
        mismatches=[r.id for r in checked if not r.lossless],
        tokens_plain=sum(r.tokens_plain for r in recs),
        tokens_spec=sum(r.tokens_spec for r in recs),
        seconds_plain=sum(b["seconds_plain"] for b in store.batches),
        seconds_spec=sum(b["seconds_spec"] for b in store.batches),
        resumed=store.resumed,
    )
