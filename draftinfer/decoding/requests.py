"""What a caller asks the decoding loops for and gets back, and the rules they share: a
`Request` (prompt ids, sampling, limits, stops, a multimodal target's inputs), its
`RequestOutput`, and the stop and draft-cap rules the speculative loop
(`draftinfer.decoding.engine`), the reference loop (`reference.py`) and the plain baseline apply
identically."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftinfer.decoding.sampling import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    # The target family's inputs of the prompt beyond its ids (None: text). Qwen3-VL:
    # {"pixel_values", "image_grid_thw", "mm_token_type_ids"} (`prefill_plan`).
    mm_inputs: dict | None = None


@dataclass
class RequestOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    text: str | None = None
    accepted: list[int] = field(default_factory=list)  # per round
    proposed: list[int] = field(default_factory=list)  # per round: drafts verified
    versions: list[int] = field(default_factory=list)  # per round: the drafter version
    # With `SpecDecoder(emit_features=True)`: the target features the runner computed for the
    # committed tokens `[N - 1, F]` (N = prompt + output tokens; row i is f_i, the feature of
    # token i, which pairs with token i + 1, convention 1; the last token has none yet), on
    # the CPU, in the target's dtype. Their columns are `SpecDecoder.emit_spec`: the drafter's
    # features plus the head input (`FeatureSpec.with_head_input`: the final hidden state the
    # target's distribution is recomputed from), what a training step needs. None otherwise.
    features: torch.Tensor | None = None
    # With `SpecDecoder(record_confidence=True)`: per round, the K drafts' confidences
    # (`Proposer.confidences()`; only the first `proposed` were verified).
    confidences: list[list[float]] = field(default_factory=list)


def apply_stops(
    req: Request, out: list[int], new: list[int], total_len: int, max_model_len: int, tokenizer=None
) -> tuple[list[int], str | None]:
    """Append `new` to `out` token by token, stopping exactly at EOS/stop ids, a stop string,
    `max_tokens` or `max_model_len`. Returns (out, finish reason or None). Shared by the
    speculative loop, the reference loop and the plain baseline so they stop identically."""
    for tok in new:
        out.append(tok)
        total_len += 1
        if tok in req.stop_token_ids:
            return out, "stop"
        if req.stop_strings and tokenizer is not None:
            text = tokenizer.decode(out, skip_special_tokens=False)
            if any(s in text for s in req.stop_strings):
                return out, "stop"
        if len(out) >= req.max_tokens or total_len >= max_model_len:
            return out, "length"
    return out, None


def finalize_text(req: Request, out: RequestOutput, tokenizer) -> None:
    if tokenizer is None:
        return
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    for s in req.stop_strings:
        if s in text:
            text = text[: text.index(s)]
    out.text = text


def draft_cap(max_model_len: int, length: int, remaining: int, k: int) -> int:
    """Drafts a request may propose this round: the round emits up to n + 1 tokens, so
    n <= max_model_len - L - 1 and n <= max_tokens - produced - 1 (never wrap or overshoot)."""
    return max(0, min(k, min(max_model_len - length, remaining) - 1))
