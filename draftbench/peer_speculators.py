"""Peer for the training-step benchmark (DESIGN 7): vllm-project/speculators 0.9.0.

`eagle3_train_step_bench` builds speculators' own EAGLE-3 drafter (`Eagle3DraftModel`, one
Llama decoder layer) at Llama-3.1-8B shapes with random weights, feeds it one packed sequence
made by speculators' own collate function, and times full training steps exactly as
`speculators.train.trainer.Trainer.train_epoch` runs them. `peagle_train_step_bench` does the
same for its P-EAGLE drafter (`PEagleDraftModel`, parallel drafting, our `ptd`'s analogue).
Both return one dict that `draftbench/train_step.py` puts beside our own trainer's numbers
(its DFlash step, beside our dflash, is `draftbench/peer_speculators_dflash.py`, on the helpers
here).

Installing the peer (nothing is downloaded at run time)
-------------------------------------------------------
`bash scripts/build_wheelhouse.sh .whl` adds `speculators==0.9.0` and the few packages that
`import speculators` needs and the GPU image lacks (openai, distro, sniffio, hs-connectors;
datasets, dill, multiprocess and pydantic are in the wheelhouse already). On the GPU machine:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD

`--no-deps` leaves the image's torch 2.11 / triton 3.6 / transformers 5.17 alone (speculators
0.9.0 asks for torch <=2.14.1 and transformers >=5.0,<=5.19: both satisfied). `available()`
says in one line why the peer cannot run, or None.

What one step is (speculators 0.9.0, `speculators train --speculator-type eagle3` defaults)
------------------------------------------------------------------------------------------
- Model: `Eagle3DraftModel` built from `Eagle3SpeculatorConfig` the way `from_training_args`
  builds it: draft decoder = `LlamaConfig` with the verifier's shapes and 1 layer
  (`create_transformer_layer_config`), `norm_before_residual=True`, `norm_before_fc=True`
  (one RMSNorm over the 3 concatenated aux hidden states), `norm_output=True` (post-norm hidden
  fed to the next TTT step), `fc_norm=False`, aux layers [2, 16, 29]. Master weights stay
  **fp32**; the forward runs under `torch.autocast(bf16)`. The draft `lm_head` [32000, H] and
  `embed_tokens` [V, H] are copied from the verifier and **frozen** (0.9.0 trains neither), so
  the trainable parameters are fc, the decoder layer and the norms.
- Batch (`CollateFn` + `shift_batch`, one sample filling `total_seq_len = seq_len`):
  `hidden_states` [1, T, 3H] bf16, `verifier_last_hidden_states` [1, T, H] bf16,
  `input_ids` [1, T], `loss_mask` [1, T] (all ones), `position_ids` [1, T] (1..T after the
  shift), `document_ids` [1, T] (all 0), `lengths` [1], `error_records` (int).
- Target distribution: `verifier_lm_head(verifier_norm(verifier_last_hidden_states))` under
  no_grad, where `verifier_lm_head` holds only the t2d-selected rows of the verifier head: the
  target is the softmax of the verifier logits *restricted to the draft vocabulary* (renormalised
  over those 32000 ids), [1, T, 32000], computed once per step and reused by every TTT step.
- Forward (`torch.compile`d whole when CUDA is present, `conditional_torch_compile`): TTT loop of
  `ttt_steps` passes; each concatenates [embed(ids), hidden] -> the layer, with a growing
  `DynamicCache` (step i attends over (i+1)*T keys: causal context + its own diagonal), flex
  attention (`simple_flex_attention`, a `BlockMask` extended by one diagonal block per step),
  teacher-forced ids shifted by 1+i. Loss per TTT step: fused Triton forward-KL(target || draft)
  over the draft vocabulary, masked mean over positions, summed over steps (decay 1.0).
- Step (`Trainer.train_epoch`): autocast forward -> `zero_grad` -> `loss.backward()` ->
  `clip_grad_norm_(1.0)` -> optimizer step(s) -> linear LR scheduler step. Default optimizer of
  the CLI is **Muon** (`torch.optim.Muon`, lr 1e-3, momentum 0.95, wd 0.1, 5 Newton-Schulz
  steps, `match_rms_adamw`) over the 2-D weights plus AdamW (lr 1e-3, wd 0.01) over the rest
  (`build_optimizers`).

What is timed, and where this departs from the real trainer
-----------------------------------------------------------
- Timed per step, between two `torch.cuda.synchronize()`: forward, zero_grad, backward, clip,
  optimizer and scheduler steps. `tokens_per_s` is the median over timed steps of
  `seq_len / step time`; `peak_gib` is the largest `torch.cuda.max_memory_allocated()` of a timed
  step (reset before each), so it includes weights, grads and optimizer state.
- Not timed / skipped: the DataLoader and its workers (the batch is made once, already on the
  device, so the trainer's per-step host-to-device copy is left out), per-step metric logging
  (`.item()` on the metrics dict), tqdm, checkpointing, DDP/FSDP.
- Draft attention: the 0.9.0 CLI defaults every draft layer to *sliding-window* attention
  (window 2048) unless `--full-attention-indices` is given. The benchmark defaults to full causal
  attention (`--full-attention-indices 0`), the EAGLE-3 model we train; pass
  `sliding_window=2048` to time the CLI default.
- `torch._dynamo.reset()` runs at the start and end of each call: a real run compiles once for
  its fixed `total_seq_len`, so each call compiles afresh for its own shape (the warmup steps
  absorb it), and no compiled graph keeps the peer's model alive after it. This also drops the
  caller's compiled graphs: a caller timing its own compiled code in the same process warms up
  again after calling the peer. `peak_gib` is process-wide: free other models before calling
  (`base_gib` reports what was allocated on entry, `leftover_gib` what stayed after).
- On CPU (tests): no compile (speculators only compiles with CUDA present), `sdpa` draft
  attention (`--draft-attn-impl sdpa`: torch has no flex-attention backward on CPU), the eager
  loss implementation instead of the Triton kernels, `peak_gib` 0.
"""

from __future__ import annotations

import gc
import importlib.metadata
import statistics
import time
from typing import Any

import torch

PEER = "speculators 0.9.0"
PEER_VERSION = "0.9.0"

# Llama-3.1-8B's RoPE (the draft layer inherits the verifier's rope parameters).
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
AUX_LAYER_IDS = [2, 16, 29]  # speculators' default [2, n // 2, n - 3] for n = 32 layers
CLI_SLIDING_WINDOW = 2048  # DraftArgs.sliding_window default


def available() -> str | None:
    """None when speculators 0.9.0 and its EAGLE-3 / P-EAGLE models import, else why not."""
    try:
        version = importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        return "speculators is not installed (bash scripts/build_wheelhouse.sh; see docstring)"
    if version != PEER_VERSION:
        return f"speculators {version} is installed, the peer is {PEER_VERSION}"
    try:
        import speculators.models.eagle3  # noqa: F401
        import speculators.models.peagle  # noqa: F401
        import speculators.train.optimizers  # noqa: F401
    except Exception as e:  # a missing dependency surfaces as any import-time error
        return f"speculators {version} does not import: {type(e).__name__}: {e}"
    return None


def _layer_config(
    kind, *, hidden, heads, kv_heads, head_dim, intermediate, vocab, window, device, num_layers=1
):
    """The draft decoder config `create_transformer_layer_config` makes from a Llama-3.1
    verifier (`num_layers` layers, the verifier's attention geometry and rope)."""
    from transformers import LlamaConfig, Qwen3Config

    layer_types = ["sliding_attention" if window else "full_attention"] * num_layers
    config = {"llama": LlamaConfig, "qwen3": Qwen3Config}[kind](
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_act="silu",
        max_position_embeddings=131072,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        head_dim=head_dim,
        tie_word_embeddings=False,
        sliding_window=window or CLI_SLIDING_WINDOW,
        use_sliding_window=bool(window),
        layer_types=layer_types,
    )
    config.rope_parameters = dict(LLAMA31_ROPE)
    # from_training_args' default is flex attention; torch has no flex backward on CPU, where
    # the CLI's `--draft-attn-impl sdpa` (dense boolean masks) is the way to train.
    config._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    return config


def _verifier_weights(model, *, vocab, draft_vocab, hidden, device, gen_seed):
    """Stand-in for `load_vocab_mappings` + `load_verifier_weights` (which read the verifier
    checkpoint): a t2d/d2t from a random token histogram through speculators' own
    `build_vocab_mappings_from_distribution`, random embeddings and a random head whose t2d rows
    become both `lm_head` and `verifier_lm_head`, as the loader copies them."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    g = torch.Generator().manual_seed(gen_seed)
    if draft_vocab != vocab:
        counts = torch.randint(1, 1_000_000, (vocab,), generator=g).tolist()
        d2t, t2d = build_vocab_mappings_from_distribution(
            dict(enumerate(counts)), draft_vocab, vocab
        )
        model.load_vocab_mappings(t2d, d2t)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0.0, 0.02)  # [V, H]
        head = torch.empty(draft_vocab, hidden, device=device).normal_(0.0, 0.02)  # [Vd, H]
        model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)
        model.verifier_norm.weight.fill_(1.0)


def _batch(*, seq_len, hidden, vocab, dtype, seed):
    """One collated batch as speculators' DataLoader yields it: a raw sample of seq_len + 1
    tokens (BaseDataset.__getitem__), `shift_batch`, then `CollateFn` padding to
    total_seq_len = seq_len (so one document fills it exactly)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    g = torch.Generator().manual_seed(seed + 1)
    n = seq_len + 1
    raw = {
        "hidden_states": torch.randn(n, 3 * hidden, generator=g).to(dtype),  # [n, 3H]
        "input_ids": torch.randint(0, vocab, (n,), generator=g),  # [n]
        "verifier_last_hidden_states": torch.randn(n, hidden, generator=g).to(dtype),  # [n, H]
        "loss_mask": torch.ones(n, dtype=torch.long),  # [n]
        "lengths": torch.tensor([n], dtype=torch.long),  # [1]
        "position_ids": torch.arange(n, dtype=torch.long),  # [n]
    }
    collate = CollateFn(
        max_len=seq_len,
        hidden_size=hidden,
        num_target_layers=3,
        dtype=dtype,
        preprocess=shift_batch,
    )
    return collate([raw])


def _optimizers(model, total_steps, optimizer="muon"):
    """`build_optimizers` + the linear warmup scheduler, with the CLI's default arguments
    (`optimizer`: its `--optimizer`, "muon" by default, or "adamw": one AdamW over all
    trainable parameters)."""
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig
    from transformers import get_linear_schedule_with_warmup

    config = TrainerConfig(
        lr=1e-3,
        num_epochs=1,
        save_path="",
        optimizer=optimizer,
        weight_decay=0.01,
        muon_lr=1e-3,
        muon_momentum=0.95,
        muon_weight_decay=0.1,
        muon_ns_steps=5,
        muon_adjust_lr_fn="match_rms_adamw",
    )
    opts = build_optimizers(model, config)
    scheds = [get_linear_schedule_with_warmup(o, total_steps // 100, total_steps) for o in opts]
    return opts, scheds


def _time_steps(
    model,
    batch,
    call_kwargs,
    *,
    device,
    dtype,
    steps,
    warmup,
    optimizer="muon",
    floor_into: dict | None = None,
):
    """Runs warmup + steps of `Trainer.train_epoch`'s step on one device-resident batch;
    with `floor_into`, one more step's GEMMs replayed alone (`draftbench.gemm_floor`) go to
    `floor_into["gemm_floor"]`."""
    opts, scheds = _optimizers(model, warmup + steps, optimizer)
    gpu_batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    cuda = device.type == "cuda"

    def one_step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            _draft_tokens, loss, _metrics = model(**gpu_batch, **call_kwargs)
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
        for sched in scheds:
            sched.step()
        return loss.detach()

    step_ms, peaks, loss_value = [], [], float("nan")
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        loss = one_step()
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if i >= warmup:
            step_ms.append(dt * 1e3)
            peaks.append(torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0)
        loss_value = float(loss)
    if floor_into is not None:
        from draftbench.gemm_floor import floor_of

        floor_into["gemm_floor"] = floor_of(one_step, device)
    return step_ms, max(peaks), loss_value, [type(o).__name__ for o in opts]


def _run_guarded(build_and_time, *, device, base: dict) -> dict:
    """Calls build_and_time() between two `torch._dynamo.reset()`s and returns its dict; an
    out-of-memory error becomes {"oom": True, ...}. Memory is released before returning (an
    exception's traceback pins the frames that hold the model, hence the free after `except`)
    and what stays allocated is reported as `leftover_gib` (a leak would bias the caller)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    base_gib = torch.cuda.memory_allocated(device) / 2**30 if cuda else 0.0
    result, error = None, None
    if cuda:
        _fused_losses_outside_dynamo()
    torch._dynamo.reset()
    try:
        result = build_and_time()
    except torch.OutOfMemoryError as e:
        error = str(e).splitlines()[0] if str(e) else "CUDA out of memory"
    except Exception as e:  # inductor/triton may wrap an allocation failure
        if "out of memory" not in str(e).lower():
            raise
        error = f"{type(e).__name__}: " + str(e).strip().splitlines()[-1][:300]
    torch._dynamo.reset()  # compiled graphs must not outlive the model they were traced for
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    extra = {
        "base_gib": base_gib,
        "leftover_gib": (torch.cuda.memory_allocated(device) / 2**30 - base_gib) if cuda else 0.0,
    }
    if result is not None:
        return {**result, **extra}
    return {
        **base,
        **extra,
        "oom": True,
        "error": error,
        "tokens_per_s": None,
        "step_ms": [],
        "peak_gib": None,
    }


# torch 2.11's dynamo cannot trace speculators 0.9.0's fused KL loss inside its compiled
# forward (the two autotuned Triton kernels share one `configs` list: "ListVariable(...) is
# already tracked for mutation", measured on the H200), so its CLI's compiled step fails on
# that torch. The loss runs as speculators' own fused Triton kernels, outside the compiled
# graph (one graph break); everything else stays compiled as speculators compiles it. Its
# DFlash CE (`fused_ce_loss`) goes through the same `_FusedLoss` kernels, so it is wrapped too
# (`draftbench/peer_speculators_dflash.py`).
FUSED_LOSS_NOTE = "fused KL loss run outside torch.compile (torch 2.11 dynamo fails to trace it)"


def _fused_losses_outside_dynamo() -> None:
    from speculators.losses import fused

    for name in (
        "fused_kl_div_loss",
        "fused_reverse_kl_div_loss",
        "fused_js_div_loss",
        "fused_ce_loss",
    ):
        fn = getattr(fused, name)
        if not getattr(fn, "_outside_dynamo", False):
            wrapped = torch._dynamo.disable(fn)
            wrapped._outside_dynamo = True
            setattr(fused, name, wrapped)


def eagle3_train_step_bench(
    *,
    seq_len: int,
    ttt_steps: int = 7,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=14336,
    vocab=128256,
    draft_vocab=32000,
    steps=6,
    warmup=2,
    device="cuda",
    dtype=torch.bfloat16,
    seed=0,
    sliding_window: int | None = None,
    optimizer: str = "muon",
    gemm_floor: bool = False,
) -> dict[str, Any]:
    """Times speculators 0.9.0's EAGLE-3 training step on one packed sequence of seq_len tokens.

    dtype is speculators' `hidden_states_dtype` (batch hidden states and autocast); weights are
    fp32 masters as in its trainer. sliding_window=None is full causal draft attention;
    2048 is the 0.9.0 CLI default. optimizer: the CLI's `--optimizer` ("muon", its default,
    or "adamw"). Returns {"peer", "seq_len", "ttt_steps", "tokens_per_s",
    "step_ms", "peak_gib", "param_dtype", "notes", ...}, or the same with "oom": True;
    `gemm_floor`: also one more step's GEMMs replayed alone ("gemm_floor",
    `draftbench.gemm_floor`).
    """
    device = torch.device(device)
    base = {
        "peer": PEER,
        "kind": "eagle3",
        "seq_len": seq_len,
        "ttt_steps": ttt_steps,
        "param_dtype": "float32",
        "compute_dtype": str(dtype).removeprefix("torch."),
        "attention": f"sliding {sliding_window}" if sliding_window else "full causal",
        "oom": False,
    }

    def build_and_time():
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        torch.manual_seed(seed)
        layer = _layer_config(
            "llama",
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=intermediate,
            vocab=vocab,
            window=sliding_window,
            device=device,
        )
        config = Eagle3SpeculatorConfig(
            transformer_layer_config=layer,
            draft_vocab_size=draft_vocab,
            norm_before_residual=True,
            norm_before_fc=True,
            fc_norm=False,
            norm_output=True,
            embed_requires_grad=False,
            eagle_aux_hidden_state_layer_ids=AUX_LAYER_IDS,
            speculators_config=SpeculatorsConfig(
                algorithm="eagle3",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
                default_proposal_method="greedy",
                verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
            ),
        )
        model = Eagle3DraftModel(config=config).to(device)  # fp32 masters, as Trainer.setup_model
        _verifier_weights(
            model, vocab=vocab, draft_vocab=draft_vocab, hidden=hidden, device=device, gen_seed=seed
        )
        model.train()
        batch = _batch(seq_len=seq_len, hidden=hidden, vocab=vocab, dtype=dtype, seed=seed)
        call_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
            loss_fn="kl_div",
            loss_implementation="fused" if device.type == "cuda" else "eager",
            ttt_steps=ttt_steps,
            ttt_step_loss_decay=1.0,
        )
        extra: dict = {}
        step_ms, peak, loss, opt_names = _time_steps(
            model,
            batch,
            call_kwargs,
            device=device,
            dtype=dtype,
            steps=steps,
            warmup=warmup,
            optimizer=optimizer,
            floor_into=extra if gemm_floor else None,
        )
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {
            **base,
            **extra,
            "tokens_per_s": statistics.median(seq_len / (ms / 1e3) for ms in step_ms),
            "step_ms": step_ms,
            "peak_gib": peak,
            "loss": loss,
            "trainable_params": trainable,
            "optimizer": "+".join(opt_names),
            "compiled": device.type == "cuda",
            "notes": _notes(device, "eagle3"),
        }

    return _run_guarded(build_and_time, device=device, base=base)


def peagle_train_step_bench(
    *,
    seq_len: int,
    k: int = 8,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=14336,
    vocab=128256,
    draft_vocab=32000,
    steps=6,
    warmup=2,
    device="cuda",
    dtype=torch.bfloat16,
    seed=0,
    max_anchors: int | None = 512,
    sliding_window: int | None = None,
) -> dict[str, Any]:
    """Times speculators 0.9.0's P-EAGLE training step (k parallel depths = `num_depths`).

    One forward over the sequence plus COD-sampled deeper positions: depth d keeps
    int((A - d) * max(0.7**d, 0.2)) of A = min(seq_len, max_anchors) anchors (CLI defaults),
    so about seq_len + 1200 rows at k = 8. CLI defaults for peagle: a Qwen3 draft layer, no
    norm_before_fc / norm_output, trainable embeddings (AdamW over [V, H]). Same dict as
    `eagle3_train_step_bench` with "k" instead of "ttt_steps".
    """
    device = torch.device(device)
    base = {
        "peer": PEER,
        "kind": "peagle",
        "seq_len": seq_len,
        "k": k,
        "max_anchors": max_anchors,
        "param_dtype": "float32",
        "compute_dtype": str(dtype).removeprefix("torch."),
        "attention": f"sliding {sliding_window}" if sliding_window else "full causal",
        "oom": False,
    }

    def build_and_time():
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        torch.manual_seed(seed)
        layer = _layer_config(
            "qwen3",
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=intermediate,
            vocab=vocab,
            window=sliding_window,
            device=device,
        )
        config = PEagleSpeculatorConfig(
            transformer_layer_config=layer,
            draft_vocab_size=draft_vocab,
            norm_before_residual=True,
            norm_before_fc=False,
            fc_norm=False,
            norm_output=False,
            eagle_aux_hidden_state_layer_ids=AUX_LAYER_IDS,
            # Llama-3.1's tokenizer has no mask token and no spare slot: speculators falls
            # back to an existing id; which one does not change the cost.
            mask_token_id=vocab - 1,
            speculators_config=SpeculatorsConfig(
                algorithm="peagle",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)],
                default_proposal_method="greedy",
                verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
            ),
        )
        model = PEagleDraftModel(config=config).to(device)
        _verifier_weights(
            model, vocab=vocab, draft_vocab=draft_vocab, hidden=hidden, device=device, gen_seed=seed
        )
        model.train()
        batch = _batch(seq_len=seq_len, hidden=hidden, vocab=vocab, dtype=dtype, seed=seed)
        call_kwargs, _ = PEagleDraftModel.get_trainer_kwargs(
            loss_fn="kl_div",
            loss_implementation="fused" if device.type == "cuda" else "eager",
            max_anchors=max_anchors,
            num_depths=k,
            down_sample_ratio=0.7,
            down_sample_ratio_min=0.2,
        )
        step_ms, peak, loss, opt_names = _time_steps(
            model,
            batch,
            call_kwargs,
            device=device,
            dtype=dtype,
            steps=steps,
            warmup=warmup,
        )
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {
            **base,
            "tokens_per_s": statistics.median(seq_len / (ms / 1e3) for ms in step_ms),
            "step_ms": step_ms,
            "peak_gib": peak,
            "loss": loss,
            "trainable_params": trainable,
            "optimizer": "+".join(opt_names),
            "compiled": device.type == "cuda",
            "notes": _notes(device, "peagle"),
        }

    return _run_guarded(build_and_time, device=device, base=base)


def _notes(device, kind) -> str:
    common = (
        "speculators 0.9.0 model, collate, loss, build_optimizers (the row's optimizer) and linear "
        "scheduler; Trainer.train_epoch step (autocast bf16 fwd, zero_grad, backward, "
        "clip 1.0, opt, sched); fp32 master weights; frozen lm_head/embeddings"
        + (" (embeddings trainable for peagle)" if kind == "peagle" else "")
        + "; batch pre-staged on the device (no DataLoader, no H2D copy, no metric logging)"
    )
    if device.type == "cuda":
        return (
            common
            + "; forward torch.compile'd by speculators, fused Triton KL loss; "
            + FUSED_LOSS_NOTE
        )
    return common + (
        "; CPU: eager forward (no compile), sdpa attention (no flex backward on CPU), eager KL "
        "loss, peak not measured"
    )
