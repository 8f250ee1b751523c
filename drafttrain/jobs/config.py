"""Typed config schema for `python -m drafttrain`.

YAML under `conf/drafttrain/` only selects and overrides; these dataclasses are the schema. Hydra
validates every key against them (struct mode: a misspelled key is an error naming the
key), and `drafttrain.__main__` converts the composed config into these objects once, so
nothing below the entry point imports omegaconf.

Drafter configs are polymorphic: each drafter kind registers its own dataclass (a subclass
of `DrafterTrainConfig`, in `drafttrain/kinds/<kind>/`) under the `drafter/` group, selected
by name. A run's resolved config is read back through the same schema
(`load_train_config`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftinfer.files.errors import CheckpointError, ConfigError


@dataclass
class TargetConfig:
    """The frozen target LLM."""

    # Hub id, local directory, or `zoo:<name>` for a model shipped under `draftinfer/zoo/`.
    name_or_path: str = "zoo:llama-tiny"
    # "auto": bf16 on GPU, fp32 on CPU. Or "float32" / "bfloat16" / "float16".
    dtype: str = "auto"
    trust_remote_code: bool = False
    revision: str | None = None
    # Attention implementation handed to `from_pretrained` ("sdpa", "eager", "flash_attention_2").
    attn_implementation: str = "sdpa"


@dataclass
class DrafterTrainConfig:
    """Fields every drafter kind shares. Kinds subclass this in their own folder
    (`drafttrain/kinds/<kind>/config.py`, STYLE rule 6) and register it with their `TrainSpec`."""

    kind: str = ""
    # Decoder layers in the drafter.
    num_layers: int = 1
    # Architecture sizes; null means "copy the target's". hidden_size must equal the target's.
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    # "auto": eager (explicit mask) on CPU; on CUDA "cudnn" on Hopper, else "flex". Or
    # "eager" / "flex" / "flash" / "cudnn" (EAGLE-3's TTT: the causal block by that dense
    # kernel, drafttrain/objectives/ttt.py; ptd's and dflash's masks run flex for both).
    attention_backend: str = "auto"

    def check(self) -> None:
        """One-line `ConfigError` for a value no target could use (run before anything loads;
        what depends on the target is checked when the drafter is built). A kind's config
        extends it with its own fields."""
        at_least("drafter", self, 1, "num_layers")
        at_least(
            "drafter", self, 1, "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim",
        )  # fmt: skip
        one_of("drafter", self, "attention_backend", ("auto", "eager", "flex", "flash", "cudnn"))


@dataclass
class EngineFeaturesConfig:
    """Hidden states a serving engine extracted, read in place of running the target
    (`drafttrain.sources.engine`, docs/training.md "Hidden states from vLLM"): a directory of
    `hs_<row>.safetensors` files, one per row of the tokenized training split, in the layout
    vLLM's `extract_hidden_states` writes through hs_connectors' `file` backend (speculators'
    offline generator names them so)."""

    # The directory (null: not used).
    path: str | None = None
    # The hs_connectors backend that reads it: "file" (bf16 / fp32 files as vLLM writes them)
    # or "fp8" (hs_connectors' FP8 connector). "mooncake" is refused: it hands samples over by
    # vLLM's response, not by dataset row.
    backend: str = "file"
    # The server's `eagle_aux_hidden_state_layer_ids`, in vLLM's slot numbering: slot k < L is
    # the input of decoder layer k (HF `hidden_states[k]`), slot L (= num_hidden_layers) the
    # final hidden state before the final norm. null: speculators' default [2, L//2, L-3, L].
    layer_ids: list[int] | None = None
    # Where `python -m drafttrain.sources.rows` writes the tokenized training split for the
    # producer (a `datasets` directory speculators' `generate-offline-data --preprocessed-data`
    # reads; row i -> `hs_<i>.safetensors`). null: `<output_dir>/engine_rows`.
    rows: str | None = None
    # A producer is still writing: wait for each row's file instead of refusing a missing one.
    stream: bool = False
    # Check at setup that the file of one row (the shortest there; streaming: the first to
    # arrive) holds the taps `layer_ids` names: each slot against the loaded target's own
    # features of that row, one target forward (a server launched with other ids, or in
    # another slot order, is a one-line error naming the slot and the layer it matches).
    check_taps: bool = True
    # Largest relative error ||file - target|| / ||target|| of a slot (the engine's kernels
    # and dtype differ from the trainer's: bf16 rounding alone is ~4e-3).
    tap_tolerance: float = 0.05
    # Streaming: batches read ahead of the trainer (the bounded queue between reader and loop).
    queue_batches: int = 4
    # Streaming: seconds between looks for a file, and the longest wait for one.
    poll_s: float = 0.2
    timeout_s: float = 600.0


@dataclass
class DataConfig:
    """Chat data in `messages` format."""

    # Hub id, local file (.json/.jsonl/.parquet), local directory, or `zoo:<name>`.
    path: str = "zoo:chat"
    split: str = "train"
    # Optional subset / config name for hub datasets.
    name: str | None = None
    messages_field: str = "messages"
    max_length: int = 512
    max_samples: int | None = None
    # Sequences per batch; batches are bucketed by length.
    batch_size: int = 8
    # Held-out split evaluated after training (null: none), and how many batches of it.
    eval_split: str | None = None
    # Where `eval_split` lives (null: `path`); e.g. the original dataset when `path` is a
    # regeneration of its train split. Also the source of the verification prompts.
    eval_path: str | None = None
    eval_batches: int = 16
    # Where tokenized data and the draft vocabulary are cached (null: `<output_dir>/cache`).
    # Not to be confused with `cache` below.
    cache_dir: str | None = None
    num_proc: int = 1
    # An offline feature cache (a directory written by `python -m drafttrain.cache`) to read
    # the target's features and distribution from instead of running the target (null: run
    # the target). It must have been written with this config's target, drafter features,
    # data and `cache.dtype` (checked at setup). See `CacheConfig` and docs/training.md.
    cache: str | None = None
    # Samples the runner decoded with `emit_features=True`, written by
    # `drafttrain.cache.emitted.write_emitted` (the online mode): both the training data (their
    # tokens, loss on the output) and the target's features and distribution, read like
    # `cache`; `data.path` is still tokenized for the drafter's initialisation (draft vocab).
    emitted: str | None = None
    # Hidden states a serving engine extracted (vLLM `extract_hidden_states`, hs_connectors,
    # speculators' offline generator): `EngineFeaturesConfig`.
    hidden_states: EngineFeaturesConfig = field(default_factory=EngineFeaturesConfig)


@dataclass
class TrainerConfig:
    max_steps: int = 200
    # Optimizer steps; an epoch that ends early is followed by the next (reshuffled) one.
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    grad_accum: int = 1
    # The per-row draft loss of every kind (`drafttrain.objectives.loss_fns`): "soft_ce" (soft
    # cross-entropy against the target's distribution), "kl" (forward KL(p_target || q_draft)),
    # "tv" (total variation, 1 - the T=1 acceptance rate), "lk" (the LK hybrid of KL and TV),
    # "dpace" (soft_ce with D-PACE per-position weights in place of the kind's own). null: the
    # kind's default (`TrainSpec.default_loss`, the one that measured best on the zoo).
    loss: str | None = None
    # "auto": bf16 autocast on GPU, none on CPU. Or "no" / "bf16".
    mixed_precision: str = "auto"
    # Dtype of the drafter's parameters (and gradients): "float32" or "bfloat16".
    param_dtype: str = "float32"
    # With param_dtype below float32: keep an fp32 master copy of each parameter in the
    # optimizer (the update is applied to it; checkpoints store it). Without, small updates
    # are rounded away.
    master_weights: bool = True
    # Dtype of AdamW's moments: "float32" or "bfloat16" (the update is computed in fp32).
    optimizer_dtype: str = "float32"
    # Recompute each drafter decoder block's activations in backward instead of keeping them
    # (per TTT step and layer): less memory at long sequences, ~1/3 more block compute.
    activation_checkpointing: bool = False
    # torch.compile each drafter decoder block (dynamic shapes; one compilation for every
    # TTT step and length). CUDA runs; on CPU it needs a C++ compiler and is slow to warm up.
    compile: bool = False
    # Drafter parameters kept frozen, by name prefix (e.g. [lm_head]: the head keeps the
    # target's rows it was initialized from, as speculators 0.9.0 trains EAGLE-3). The shared
    # token embeddings are always frozen.
    freeze: list[str] = field(default_factory=list)
    save_every: int = 100
    keep_last: int = 2
    log_every: int = 10
    num_threads: int | None = None
    progress: bool = True
    # "sft": train on the data's responses (every preset's first stage). "opd": on-policy
    # post-training (Draft-OPD, `opd.*`, docs/training.md "On-policy post-training"): the
    # runner's own rollouts with the current drafter are the training rows; needs `init_from`.
    stage: str = "sft"
    # Start from the drafter weights of an earlier run (its output_dir, whose latest checkpoint
    # is read, or one `checkpoints/step_N` directory): weights only, a fresh optimizer and
    # schedule. Same kind and architecture (or one the kind starts with heads added, e.g.
    # DSpark from a DFlash run: `TrainSpec.warm_start_heads`), or a one-line error. `resume`
    # wins over it.
    init_from: str | None = None
    # A DeepSpeed JSON config (e.g. conf/launch/deepspeed/zero2.json) for launchers without an
    # accelerate config (`torchrun`, `deepspeed`); `accelerate launch --config_file
    # conf/launch/accelerate/<x>.yaml` needs none. `data.batch_size` is the *global* batch: each
    # of N processes trains on its rows `rank::N` (docs/training.md, "Several GPUs").
    deepspeed: str | None = None


@dataclass
class LoggerConfig:
    # "none" or "wandb".
    kind: str = "none"
    project: str = "drafttrain"
    run_name: str | None = None
    # wandb mode: "offline" by default (no network needed), "online" to sync, "disabled".
    mode: str = "offline"


@dataclass
class ExportConfig:
    enabled: bool = True
    # Also write `speculators/` (config.json + model.safetensors): the drafter in
    # vllm-project/speculators' layout, loadable by its `from_pretrained`, for kinds that have one.
    speculators_config: bool = True
    dtype: str = "bfloat16"
    # After export, load the exported files in `draftinfer` and measure AL + losslessness on
    # held-out prompts (`data.eval_split`); the table goes into the model card.
    verify: bool = True
    verify_k: int = 3
    verify_prompts: int = 32
    verify_max_new_tokens: int = 64
    verify_batch_size: int = 8
    # More K values the runner measures after `verify_k` (the card's AL table has a row per K).
    verify_extra_k: list[int] = field(default_factory=list)
    # Upload the export to the Hugging Face Hub as `ORG/NAME` after verification (null: no
    # upload). The token is huggingface_hub's own (`HF_TOKEN`, then the saved token file).
    push_to_hub: str | None = None
    hub_private: bool = False
    # The target's hub id for the card's `base_model` when `target.name_or_path` is a local
    # directory or a zoo name (null: `target.name_or_path`, which an upload requires be a hub id).
    hub_base_model: str | None = None


@dataclass
class RunnerEvalConfig:
    """`eval.*`: the runner's real acceptance length during training (`drafttrain.jobs.runner_eval`):
    every `every_n_steps` optimizer steps the drafter is exported in memory, loaded into the
    runner and decoded over held-out prompts; its AL is logged beside the simulated one."""

    # 0: off.
    every_n_steps: int = 0
    # null: the held-out chat prompts (`data.eval_split` of `data.eval_path`, as the export's
    # verification reads them); else an acceptance suite (`conf/draftinfer/suite/<name>.yaml` or
    # a suite .yaml path), read from `path` when set.
    suite: str | None = None
    path: str | None = None
    num_prompts: int = 16
    max_new_tokens: int = 64
    # Drafts per round (null: `export.verify_k`).
    k: int | None = None
    batch_size: int = 8
    temperature: float = 0.0
    # At the end of training: the runner's walk replayed with the trainer's own forward over
    # the runner check's prompts and the target's greedy continuations (`sim_walk_al` in the
    # summary beside the runner's AL; `drafttrain.jobs.walk_al`). Independent of every_n_steps.
    walk: bool = True


@dataclass
class CacheConfig:
    """The offline feature cache (`drafttrain.cache`): what `python -m drafttrain.cache`
    writes, and how training checks it when it reads one (`data.cache=DIR`)."""

    # Where the writer puts the cache (null: `<output_dir>/feature_cache`).
    dir: str | None = None
    # Storage dtype of the hidden states: "bfloat16", "float8" (float8_e4m3fn with one fp32
    # scale per token per H-wide feature) or "float32" (exact; for tests and debugging).
    dtype: str = "bfloat16"
    # Tokens per shard (whole samples; a sample longer than this is a shard of its own).
    shard_tokens: int = 32768
    # Sequences per target forward while writing (null: `data.batch_size`).
    batch_size: int | None = None
    # Training checks every shard's sha256 at setup, before it writes anything (false: only
    # sizes and headers, which skips reading a very large cache once per run).
    verify: bool = True


@dataclass
class OPDConfig:
    """`opd.*`: on-policy post-training (`trainer.stage=opd`, `drafttrain.jobs.rollouts`,
    `drafttrain.objectives.opd`)."""

    # Rollouts are refreshed every this many optimizer steps with the current weights (the
    # first before step 1): the runner decodes new prompts with the drafter of that step.
    refresh_every: int = 25
    # Prompts per rollout, the next ones of `data.path`'s `data.split` each time (cycling),
    # each decoded once per temperature below.
    num_prompts: int = 8
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = 96
    # Drafts per round of the rollouts (null: `export.verify_k`, the preset's K).
    k: int | None = None
    # Reverse-KL weight of a rejected draft at draft position j (1-based): gamma^(j-1)
    # (Draft-OPD's decay; 0.8 as speculators' and SpecForge's OPD stages).
    gamma: float = 0.8
    # The runner's batch (cache rows) while rolling out.
    batch_size: int = 8
    # How rows are averaged: "position" (a mean per draft position, summed over positions, as
    # the SFT objectives do) or "token" (one mean over every scored row).
    normalize: str = "position"
    # The loss of the first rejected draft: "rkl" (Draft-OPD's reverse KL) or "kl" (forward KL
    # there too: on-policy distillation without the mode-seeking term).
    rejected_loss: str = "rkl"


@dataclass
class OnlineConfig:
    """The drift demonstration job (`drafttrain.online.drift`, preset `online_drift`): with
    `drift: true`, `python -m drafttrain` runs it instead of train -> export -> verify."""

    drift: bool = False
    # The shifted data mix the target is fine-tuned on (`drafttrain.online.shift`).
    shift: str = "reverse_words"
    shift_fraction: float = 0.8
    # The target's fine-tune: steps in all, in `segments` equal parts (one time point each).
    target_steps: int = 200
    segments: int = 5
    target_lr: float = 2e-3
    target_tokens_per_batch: int = 1024
    # The stale drafter's training on the original target, then the online trainer's step
    # quota per published version.
    base_steps: int = 120
    steps_per_publish: int = 30
    # Every AL measurement: the same held-out prompts, greedy, K drafts per round.
    prompts: int = 24
    max_new_tokens: int = 48
    k: int = 3
    batch_size: int = 8
    # The online trainer's data per quota: this many questions of the shifted mix (new ones at
    # every time point), decoded by the online runner on the moved target with its current
    # version; it emits the target features of the tokens it commits, and the trainer trains
    # on those (`data.emitted`), running no target forward of its own.
    train_prompts: int = 64


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: Any = None  # a DrafterTrainConfig subclass, chosen by the `drafter/` group
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    eval: RunnerEvalConfig = field(default_factory=RunnerEvalConfig)
    opd: OPDConfig = field(default_factory=OPDConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    output_dir: str = "outputs/run"
    seed: int = 0
    resume: bool = False
    # Name of the preset that produced this config (written into checkpoints and cards).
    preset: str = ""


def _strict(cls, d: Any, where: str):
    """`d` (parsed YAML) as dataclass `cls`, recursively; unknown keys are errors."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in d:
        if key not in names:
            raise ConfigError(f"{where}: unknown key {key!r} (not in {cls.__name__})")
    kwargs = {}
    for key, value in d.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and value is not None:
            value = _strict(hint, value, f"{where}.{key}")
        kwargs[key] = value
    return cls(**kwargs)


def at_least(section: str, obj: Any, lo: float, *names: str) -> None:
    """`section.name must be >= lo` for each named field that is set (None = unset)."""
    for name in names:
        v = getattr(obj, name)
        if v is not None and not v >= lo:
            raise ConfigError(f"{section}.{name} must be >= {lo}, got {v!r}")


def above(section: str, obj: Any, lo: float, *names: str) -> None:
    """`section.name must be > lo` for each named field that is set."""
    for name in names:
        v = getattr(obj, name)
        if v is not None and not v > lo:
            raise ConfigError(f"{section}.{name} must be > {lo}, got {v!r}")


def one_of(section: str, obj: Any, name: str, choices: tuple) -> None:
    v = getattr(obj, name)
    if v not in choices:
        raise ConfigError(f"{section}.{name} must be one of {list(choices)}, got {v!r}")


def check_train_config(cfg: TrainConfig) -> TrainConfig:
    """Every value a run cannot use as a one-line `ConfigError`, before anything loads or is
    written (`python -m drafttrain` runs it on the composed config before Hydra starts the
    job; `run_job` and `train` run it again for callers of the Python API)."""
    t, d, tr, e, c, ev = cfg.target, cfg.data, cfg.trainer, cfg.export, cfg.cache, cfg.eval
    one_of("target", t, "dtype", ("auto", "float32", "bfloat16", "float16"))
    from drafttrain.frozen.target import resolve_target_path

    resolve_target_path(t.name_or_path)  # the loaders' own check: a missing local directory
    at_least("data", d, 2, "max_length")
    at_least("data", d, 1, "batch_size", "max_samples", "eval_batches", "num_proc")
    from draftinfer.evaluation.chat import check_data_path

    for path in (d.path, d.eval_path):
        if path:
            check_data_path(path)  # the loader's own check: a missing local file or directory
    if d.cache is not None and not Path(d.cache).expanduser().is_dir():
        raise ConfigError(f"data.cache: no such feature cache directory: {d.cache}")
    hs = d.hidden_states
    if hs.path is not None and not hs.stream and not Path(hs.path).expanduser().is_dir():
        raise ConfigError(f"data.hidden_states.path: no such directory: {hs.path}")
    at_least("data.hidden_states", hs, 1, "queue_batches")
    above("data.hidden_states", hs, 0, "poll_s", "timeout_s", "tap_tolerance")
    at_least("trainer", tr, 1, "max_steps", "grad_accum", "keep_last", "log_every")
    at_least("trainer", tr, 1, "num_threads")
    at_least("trainer", tr, 0, "save_every")  # 0: no checkpoint before the last
    above("trainer", tr, 0, "lr")
    at_least("trainer", tr, 0, "weight_decay", "warmup_steps", "grad_clip")
    if not 0 <= tr.min_lr_ratio <= 1:
        raise ConfigError(f"trainer.min_lr_ratio must be in [0, 1], got {tr.min_lr_ratio!r}")
    if len(tr.betas) != 2 or not all(0 <= b < 1 for b in tr.betas):
        raise ConfigError(f"trainer.betas must be two values in [0, 1), got {list(tr.betas)}")
    if tr.loss is not None:
        from drafttrain.objectives.loss_fns import row_loss

        row_loss(tr.loss)  # a one-line error naming the losses there are
    one_of("trainer", tr, "mixed_precision", ("auto", "no", "bf16"))
    one_of("trainer", tr, "param_dtype", ("float32", "bfloat16"))
    one_of("trainer", tr, "optimizer_dtype", ("float32", "bfloat16"))
    if tr.deepspeed is not None and not Path(tr.deepspeed).is_file():
        raise ConfigError(f"trainer.deepspeed: no such DeepSpeed config file: {tr.deepspeed}")
    check_stage(cfg)
    one_of("logger", cfg.logger, "kind", ("none", "wandb"))
    one_of("export", e, "dtype", ("bfloat16", "float16", "float32"))
    at_least("export", e, 1, "verify_k", "verify_prompts", "verify_max_new_tokens")
    at_least("export", e, 1, "verify_batch_size")
    bad_k = [k for k in e.verify_extra_k if k < 1]
    if bad_k:
        raise ConfigError(f"export.verify_extra_k must be >= 1, got {bad_k}")
    one_of("cache", c, "dtype", ("bfloat16", "float8", "float32"))
    at_least("cache", c, 1, "shard_tokens", "batch_size")
    at_least("eval", ev, 0, "every_n_steps", "temperature")
    at_least("eval", ev, 1, "num_prompts", "max_new_tokens", "k", "batch_size")
    if cfg.drafter is None:
        raise ConfigError("the drafter section is missing (drafter=<kind>)")
    cfg.drafter.check()
    if cfg.online.drift:
        check_online_config(cfg)
    return cfg


def check_stage(cfg: TrainConfig) -> None:
    """`trainer.stage`, `trainer.init_from` and `opd.*` as one-line `ConfigError`s (that
    `init_from` holds a checkpoint of this drafter is checked at setup, before the run writes
    anything: `drafttrain.trainer.checkpoint.load_init_weights`)."""
    tr, o = cfg.trainer, cfg.opd
    one_of("trainer", tr, "stage", ("sft", "opd"))
    if tr.stage == "opd":
        if tr.init_from is None and not cfg.resume:
            raise ConfigError(
                "trainer.stage=opd starts from a trained drafter: set trainer.init_from to "
                "an SFT run's output_dir (e.g. the SFT preset's)"
            )
        at_least("opd", o, 1, "refresh_every", "num_prompts", "max_new_tokens", "k")
        at_least("opd", o, 1, "batch_size")
        if not o.temperatures or any(not t >= 0 for t in o.temperatures):
            raise ConfigError(f"opd.temperatures must be values >= 0, got {list(o.temperatures)}")
        one_of("opd", o, "normalize", ("position", "token"))
        one_of("opd", o, "rejected_loss", ("rkl", "kl"))
        if not 0 < o.gamma <= 1:
            raise ConfigError(f"opd.gamma must be in (0, 1], got {o.gamma!r}")


def check_online_config(cfg: TrainConfig) -> None:
    """The drift job's values (`online.*`), one-line `ConfigError`s."""
    o = cfg.online
    at_least("online", o, 1, "segments", "target_steps", "steps_per_publish", "base_steps")
    at_least("online", o, 1, "prompts", "max_new_tokens", "k", "batch_size", "train_prompts")
    at_least("online", o, 1, "target_tokens_per_batch")
    if o.target_steps < o.segments:
        raise ConfigError("online.target_steps must be >= online.segments")
    if not 0 < o.shift_fraction <= 1:
        raise ConfigError(f"online.shift_fraction must be in (0, 1], got {o.shift_fraction!r}")
    if not o.target_lr > 0:
        raise ConfigError(f"online.target_lr must be > 0, got {o.target_lr!r}")
    from drafttrain.online.shift import shift_fn

    shift_fn(o.shift)


def train_config_from_dict(d: dict[str, Any], where: str = "training_args.yaml") -> TrainConfig:
    """The typed schema from a resolved config dict (e.g. a run's `training_args.yaml`): the
    same classes Hydra composes against, unknown keys are one-line `ConfigError`s, and the
    drafter section is parsed with its kind's registered config class."""
    from drafttrain.registry import train_spec

    d = dict(d)
    drafter = d.pop("drafter", None)
    if not isinstance(drafter, dict) or "kind" not in drafter:
        raise ConfigError(f"{where}: the drafter section has no 'kind'")
    cfg = _strict(TrainConfig, d, where)
    cfg.drafter = _strict(train_spec(drafter["kind"]).config_class, drafter, f"{where}.drafter")
    return cfg


def load_train_config(path: str | Path) -> TrainConfig:
    """Read a run's resolved `training_args.yaml` back through the typed schema."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"not a training run: {path} does not exist")
    return train_config_from_dict(yaml.safe_load(path.read_text()) or {}, str(path))
