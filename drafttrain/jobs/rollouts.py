"""On-policy rollouts for `trainer.stage=opd` (the loss: `drafttrain.objectives.opd`).

Every `opd.refresh_every` optimizer steps (and before the first) the bundled runner decodes
the next `opd.num_prompts` prompts of `data.path` (its `data.split`, rendered as the runner
renders prompts, cycling) once per `opd.temperatures` entry, with the native target and the
drafter of that step exported in memory (`drafttrain.jobs.runner_eval.runner_drafter`: the
exporter's and the loader's own steps, as the runner's AL during training). A rollout keeps,
per request, the committed tokens and each round's proposed and accepted drafts
(`RequestOutput`): the training rows (`drafttrain.objectives.opd.round_rows`).

Features: the runner's native target computes its hidden states for every verified row, but
does not hand them out; rather than hook the round (`draftinfer.decoding.engine`), the frozen
training target (the one SFT reads features from, so the features are training's own) runs
once per rollout sequence when the rollout is made, and its output (taps, positions, head
input) is cached in memory for every step that reads the rollout (`RolloutStore`): no
target forward is repeated within a rollout.

Resume: each rollout's tokens and rounds are written to `<run_dir>/rollouts/step_N.json`
when made; a checkpoint's data state names that file and the batch cursor, so a resumed run
reads the same rollout back (recomputing its features once) and continues where it was.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from drafttrain.jobs.config import TrainConfig
from drafttrain.jobs.errors import ConfigError
from drafttrain.objectives.opd import OPDLoss, OPDSequence, round_rows
from drafttrain.trainer.loop import LoopHook

ROLLOUT_DIR = "rollouts"


def rollout_prompts(cfg: TrainConfig, max_model_len: int):
    """The prompts of `data.path` / `data.split` (first turns), rendered as the runner renders
    them (`PromptRenderer`); a one-line error when none fits `max_model_len`. `list[Prompt]`."""
    from draftinfer.evaluation.chat import data_base_dir
    from draftinfer.evaluation.suite_decode import PromptRenderer
    from draftinfer.evaluation.suites import SuiteConfig, suite_rows
    from draftinfer.files.paths import resolve_path
    from draftinfer.registry import family_of

    d, o = cfg.data, cfg.opd
    want = o.num_prompts * (-(-cfg.trainer.max_steps // o.refresh_every) + 1)
    suite = SuiteConfig(
        name="opd_rollouts",
        dataset=d.path,
        config=d.name,
        split=d.split,
        messages=d.messages_field,
        num_prompts=want,
        max_new_tokens=o.max_new_tokens,
    )
    path = resolve_path(cfg.target.name_or_path)
    renderer = PromptRenderer(family_of(path), path, max_model_len)
    base = data_base_dir(d.path)
    prompts = []
    for r in suite_rows(suite, d.path):
        p = renderer.render(r.conversation([]), f"rollout row {r.row}", {}, base)
        if p is not None:
            prompts.append(p)
    if not prompts:
        raise ConfigError(f"opd: no prompt of {d.path!r} fits max_model_len={max_model_len}")
    return prompts, renderer.tokenizer


def rollout_batch(prompt, tokens: list[int], device, family) -> dict[str, torch.Tensor]:
    """The frozen target's batch for one rollout sequence (prompt + continuation): the prompt's
    own multimodal inputs (`Prompt.mm_inputs`) ride along as the target's training family
    (`family`, a `TrainFamily`) takes them (`rollout_inputs`)."""
    ids = torch.tensor([list(prompt.ids) + list(tokens)], device=device)
    ones = torch.ones_like(ids)
    T = ids.shape[1]
    batch = {
        "input_ids": ids,
        "attention_mask": ones,
        "loss_mask": ones,
        "position_ids": torch.arange(T, device=device)[None],
    }
    mm = getattr(prompt, "mm_inputs", None) or {}
    batch.update(family.rollout_inputs(mm, len(prompt.ids), T, device))
    return batch


class RolloutStore:
    """The current rollout: its sequences with their rounds and the frozen target's cached
    output, and where it came from (`step`, `file`)."""

    def __init__(self, step: int, file: str, records: list[dict], seqs: list[OPDSequence]):
        self.step, self.file, self.records, self.seqs = step, file, records, seqs


class Rollouts:
    """Makes rollouts with the runner (module docstring) and reads them back on resume."""

    def __init__(self, cfg: TrainConfig, target, features, device, run_dir: Path, k: int):
        from draftinfer.evaluation.run import pick_dtype
        from drafttrain.registry import target_family

        self.cfg, self.target, self.features, self.device = cfg, target, features, device
        self.family = target_family(cfg.target.name_or_path)
        self.dir = run_dir / ROLLOUT_DIR
        self.k = k
        self.max_model_len = min(2048, cfg.data.max_length + cfg.opd.max_new_tokens + 8)
        self.prompts, self.tokenizer = rollout_prompts(cfg, self.max_model_len)
        dt = getattr(torch, cfg.export.dtype, None)
        self.export_dtype = dt
        self.dtype = pick_dtype("auto", device)
        self.native = None
        self.last: dict[str, float] = {}

    def _native(self):
        from draftinfer.files.loading import load_native_target
        from draftinfer.files.paths import resolve_path

        if self.native is None:
            self.native = load_native_target(
                resolve_path(self.cfg.target.name_or_path),
                self.device,
                self.dtype,
                max_batch=self.cfg.opd.batch_size,
                max_seq_len=self.max_model_len,
            )
        return self.native

    def prompt_ids(self, index: int) -> list[int]:
        """Indices into the prompt pool of rollout number `index` (cycling)."""
        n = self.cfg.opd.num_prompts
        return [(index * n + i) % len(self.prompts) for i in range(n)]

    @torch.no_grad()
    def make(self, step: int, index: int, kind: str, arch, own) -> RolloutStore:
        """Rollout number `index` at optimizer step `step` with the drafter state `own`:
        decoded, written to `rollouts/step_N.json`, its features computed."""
        from tqdm.auto import tqdm

        from draftinfer.conventions.metrics import acceptance_length
        from draftinfer.decoding.engine import Request, SpecDecoder
        from draftinfer.decoding.sampling import SamplingParams
        from drafttrain.jobs.runner_eval import runner_drafter

        t0 = time.perf_counter()
        o = self.cfg.opd
        native = self._native()
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # building a module draws its random init
            drafter = runner_drafter(
                kind, arch, own, native, self.cfg.target.name_or_path, self.dtype,
                self.export_dtype,
            )  # fmt: skip
        decoder = SpecDecoder(
            native,
            drafter,
            self.k,
            max_batch=o.batch_size,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
        )
        eos = tuple(native.config.eos_token_ids)
        pids = self.prompt_ids(index)
        reqs, meta = [], []
        for t in o.temperatures:
            for i in pids:
                seed = self.cfg.seed * 1_000_003 + index * 10_007 + i
                sp = SamplingParams(t, 0, 1.0, seed)
                p = self.prompts[i]
                reqs.append(
                    Request(p.ids, sp, max_tokens=o.max_new_tokens, stop_token_ids=eos,
                            mm_inputs=p.mm_inputs)
                )  # fmt: skip
                meta.append((i, t))
        show = self.cfg.trainer.progress
        with tqdm(total=len(reqs), desc=f"rollout {index}", disable=not show, leave=False) as bar:
            outs, _ = decoder.generate(reqs, on_finish=lambda: bar.update(1))
        records = [
            {
                "prompt": i,
                "temperature": t,
                "tokens": list(out.token_ids),
                "accepted": list(out.accepted),
                "proposed": list(out.proposed),
            }
            for (i, t), out in zip(meta, outs)
        ]
        name = f"step_{step:06d}.json"
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / (name + ".tmp")
        tmp.write_text(json.dumps({"step": step, "index": index, "k": self.k, "records": records}))
        tmp.replace(self.dir / name)
        seconds = time.perf_counter() - t0
        store = self.read(name)
        acc = [a for r in records for a in r["accepted"]]
        self.last = {
            "rollout_al": acceptance_length(acc),
            "rollout_rounds": float(len(acc)),
            "rollout_seconds": seconds,
            "rollout_feature_seconds": time.perf_counter() - t0 - seconds,
        }
        for t in o.temperatures:
            at = [a for r in records if r["temperature"] == t for a in r["accepted"]]
            self.last[f"rollout_al_t{t:g}"] = acceptance_length(at)
        return store

    @torch.no_grad()
    def read(self, name: str) -> RolloutStore:
        """A written rollout with its frozen-target features (one forward per sequence)."""
        from tqdm.auto import tqdm

        data = json.loads((self.dir / name).read_text())
        seqs = []
        show = self.cfg.trainer.progress
        for r in tqdm(data["records"], desc="rollout features", disable=not show, leave=False):
            p = self.prompts[r["prompt"]]
            batch = rollout_batch(p, r["tokens"], self.device, self.family)
            tgt = self.target.batch_output(batch, self.features)
            rows = round_rows(len(p.ids), len(r["tokens"]), r["accepted"], r["proposed"], self.k)
            seqs.append(OPDSequence(batch["input_ids"], tgt, rows))
        return RolloutStore(data["step"], name, data["records"], seqs)


class RolloutBatches:
    """The loop's batches in the OPD stage: `data.batch_size` sequences of the current rollout
    per micro-batch, in an order seeded by (seed, rollout index), as `{"rollout_seq": [B]}`.
    `state()` / `restore()`: the rollout file and the cursor (checkpointed with the loop)."""

    def __init__(self, rollouts: Rollouts, batch_size: int, seed: int):
        self.rollouts, self.batch_size, self.seed = rollouts, batch_size, seed
        self.store: RolloutStore | None = None
        self.index = 0  # the rollout number of `store`
        self.cursor = 0
        self.order: list[int] = []

    def use(self, store: RolloutStore, index: int) -> None:
        self.store, self.index, self.cursor = store, index, 0
        g = torch.Generator().manual_seed(self.seed * 7919 + index)
        self.order = torch.randperm(len(store.seqs), generator=g).tolist()

    def next(self) -> dict[str, torch.Tensor]:
        n = len(self.order)
        pick = [self.order[(self.cursor + i) % n] for i in range(min(self.batch_size, n))]
        self.cursor = (self.cursor + len(pick)) % n
        return {"rollout_seq": torch.tensor(pick, dtype=torch.long)}

    def sequences(self, idx: torch.Tensor) -> list[OPDSequence]:
        return [self.store.seqs[i] for i in idx.tolist()]

    def state(self) -> dict[str, Any]:
        return {"rollout": self.store.file, "index": self.index, "cursor": self.cursor}

    def restore(self, st: dict[str, Any]) -> None:
        self.use(self.rollouts.read(st["rollout"]), st["index"])
        self.cursor = st["cursor"]


class OPDModule(nn.Module):
    """`forward(batch) -> (loss, metrics)` of the OPD stage: the batch names rollout sequences
    (`RolloutBatches`), whose cached target outputs the Draft-OPD loss reads. The drafter is the
    only submodule (what the accelerator wraps)."""

    def __init__(self, loss: OPDLoss, batches: RolloutBatches):
        super().__init__()
        self.drafter = loss.drafter
        self._run = (loss, batches)  # a tuple: not registered as submodules

    def forward(self, batch: dict[str, torch.Tensor]):
        loss, batches = self._run
        return loss(batches.sequences(batch["rollout_seq"]))


class RolloutHook(LoopHook):
    """Refresh the rollout after every `opd.refresh_every` optimizer steps (not after the
    last) with the drafter of that step; logs the rollout's runner AL (`rollout_al`, per
    temperature `rollout_al_t{T}`): the on-policy AL during training."""

    def __init__(self, batches: RolloutBatches, kind: str, arch, own_state, every: int):
        self.batches, self.kind, self.arch, self.own_state = batches, kind, arch, own_state
        self.every_n_steps = every

    def due(self, step: int, max_steps: int) -> bool:
        return step % self.every_n_steps == 0 and step < max_steps

    def refresh(self, step: int) -> dict[str, float]:
        index = step // self.every_n_steps
        r = self.batches.rollouts
        store = r.make(step, index, self.kind, self.arch, self.own_state())
        self.batches.use(store, index)
        return dict(r.last)

    def __call__(self, step: int, last_log: dict[str, float]) -> dict[str, float]:
        return self.refresh(step)

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"roll_al": f"{metrics['rollout_al']:.2f}"} if "rollout_al" in metrics else {}
