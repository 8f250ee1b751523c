"""Chain-drafter input preparation after verification: shift, pending-token insert, positions.

After a round, request `b` (committed length `L_b` before the round) emitted
`output_token_ids[b, :a_b + 1]`: its `a_b` accepted drafts, then the recovered or bonus
token. The drafter's next first pass consumes exactly those rows (convention 1, shifted by
one: drafter row `i = L_b - 1 + j` consumes token `t_{i+1} = output_token_ids[b, j]` with the
verify forward's target feature of slot `j`, at position `L_b - 1 + j`), and the last emitted
token becomes the *pending* token, the first slot of the next verify forward (`[t_{L'-1}, d_1..d_K]`).

    prepare_chain_inputs(output_token_ids [B, K+1] int64 (-1 past the emitted tokens),
                         num_accepted [B] int64, seq_lens [B] int64)
      -> first_pass_ids [B, K+1] int64 (0 at padding), first_pass_pos [B, K+1] int64
         (-1 = padding: no KV write), new_seq_lens [B] int64 (L + a + 1),
         next_pending [B] int64 (the last emitted token)

One Triton program per request; `prepare_chain_inputs_ref` is the pure-torch reference with
the same signature (test oracle, CPU fallback, benchmark baseline).
"""

from __future__ import annotations

import torch
from draftkernels.runtime import check_tensor as _check
from draftkernels.runtime import triton_available, use_triton

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _prepare_chain_inputs_kernel(
        out_ptr,  # [B, W] emitted tokens, -1 padded
        acc_ptr,  # [B] accepted drafts a
        len_ptr,  # [B] committed length L before the round
        ids_ptr,  # [B, W] first-pass ids
        pos_ptr,  # [B, W] first-pass positions (-1 padding)
        new_len_ptr,  # [B]
        pending_ptr,  # [B]
        W,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        a = tl.load(acc_ptr + b)
        L = tl.load(len_ptr + b)
        j = tl.arange(0, BLOCK)
        inside = j < W
        live = j <= a
        tok = tl.load(out_ptr + b * W + j, mask=inside & live, other=0)
        tl.store(ids_ptr + b * W + j, tl.where(live, tok, 0), mask=inside)
        tl.store(pos_ptr + b * W + j, tl.where(live, L - 1 + j, -1), mask=inside)
        tl.store(new_len_ptr + b, L + a + 1)
        tl.store(pending_ptr + b, tl.load(out_ptr + b * W + a))


def _check_inputs(output_token_ids, num_accepted, seq_lens) -> tuple[int, int]:
    if output_token_ids.dim() != 2:
        raise ValueError("output_token_ids must be [B, K+1]")
    b, w = output_token_ids.shape
    _check(output_token_ids, "output_token_ids", (torch.int64,), (b, w))
    _check(num_accepted, "num_accepted", (torch.int64,), (b,))
    _check(seq_lens, "seq_lens", (torch.int64,), (b,))
    return b, w


def prepare_chain_inputs_ref(
    output_token_ids: torch.Tensor, num_accepted: torch.Tensor, seq_lens: torch.Tensor
):
    """Pure-torch reference; same signature and outputs as `prepare_chain_inputs`."""
    B, W = output_token_ids.shape
    j = torch.arange(W, device=output_token_ids.device)[None]  # [1, W]
    live = j <= num_accepted[:, None]  # [B, W]
    ids = torch.where(live, output_token_ids, 0)
    pos = torch.where(live, seq_lens[:, None] - 1 + j, -1)
    pending = output_token_ids.gather(1, num_accepted[:, None])[:, 0]
    return ids, pos, seq_lens + num_accepted + 1, pending


def prepare_chain_inputs(
    output_token_ids: torch.Tensor, num_accepted: torch.Tensor, seq_lens: torch.Tensor
):
    """See the module docstring. Runs the Triton kernel where `use_triton` says so (CUDA, or
    CPU under `TRITON_INTERPRET=1`), else the torch reference. `num_accepted[b] <= K` is the
    caller's contract (it comes from the rejection sampler)."""
    B, W = _check_inputs(output_token_ids, num_accepted, seq_lens)
    if B == 0 or not use_triton(output_token_ids.device):
        return prepare_chain_inputs_ref(output_token_ids, num_accepted, seq_lens)
    dev = output_token_ids.device
    ids = torch.empty(B, W, dtype=torch.int64, device=dev)
    pos = torch.empty(B, W, dtype=torch.int64, device=dev)
    new_len = torch.empty(B, dtype=torch.int64, device=dev)
    pending = torch.empty(B, dtype=torch.int64, device=dev)
    _prepare_chain_inputs_kernel[(B,)](
        output_token_ids,
        num_accepted,
        seq_lens,
        ids,
        pos,
        new_len,
        pending,
        W,
        BLOCK=triton.next_power_of_2(W),
    )
    return ids, pos, new_len, pending
