"""Benchmarks and hardware checks over the three packages, one module per kernel or pipeline,
each run with `python -m draftbench.<name>` (its docstring gives the commands; `--help` the
options). Correctness is checked before anything is timed (STYLE 16).

- kernels: `chain_inputs`, `parallel_layout`, `rejection_sampler` (Triton vs torch reference vs
  `torch.compile(reference)`);
- inference: `decode` (native target vs HF), `decode_peer` (vs gpt-fast), `drafting` (drafting
  time against K per kind), `round` (one speculative round vs one plain decode step, dense and
  MoE targets, with `floor`: the bytes a step must read over the copy bandwidth), `al_gap`
  (the runner's walk against one round at every start: where a training-time AL and the
  runner's part);
- training: `train_step` (our training step, with `peer_speculators`: speculators 0.9.0's
  EAGLE-3 and P-EAGLE steps, and `peer_speculators_dflash`: its DFlash step), `multi_gpu`
  (accelerate engines on 2+ GPUs vs one GPU);
- shared: `shapes` (the registry of real model dimensions), `timing` (timers, the table).

Benchmarks sit above the libraries (`draftbench -> drafttrain -> draftinfer -> draftkernels`):
they name the drafter kinds they time, which shared library code never does (DESIGN 2.1), and
nothing in the libraries imports them. Without CUDA each prints why and exits 0, except the CPU
smoke modes (`--tiny`, `--smoke`, `--device cpu`) that tests and CI use.
"""
