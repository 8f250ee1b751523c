"""What `python -m draftinfer` measured: one typed record (`RunReport`) that the runner returns,
writes as JSON, and that the training job, the model card and wandb read by attribute.

The JSON file is the dataclass's fields, nothing else; `RunReport.read` reads one back (a
missing field is a one-line `CheckpointError`), so writer and readers share one schema.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from draftinfer.files.errors import CheckpointError


@dataclass
class RunReport:
    drafter: str  # the exported drafter directory
    target: str  # the target as given (hub id / path / zoo name)
    drafter_kind: str
    device: str  # "cpu" or the CUDA device name
    dtype: str
    mode: str  # "fast" or "reference"
    k: int  # drafts per round
    temperature: float
    verify: str  # "onehot" / "full"
    num_prompts: int
    image_prompts: int  # prompts carrying images (multimodal targets)
    batch_size: int
    max_new_tokens: int
    rounds: int
    acceptance_length: float  # emitted tokens per round, over all rounds (micro)
    per_position_acceptance: list[float]  # P(drafts 1..j all accepted), j = 1..k
    lossless: bool
    lossless_check: str  # "plain_greedy" (T = 0) or "reference_loop" (T > 0)
    mismatches: list[dict[str, Any]]
    tokens_plain: int
    tokens_spec: int
    tokens_per_s_plain: float  # decode tokens per second (prefill excluded), plain baseline
    tokens_per_s_spec: float  # the same, speculative
    speedup: float  # tokens_per_s_spec / tokens_per_s_plain
    # Which plain decoding `speedup` is measured against ("compiled+graphs", "compiled",
    # "eager"), how the speculative side ran, their mean times (ms per plain decode step and
    # per round; at batch 1, speedup = AL * t_plain_step_ms / t_round_ms) and the warm-up
    # (compiles, captures). Defaults: reports written before these fields existed.
    baseline: str = "eager"
    fast_path: str = "eager"
    t_plain_step_ms: float = 0.0
    t_round_ms: float = 0.0
    warmup_s: float = 0.0
    # Rows the verify forwards scored per round (verified drafts + the pending token's row)
    # and the confidence cut they ran with (`verify_threshold`; None = the whole block).
    verified_rows_per_round: float = 0.0
    verify_threshold: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # what a caller adds (e.g. a suite)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, path: str | Path) -> RunReport:
        d = json.loads(Path(path).read_text())
        required = [f for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [f.name for f in required if f.name not in d]
        if missing:
            raise CheckpointError(f"{path}: not a runner report (missing {', '.join(missing)})")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})
