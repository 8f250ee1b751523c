"""Typed schema of `python -m draftinfer` (Hydra converts into this once, in `__main__`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EvalConfig:
    """`eval=<suite>|standard`: the acceptance suites a run decodes (`draftinfer.evaluation.suite_run`).
    No suite (`eval=greedy|sampling`): the held-out prompts of `prompts=` (`draftinfer.evaluation.run`)."""

    # Suite presets (conf/draftinfer/suite/<name>.yaml) or paths of suite .yaml files.
    suites: list[str] = field(default_factory=list)
    # A local copy in the hub dataset's schema: a file or directory for one suite, or a
    # directory holding `<suite>.jsonl|.json|.parquet` or `<suite>/` per suite.
    path: str | None = None
    # Override every suite's number of prompts / new tokens / thinking switch (null: its own).
    num_prompts: int | None = None
    max_new_tokens: int | None = None
    enable_thinking: bool | None = None
    # Where the report (`suites.json`, `suites.png`) and the per-request results go
    # (null: `<drafter>/suites`); the drafter's model card (`README.md`) gets the table.
    out_dir: str | None = None
    # Skip requests already decoded there with the same settings (false: decode them again).
    resume: bool = True
    # At temperature > 0, check the fast path against the reference loop (token equality on
    # the same seeds); false skips it (slow for long outputs) and reports lossless as unchecked.
    check_sampled: bool = True
    # Write the "Acceptance by benchmark" section into the drafter's README.md, if it has one.
    card: bool = True


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
    # Suites only: the temperatures each suite is decoded at (null: [temperature]), e.g. [0, 1].
    temperatures: list[float] | None = None
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
    # The fast path: compile the target's verify forward and the drafter forward(s)
    # (`compile`) and replay each round from a CUDA graph (`cuda_graphs`). null (the default)
    # = on for CUDA (graphs with compile), off on the CPU (its exact fp32 default);
    # `compile=false` is the escape hatch (then no graphs unless `cuda_graphs=true`).
    compile: bool | None = None
    # Inductor settings for what `compile` compiles (`torch.compile(options=...)`, names from
    # `torch._inductor.config`): null = the runner's default, on CUDA `{combo_kernels: true}`
    # (independent kernels in one launch: 0.05 ms off dflash's K=7 round on an H100;
    # `draftinfer.decoding.compiled.RUNNER_CUDA_OPTIONS`), inductor's defaults on the CPU; a mapping =
    # exactly those settings (`compile_options={}`: inductor's defaults everywhere,
    # `compile_options={combo_kernels:true,max_autotune:true}`). Typed `Any` so that the
    # command line can put a mapping where the default is null.
    compile_options: Any = None
    # Run the target's and the drafter's q/k/v and gate/up projections as one GEMM each
    # (`draftinfer.models.transforms.fuse_projections`, the same weights). null (the default) =
    # on for CUDA, off on the CPU (where the fp32 lossless check and the golden AL files are
    # kept on the unfused GEMMs). On one H100 at batch 1 (Llama-3.1-8B shapes) it takes the
    # graph-captured plain step from 1.31x to 1.14x gpt-fast's (docs/results.md).
    fuse_projections: bool | None = None
    # Run GEMMs of at most 16 rows (decode, verify, drafting) in bf16/fp16 through the
    # skinny-GEMM Triton kernel (`draftkernels.skinny_gemm`, target and drafter;
    # `draftinfer.models.transforms.use_skinny_gemm`), F.linear elsewhere. null (the default)
    # = on for CUDA. On one H100 a Llama-3.1-8B decode step's GEMMs take 0.90x cuBLAS's time
    # (docs/results.md).
    skinny_gemm: bool | None = None
    # Launch the kernels with programmatic dependent launch (`draftkernels.runtime.enable_pdl`:
    # this package's and inductor's, Hopper and later GPUs; a kernel scheduled while the one
    # before it finishes, waiting before it reads what that one wrote; the same bits). null
    # (the default) = on for CUDA with `compile`, where it was measured: on one H100 the
    # graph-captured 8B plain step 5.595 -> 5.468 ms (docs/inference.md, docs/results.md).
    pdl: bool | None = None
    # Replay each round from a CUDA graph (`draftinfer.decoding.graphs`; CUDA only). null = as
    # `compile` resolves on CUDA (above).
    cuda_graphs: bool | None = None
    # The plain decoding the report's speedup is measured against: "auto" (the best this
    # project has on the device: the plain step compiled and, on CUDA, graph-replayed as the
    # round is, under the same serving transforms, when the fast path is on; the eager loop
    # otherwise), "compiled" or "eager" (by name, whatever the fast path).
    baseline: str = "auto"
    # Launch each round before reading the previous one back (`SpecDecoder(pipeline=)`: the
    # device never waits for the host's readback and Python between rounds; the same
    # outputs). null (the default) = on for CUDA, off on the CPU. On one H100 at batch 1 it
    # took ptd's K=4 round from 1.198x to 1.155x gpt-fast's step (docs/results.md).
    pipeline: bool | None = None
    # How the drafter's rotary reads positions: "native" (as trained: the target's [3, N]
    # M-RoPE rows for a Qwen3-VL drafter) or "1d" (as an engine that strips `mrope_section`
    # serves it: plain RoPE at the T row, vLLM's `positions[0]`), to measure the AL that costs
    # before deploying there (`draftinfer.models.rope.serve_positions_1d`; an error for a 1-D drafter).
    drafter_positions: str = "native"
    # Tensor parallel: the target's attention heads and dense MLP split over `tp` processes
    # (`draftinfer.models.tensor_parallel`; the family's plan, `causal_lm` for now), one process
    # per rank started by torchrun (`torchrun --nproc-per-node 2 -m draftinfer tp=2 ...`:
    # RANK / WORLD_SIZE / MASTER_ADDR in the environment). Every rank runs the same rounds
    # with the drafter replicated; rank 0 writes the report. gloo on the CPU, NCCL on CUDA
    # (untested here). 1 = one process, no torch.distributed.
    tp: int = 1
    # "fast" (KV-cached loop) or "reference" (recompute everything each round).
    mode: str = "fast"
    # Also run the reference loop and require token equality with the fast path.
    check_reference: bool = False
    # A JSON file of round costs in plain decode steps per K (`{"round_cost": {"3": 1.08,
    # ...}}`, written by `python -m draftbench.round --costs-out`, measured at the target's
    # real shapes on the GPU you serve on): the report then names the K <= k that maximises
    # expected tokens per second for this run's measured per-position acceptance
    # (`draftinfer.conventions.metrics.choose_k`; report `extra.k_choice`). Run at the
    # largest K you would serve: acceptance beyond it is not measured.
    round_costs: str = ""
    # Confidence-driven verification (`SpecDecoder(verify_threshold=)`,
    # `draftinfer.decoding.confidence`): cut each request's block at the first draft whose
    # cumulative confidence (product of the proposer's per-draft confidences: DSpark's head,
    # else the drafter's probability of its draft) is below this; null = the whole block.
    # Lossless either way (fewer drafts verified, never different tokens at T = 0).
    verify_threshold: float | None = None
    # Record each round's per-draft confidences and report their calibration against the
    # accept events (ECE, AUROC, Brier) and, from whole-block rounds (verify_threshold null),
    # the AL and verified rows at each of `threshold_sweep` (plus, with `round_costs`, the
    # threshold of the highest expected tokens/s): `draftinfer.evaluation.calibration`,
    # report `extra.calibration` / `extra.threshold_sweep`.
    confidence_report: bool = False
    threshold_sweep: list[float] = field(
        default_factory=lambda: [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    )
    # JSON report path (`draftinfer.evaluation.report.RunReport`).
    report: str = ""
    # PNG of per-position acceptance: empty = beside the report (same stem), `none` = no plot.
    plot: str = ""
    progress: bool = True
    eval: EvalConfig = field(default_factory=EvalConfig)
