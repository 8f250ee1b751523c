"""Peer for the dflash training-step row (DESIGN 7): vllm-project/speculators 0.9.0's DFlash.

`dflash_train_step_bench` builds speculators' own block drafter (`DFlashDraftModel`,
`speculators/models/dflash/`) at Llama-3.1-8B shapes with random weights, feeds it one sequence
made by speculators' own collate function, and times full training steps as
`speculators.train.trainer.Trainer.train_epoch` runs them (the step loop, optimizers and
guards are `draftbench/peer_speculators.py`'s, shared with its EAGLE-3 and P-EAGLE rows).
`draftbench/train_step.py` puts the result beside our `dflash` row. Installing the peer: see
`draftbench/peer_speculators.py` (the same wheel; `speculators.models.dflash` imports with
transformers 5.17: every name it takes from `transformers.models.qwen3.modeling_qwen3` is
there, checked against the 5.17.0 wheel's source).

What one step is (speculators 0.9.0, `speculators train --speculator-type dflash` defaults)
------------------------------------------------------------------------------------------
- Model: `DFlashDraftModel` from `DFlashSpeculatorConfig` as `from_training_args` builds it:
  `num_layers` (CLI default 5) Qwen3 decoder layers with the verifier's shapes
  (`create_transformer_layer_config`, `draft_arch` qwen3 for dflash), `fc` over the
  concatenated target layers -> `hidden_norm`, the block `[anchor, MASK x (B-1)]` attending to
  the context before its anchor (bidirectional inside the block in full-attention layers),
  `block_size` 16 (the CLI's dflash default). Master weights **fp32**, forward under
  `torch.autocast(bf16)`. Draft vocabulary: the verifier's whole vocabulary (the CLI's
  default without a token-frequency file: `draft_vocab_size` None), so `lm_head` [V, H] and
  `embed_tokens` [V, H] are verifier copies and **frozen**; trainable: fc, hidden_norm, the
  layers and the final norm (our dflash trains the same set).
- Batch (`CollateFn`, no preprocess for dflash: no shift), one sample filling
  `total_seq_len = seq_len`: `hidden_states` [1, T, n_taps * H] bf16,
  `verifier_last_hidden_states` [1, T, H] bf16, `input_ids`, `loss_mask` (0 on the first
  T // 32 tokens, a prompt, as our row), `position_ids` 0..T-1, `document_ids` (all 0).
- Anchors (`select_anchors`, inside the step): `max_anchors` (512) drawn uniformly from the
  loss-mask tokens except the last `block_size`, sorted; the step always computes
  `max_anchors * block_size` block rows (8192 at the defaults), padded anchors masked out.
- Target: `verifier_lm_head(verifier_norm(verifier_last_hidden_states[anchor + s - 1]))`
  under no_grad, `[1, A * B, V]` logits, one row per block slot.
- Forward (`torch.compile`d whole when CUDA is present, its mask built by a compiled
  `create_block_mask`): 5 layers over the A * B block rows with `[context T | block rows]`
  keys (`simple_flex_attention`), `lm_head` -> `[1, A * B, V]` logits. Loss (`compute_metrics`):
  the CLI's dflash default `loss_fn` "ce" (cross-entropy against the **argmax** of the
  target logits, speculators' fused Triton kernel over the full `[A * B, V]` logits), per-slot
  weights D-PACE (`per_position_loss_weight` dpace, its dflash default; `fixed-exp-decay` with
  `gamma` on request), anchor slot unweighted, masked mean.
- Step (`Trainer.train_epoch`): autocast forward -> `zero_grad` -> backward -> `clip 1.0` ->
  optimizer step(s) -> scheduler step. Optimizer: the CLI's default Muon (2-D weights) +
  AdamW (rest), or `optimizer="adamw"` (one AdamW, what our trainer uses).

Departures from the real trainer (as the EAGLE-3 row): no DataLoader, no host-to-device copy,
no metric `.item()` logging; `torch._dynamo.reset()` around each call; the fused loss runs
outside the compiled graph (torch 2.11's dynamo cannot trace speculators' autotuned loss
kernels, `peer_speculators.FUSED_LOSS_NOTE`); draft layers use **full** attention by default
(the CLI defaults every layer to a 2048-token sliding window unless `--full-attention-indices`
names it; `sliding_window=2048` times that default; at seq 3072 the two differ little). On
CPU (tests): eager forward, `sdpa` attention (dense masks), the eager loss, peak 0.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from draftbench import peer_speculators as peer

# z-lab's build_target_layer_ids(32, 5): the layers the 8B recipe taps (only their count,
# the width of `fc`, matters to the cost).
LLAMA31_DFLASH_LAYERS = [1, 8, 15, 22, 29]


def available() -> str | None:
    """None when speculators 0.9.0 and its DFlash model import, else why not."""
    reason = peer.available()
    if reason:
        return reason
    try:
        import speculators.models.dflash  # noqa: F401
    except Exception as e:  # a missing name in this transformers surfaces here
        return f"speculators 0.9.0 DFlash does not import: {type(e).__name__}: {e}"
    return None


def _batch(*, seq_len, hidden, n_taps, vocab, dtype, seed):
    """One collated batch as speculators' DataLoader yields it for dflash: a raw sample of
    seq_len tokens (BaseDataset.__getitem__; dflash has no `shift_batch`), `CollateFn`
    padding to total_seq_len = seq_len."""
    from speculators.train.data import CollateFn

    g = torch.Generator().manual_seed(seed + 1)
    n = seq_len
    loss_mask = torch.ones(n, dtype=torch.long)
    loss_mask[: max(1, n // 32)] = 0  # a prompt, as our row's batch
    raw = {
        "hidden_states": torch.randn(n, n_taps * hidden, generator=g).to(dtype),  # [n, nH]
        "input_ids": torch.randint(0, vocab, (n,), generator=g),  # [n]
        "verifier_last_hidden_states": torch.randn(n, hidden, generator=g).to(dtype),  # [n, H]
        "loss_mask": loss_mask,  # [n]
        "lengths": torch.tensor([n], dtype=torch.long),  # [1]
        "position_ids": torch.arange(n, dtype=torch.long),  # [n]
    }
    collate = CollateFn(max_len=seq_len, hidden_size=hidden, num_target_layers=n_taps, dtype=dtype)
    return collate([raw])


def dflash_train_step_bench(
    *,
    seq_len: int,
    block_size: int = 16,
    num_layers: int = 5,
    target_layer_ids: list[int] | None = None,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=14336,
    vocab=128256,
    draft_vocab: int | None = None,
    max_anchors: int = 512,
    steps=6,
    warmup=2,
    device="cuda",
    dtype=torch.bfloat16,
    seed=0,
    sliding_window: int | None = None,
    optimizer: str = "muon",
    per_position_loss_weight: str = "dpace",
    gamma: float = 4.0,
) -> dict[str, Any]:
    """Times speculators 0.9.0's DFlash training step on one sequence of seq_len tokens.

    block_size, num_layers, max_anchors: the CLI's dflash defaults (16, 5, 512).
    target_layer_ids: the tapped verifier layers (default the 8B recipe's five).
    draft_vocab None: the verifier's whole vocabulary (the CLI default). sliding_window None:
    full attention in every layer (2048 is the CLI default). optimizer: "muon" (default) or
    "adamw". per_position_loss_weight: "dpace" (its dflash default) or "fixed-exp-decay"
    (with `gamma`). Returns {"peer", "kind", "seq_len", "block_size", "anchors",
    "tokens_per_s", "step_ms", "peak_gib", ...}, or the same with "oom": True.
    """
    device = torch.device(device)
    layers = list(target_layer_ids or LLAMA31_DFLASH_LAYERS)
    draft_vocab = draft_vocab or vocab
    base = {
        "peer": peer.PEER,
        "kind": "dflash",
        "seq_len": seq_len,
        "block_size": block_size,
        "num_layers": num_layers,
        "max_anchors": max_anchors,
        "block_rows": max_anchors * block_size,
        "taps": len(layers),
        "draft_vocab": draft_vocab,
        "param_dtype": "float32",
        "compute_dtype": str(dtype).removeprefix("torch."),
        "attention": f"sliding {sliding_window}" if sliding_window else "full",
        "loss_fn": f"ce (argmax target), {per_position_loss_weight} weights",
        "oom": False,
    }

    def build_and_time():
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        torch.manual_seed(seed)
        layer = peer._layer_config(
            "qwen3",
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=intermediate,
            vocab=vocab,
            window=sliding_window,
            device=device,
            num_layers=num_layers,
        )
        config = DFlashSpeculatorConfig(
            transformer_layer_config=layer,
            draft_vocab_size=draft_vocab,
            block_size=block_size,
            aux_hidden_state_layer_ids=layers,
            # Llama-3.1 has no spare row: a reserved special token, as our preset's 128002.
            mask_token_id=min(128002, vocab - 1),
            speculators_config=SpeculatorsConfig(
                algorithm="dflash",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block_size - 1)],
                default_proposal_method="greedy",
                verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
            ),
        )
        with torch.device(device):  # ~1.2B parameters at 8B shapes: initialised in place
            model = DFlashDraftModel(config=config).to(device)  # fp32 masters
        peer._verifier_weights(
            model, vocab=vocab, draft_vocab=draft_vocab, hidden=hidden, device=device, gen_seed=seed
        )
        model.train()
        batch = _batch(
            seq_len=seq_len, hidden=hidden, n_taps=len(layers), vocab=vocab, dtype=dtype, seed=seed
        )
        call_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(
            loss_fn="ce",
            loss_implementation="fused" if device.type == "cuda" else "eager",
            dflash_decay_gamma=gamma,
            max_anchors=max_anchors,
            per_position_loss_weight=per_position_loss_weight,
        )
        step_ms, peak, loss, opt_names = peer._time_steps(
            model,
            batch,
            call_kwargs,
            device=device,
            dtype=dtype,
            steps=steps,
            warmup=warmup,
            optimizer=optimizer,
        )
        valid = int(batch["loss_mask"][0, :-block_size].sum())  # select_anchors' candidates
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {
            **base,
            "anchors": min(max_anchors, valid),
            "tokens_per_s": statistics.median(seq_len / (ms / 1e3) for ms in step_ms),
            "step_ms": step_ms,
            "peak_gib": peak,
            "loss": loss,
            "trainable_params": trainable,
            "optimizer": "+".join(opt_names),
            "compiled": device.type == "cuda",
            "notes": _notes(device),
        }

    return peer._run_guarded(build_and_time, device=device, base=base)


def _notes(device) -> str:
    common = (
        "speculators 0.9.0 DFlashDraftModel, CollateFn, select_anchors, compute_metrics (ce "
        "against the target argmax, the row's per-slot weights), build_optimizers (the row's "
        "optimizer) and linear scheduler; Trainer.train_epoch step (autocast bf16 fwd, "
        "zero_grad, backward, clip 1.0, opt, sched); fp32 master weights; frozen "
        "lm_head/embeddings (full verifier vocabulary); batch pre-staged on the device"
    )
    if device.type == "cuda":
        return common + (
            "; forward torch.compile'd by speculators; fused CE loss run outside "
            "torch.compile (the same autotuned kernels as its KL, which torch 2.11's dynamo "
            "fails to trace)"
        )
    return common + "; CPU: eager forward, sdpa attention with dense masks, eager loss"
