"""Typed config schema for `python -m drafttrain`.

YAML under `conf/` only selects and overrides; these dataclasses are the schema. Hydra
validates every key against them (struct mode: a misspelled key is an error naming the
key), and `drafttrain.__main__` converts the composed config into these objects once, so
nothing below the entry point imports omegaconf.

Drafter configs are polymorphic: each drafter kind registers its own dataclass (a subclass
of `DrafterTrainConfig`) under the `drafter/` group, selected by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TargetConfig:
    """The frozen target LLM."""

    # Hub id, local directory, or `zoo:<name>` for a model shipped under `zoo/`.
    name_or_path: str = "zoo:llama-tiny"
    # "auto": bf16 on GPU, fp32 on CPU. Or "float32" / "bfloat16" / "float16".
    dtype: str = "auto"
    trust_remote_code: bool = False
    revision: str | None = None
    # Attention implementation handed to `from_pretrained` ("sdpa", "eager", "flash_attention_2").
    attn_implementation: str = "sdpa"


@dataclass
class DrafterTrainConfig:
    """Fields every drafter kind shares. Kinds subclass this (STYLE rule 6)."""

    kind: str = "eagle3"
    # Decoder layers in the drafter.
    num_layers: int = 1
    # Target decoder layers whose *inputs* are tapped (DESIGN 3.2). Empty: (2, L//2, L-3).
    aux_layer_ids: list[int] = field(default_factory=list)
    draft_vocab_size: int = 32000
    # Architecture sizes; null means "copy the target's". hidden_size must equal the target's.
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    norm_before_residual: bool = False


@dataclass
class Eagle3TrainConfig(DrafterTrainConfig):
    kind: str = "eagle3"
    # Training-time test: number of unrolled draft steps and per-step loss weight decay^k.
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    # "auto": flex attention on CUDA, eager (explicit mask) on CPU. Or "eager" / "flex".
    attention_backend: str = "auto"


@dataclass
class PTDTrainConfig(DrafterTrainConfig):
    """Parallel drafting (P-EAGLE / PTD): K drafts from one forward via mask slots."""

    kind: str = "ptd"
    num_layers: int = 2
    # Drafts per forward (depths 0..K-1) the drafter is trained for.
    parallel_k: int = 4
    # Mask token: a reserved id of the target vocabulary; null = the tokenizer's pad token
    # (else the last id).
    mask_token_id: int | None = None
    # Conditional drop-token sampling: an anchor keeps its depth-d slot with probability
    # keep_ratio given it kept depth d-1 (so ~keep_ratio^d overall), but every depth keeps at
    # least keep_floor of the anchors; max_slots_per_seq caps the slots of one sequence.
    keep_ratio: float = 0.7
    keep_floor: float = 0.1
    max_slots_per_seq: int = 1024
    # Loss weight of depth d: depth_decay^d.
    depth_decay: float = 0.8
    attention_backend: str = "auto"


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
    eval_batches: int = 16
    # Where tokenized data and the draft vocabulary are cached (null: `<output_dir>/cache`).
    cache_dir: str | None = None
    num_proc: int = 1


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
    # "auto": bf16 autocast on GPU, none on CPU. Or "no" / "bf16".
    mixed_precision: str = "auto"
    save_every: int = 100
    keep_last: int = 2
    log_every: int = 10
    num_threads: int | None = None
    progress: bool = True


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
    # Also write a vllm-project/speculators-format config beside the vLLM/SGLang one.
    speculators_config: bool = True
    dtype: str = "bfloat16"
    # After export, load the exported files in `draftinfer` and measure AL + losslessness on
    # held-out prompts (`data.eval_split`); the table goes into the model card.
    verify: bool = True
    verify_k: int = 3
    verify_prompts: int = 32
    verify_max_new_tokens: int = 64
    verify_batch_size: int = 8


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: Any = None  # a DrafterTrainConfig subclass, chosen by the `drafter/` group
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    output_dir: str = "outputs/run"
    seed: int = 0
    resume: bool = False
    # Name of the preset that produced this config (written into checkpoints and cards).
    preset: str = ""


# Drafter kind -> its training-config dataclass. Registered with Hydra as `drafter/<kind>_schema`.
DRAFTER_CONFIGS: dict[str, type[DrafterTrainConfig]] = {
    "eagle3": Eagle3TrainConfig,
    "ptd": PTDTrainConfig,
}
