"""Typed schema of `python -m draftinfer` (Hydra converts into this once, in `__main__`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class InferConfig:
    # Exported drafter directory (required).
    drafter: str = ""
    # Target: hub id / local dir / `zoo:<name>`; empty = the target recorded in the drafter.
    target: str = ""
    # Prompts: a chat dataset (hub id, local .json/.jsonl/.parquet, `zoo:chat`) whose first
    # user turn is the prompt, or a .txt file with one prompt per line.
    prompts: str = "zoo:chat"
    prompts_split: str = "test"
    num_prompts: int = 64
    k: int = 3
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # "onehot" (drafts = drafter argmax, q one-hot) or "full" (drafts sampled from q).
    verify: str = "onehot"
    batch_size: int = 8
    max_new_tokens: int = 128
    max_model_len: int = 1024
    prefill_chunk: int = 512
    # "auto": fp32 on CPU (exact lossless check), bf16 on CUDA. Or float32 / bfloat16.
    dtype: str = "auto"
    device: str = "auto"
    # Compile the target's verify forward and the drafter forward(s) (useful on CUDA).
    compile: bool = False
    # Run the target's q/k/v and gate/up projections as one GEMM each
    # (`draftinfer.models.transforms.fuse_projections`, the same weights). null (the default) =
    # on for CUDA, off on the CPU (where the fp32 lossless check and the golden AL files are
    # kept on the unfused GEMMs). On one H100 at batch 1 (Llama-3.1-8B shapes) it takes the
    # graph-captured plain step from 1.31x to 1.14x gpt-fast's (docs/results.md).
    fuse_projections: bool | None = None
    # Replay each round from a CUDA graph (`draftinfer.graphs`; CUDA only, best with compile).
    cuda_graphs: bool = False
    # "fast" (KV-cached loop) or "reference" (recompute everything each round).
    mode: str = "fast"
    # Also run the reference loop and require token equality with the fast path.
    check_reference: bool = False
    # JSON report path (`draftinfer.report.RunReport`).
    report: str = ""
    # PNG of per-position acceptance: empty = beside the report (same stem), `none` = no plot.
    plot: str = ""
    progress: bool = True
