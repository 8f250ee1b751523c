"""Attention for training-time test (TTT) unrolling, without `[T, T * steps]` score matrices.

At TTT step `k` (0-based) drafter row `i` stands for the k-th chained draft after the
committed token `t_{i+1}`. In the runner that draft attends to the drafter KV of the
committed prefix (rows `0..i`, built from *target* features at step 0) and to the KV its own
chain wrote at steps `1..k` (all at row `i`). So a step-k query sees

    step-0 keys at rows j <= i   (causal, T x T)
    step-s keys at row i only    (s = 1..k: one "diagonal" score per step)

Nothing `[T, T * steps]` is materialized: memory is `O(T^2 + T * k)` per step for the eager
backend and `O(T * k)` for flex.

Backends:
- `eager`: the causal block as a normal score matrix and the diagonal scores as k row-wise
  dot products, under one softmax over `[T + k]` scores per row. Runs and back-propagates
  everywhere (CPU CI trains with it); the reference the flex backend is tested against.
- `flex`: one `flex_attention` call per step over the step-0 keys and the later steps' keys
  concatenated along the sequence, with a block mask that visits the causal blocks of the
  first segment and only the diagonal blocks of the others (`_ttt_block_mask`), so causal
  and diagonal scores share the kernel's softmax (the approach of speculators' trainer).
  Fast on CUDA (compiled); has no backward on CPU (torch raises), which is why `auto` picks
  eager there. Tests prove both give the same values and gradients.
- `flash` / `cudnn`: the causal block by torch's flash (FlashAttention-2; on the CPU its CPU
  flash kernel) or cuDNN attention kernel, which also returns the rows' log-sum-exp, and the
  diagonal scores merged in by that log-sum-exp (`ttt_attention_lse`). Backward runs the
  kernel's own backward with the *merged* output and log-sum-exp, which gives the causal
  block's exact share of the gradients (the same identity ring attention uses: the kernel
  recomputes its probabilities as `exp(s - lse)` and `D = rowsum(dO * O)` from what it is
  given), and the diagonal's gradients from the merge kernel (`draftkernels.ttt_merge`, one
  Triton program per row and kv head; its torch reference elsewhere). The causal block is
  the dense causal attention these kernels are tuned for, where flex's block-sparse kernel is
  slower: `auto` picks `cudnn` on Hopper (measured fastest, docs/results.md).
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
import torch.nn.functional as F
from draftkernels.ttt_merge import ttt_merge, ttt_merge_backward

from draftinfer.files.errors import ConfigError
from draftinfer.models.layers import expand_kv


def ttt_attention_eager(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    extra: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """q `[B, T, nh, D]`; k0/v0 `[B, T, nkv, D]` (step-0 keys/values); extra = [(k_s, v_s)]
    for steps 1..k, each `[B, T, nkv, D]` -> out `[B, T, nh, D]`."""
    nh, T, D = q.shape[2], q.shape[1], q.shape[3]
    scale = D**-0.5
    qh = q.transpose(1, 2)  # [B, nh, T, D]
    kh = expand_kv(k0, nh).transpose(1, 2)
    vh = expand_kv(v0, nh).transpose(1, 2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (qh @ kh.transpose(-1, -2)).float() * scale  # [B, nh, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    if not extra:
        p = torch.softmax(s0, dim=-1).to(q.dtype)
        return (p @ vh).transpose(1, 2)
    ks = [expand_kv(k, nh) for k, _ in extra]
    vs = [expand_kv(v, nh) for _, v in extra]
    sd = torch.stack([(q * k).sum(-1) for k in ks], dim=-1).float() * scale  # [B, T, nh, S]
    sd = sd.permute(0, 2, 1, 3)  # [B, nh, T, S]
    p = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1).to(q.dtype)
    out = p[..., :T] @ vh  # [B, nh, T, D]
    out = out.transpose(1, 2)
    pd = p[..., T:].permute(0, 2, 1, 3)  # [B, T, nh, S]
    for s, v in enumerate(vs):
        out = out + pd[..., s, None] * v
    return out


_flex_cache: dict[tuple, object] = {}
FLEX_BLOCK = 128


def flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cuda":
        key = ("flex", device.type)
        if key not in _flex_cache:
            _flex_cache[key] = torch.compile(flex_attention, dynamic=True)
        return _flex_cache[key]
    return flex_attention


def block_mask_from_blocks(
    partial: torch.Tensor,
    full: torch.Tensor,
    mask_mod,
    seq_len: int,
    block: int = FLEX_BLOCK,
    kv_len: int | None = None,
):
    """A flex `BlockMask` from block-level masks `[B, 1, nq, nk]` bool: `full` blocks are all
    visible (no mask_mod call), `partial` ones mixed (mask_mod decides per element); neither =
    skipped. Built without the dense `[N, N]` element mask `create_block_mask` materializes
    (1 GiB at 32k tokens; 8 bytes per element while it evaluates an indexing mask_mod).
    `kv_len`: the key length when it differs from the query length `seq_len`."""
    from torch.nn.attention.flex_attention import BlockMask

    def ordered(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = m.sum(-1, dtype=torch.int32)  # [B, 1, nq]
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
        return num, idx.to(torch.int32)  # [B, 1, nq, nk]: the first `num` are the blocks

    num, idx = ordered(partial)
    fnum, fidx = ordered(full)
    return BlockMask.from_kv_blocks(
        num,
        idx,
        fnum,
        fidx,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(seq_len, seq_len if kv_len is None else kv_len),
    )


def _ttt_block_mask(T: int, steps: int, device: torch.device):
    """The `BlockMask` of TTT step `steps` over keys `[step-0 keys, step-1 keys, ...]`, each
    segment `T` long (a multiple of FLEX_BLOCK): query row i sees step-0 keys j <= i (causal)
    and row i of every later segment (its own chain's keys). Block level: in segment 0 the
    diagonal blocks are partial and the ones below full; in later segments only the diagonal
    blocks are visited (partial). The predicate reads the key's row from a captured tensor, so
    one compiled flex kernel serves every length and step."""
    key = ("ttt_mask", T, steps, str(device))
    if key not in _flex_cache:
        nb = T // FLEX_BLOCK
        S = steps + 1
        key_row = torch.arange(S * T, device=device, dtype=torch.int32) % T

        def mask_mod(b, h, qi, ki):
            return (ki <= qi) | (key_row[ki] == qi)

        i = torch.arange(nb, device=device)
        j = torch.arange(S * nb, device=device)
        partial = (j[None, :] % nb == i[:, None])[None, None]
        full = (j[None, :] < i[:, None])[None, None]
        _flex_cache[key] = block_mask_from_blocks(partial, full, mask_mod, T, kv_len=S * T)
    return _flex_cache[key]


def ttt_attention_flex(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    extra: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Same contract as `ttt_attention_eager`; one flex call over the step-0 keys and the
    later steps' keys concatenated (`_ttt_block_mask`): the causal block and the diagonal
    scores under one softmax, no merge pass."""
    nh, T, D = q.shape[2], q.shape[1], q.shape[3]
    # Lengths padded to a multiple of FLEX_BLOCK: below 128 query rows inductor lowers flex
    # attention to its decoding kernel, which has no backward, and bucketed lengths compile
    # once per bucket. A padded query row is dropped; a padded key sits after every real
    # query of its segment (causal) or on a padded row (diagonal), so no real row sees it.
    Tp = -(-T // FLEX_BLOCK) * FLEX_BLOCK

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [B, T, h, D] -> [B, h, Tp, D]
        x = x.transpose(1, 2)
        return F.pad(x, (0, 0, 0, Tp - T)) if Tp != T else x

    qh = heads_first(q)
    kh = torch.cat([heads_first(k) for k in [k0] + [k for k, _ in extra]], dim=2)
    vh = torch.cat([heads_first(v) for v in [v0] + [v for _, v in extra]], dim=2)
    out = flex_fn(q.device)(
        qh,
        kh,
        vh,
        block_mask=_ttt_block_mask(Tp, len(extra), q.device),
        scale=D**-0.5,
        enable_gqa=kh.shape[1] != nh,
    )
    return out[:, :, :T].transpose(1, 2)  # [B, T, nh, D]


# ---- the causal block by a dense attention kernel, the diagonal merged by log-sum-exp ---------
_aten = torch.ops.aten


def _flash_fwd(q, k, v, scale):
    """q `[B, nh, T, D]`, k/v `[B, nkv, T, D]` -> (out `[B, nh, T, D]`, lse `[B, nh, T]` fp32,
    what backward needs). The kernels take grouped kv heads as they are."""
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale
        )
        return out, lse, ()
    out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale
    )
    return out, lse, (cq, ck, mq, mk, seed, offset)


def _flash_bwd(dout, q, k, v, out, lse, saved, scale):
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale
        )
    cq, ck, mq, mk, seed, offset = saved
    return _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale
    )


def _cudnn_fwd(q, k, v, scale):
    out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale
    )
    return out, lse, (cq, ck, mq, mk, seed, offset)


def _cudnn_bwd(dout, q, k, v, out, lse, saved, scale):
    cq, ck, mq, mk, seed, offset = saved
    return _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, True, scale=scale
    )


CAUSAL_KERNELS = {"flash": (_flash_fwd, _flash_bwd), "cudnn": (_cudnn_fwd, _cudnn_bwd)}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`[B, T, ...]` -> `[B * T, ...]` (the merge kernel's row layout)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


class _TTTAttentionLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, q, k0, v0, ks, vs):
        fwd, _ = CAUSAL_KERNELS[kernel]
        scale = q.shape[-1] ** -0.5
        out_c, lse_c, saved = fwd(q.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2), scale)
        lse_shape = lse_c.shape
        out_c = out_c.transpose(1, 2)  # [B, T, nh, D]
        lse_c = lse_c.reshape(lse_c.shape[:3]).transpose(1, 2)  # [B, T, nh]
        if ks is None:
            out, lse = out_c, lse_c
        else:  # draftkernels.ttt_merge: one program per row and kv head
            B, T = q.shape[:2]
            out, lse = ttt_merge(_rows(q), _rows(out_c), _rows(lse_c), _rows(ks), _rows(vs), scale)
            out, lse = out.view(q.shape), lse.view(B, T, -1)
        ctx.kernel, ctx.scale, ctx.saved, ctx.lse_shape = kernel, scale, saved, lse_shape
        ctx.save_for_backward(q, k0, v0, ks, vs, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, ks, vs, out, lse = ctx.saved_tensors
        _, bwd = CAUSAL_KERNELS[ctx.kernel]
        # The kernel's backward with the merged output and log-sum-exp: the causal block's
        # exact share of dq and its dk, dv (module docstring).
        lse_k = lse.transpose(1, 2).contiguous().view(ctx.lse_shape)
        dq, dk0, dv0 = bwd(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k0.transpose(1, 2),
            v0.transpose(1, 2),
            out.transpose(1, 2),
            lse_k,
            ctx.saved,
            ctx.scale,
        )
        dq, dk0, dv0 = (t.transpose(1, 2) for t in (dq, dk0, dv0))
        dks = dvs = None
        if ks is not None:
            dq, dks, dvs = ttt_merge_backward(
                *(_rows(t) for t in (dout, out, q, lse, ks, vs, dq)), ctx.scale
            )
            dq, dks, dvs = dq.view(q.shape), dks.view(ks.shape), dvs.view(vs.shape)
        return None, dq, dk0, dv0, dks, dvs


def dense_kernel_fits(q: torch.Tensor) -> bool:
    """Whether CUDA's flash / cuDNN attention takes queries like `q` `[B, T, nh, D]`: fp16 or
    bf16 (both kernels refuse fp32), a head size that is a multiple of 8 up to 128."""
    d = q.shape[-1]
    return q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 128


def ttt_attention_lse(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    extra: list[tuple[torch.Tensor, torch.Tensor]],
    kernel: str = "flash",
) -> torch.Tensor:
    """Same contract as `ttt_attention_eager`: the causal block by `kernel`'s dense causal
    attention (`CAUSAL_KERNELS`), the diagonal scores merged by log-sum-exp (module
    docstring). On CUDA, inputs the dense kernels do not take (`dense_kernel_fits`: fp32
    training without autocast, an unusual head size) run `ttt_attention_flex`, as does every
    call after the kernel raised once (reported once)."""
    flex_ok = q.device.type in FLEX_DEVICES
    if flex_ok and (not dense_kernel_fits(q) or kernel in _REFUSED):
        return ttt_attention_flex(q, k0, v0, extra)
    ks = torch.stack([k for k, _ in extra], dim=3) if extra else None  # [B, T, nkv, S, D]
    vs = torch.stack([v for _, v in extra], dim=3) if extra else None
    try:
        return _TTTAttentionLSE.apply(kernel, q, k0, v0, ks, vs)
    except RuntimeError as e:
        if not flex_ok or isinstance(e, torch.OutOfMemoryError):
            raise
        # A torch / cuDNN build whose kernel refuses these inputs must not stop training.
        warnings.warn(
            f"TTT attention: the {kernel} kernel failed ({e}); flex from now on", stacklevel=2
        )
        _REFUSED.add(kernel)
        return ttt_attention_flex(q, k0, v0, extra)


# Dense kernels that raised on this machine (`ttt_attention_lse` runs flex instead), and the
# devices where flex can stand in for them (it has no backward on the CPU).
_REFUSED: set[str] = set()
FLEX_DEVICES = {"cuda"}


BACKENDS = {
    "eager": ttt_attention_eager,
    "flex": ttt_attention_flex,
    "flash": partial(ttt_attention_lse, kernel="flash"),
    "cudnn": partial(ttt_attention_lse, kernel="cudnn"),
}
CUDA_ONLY = {"cudnn"}


def _cudnn_attention_measured(device: torch.device) -> bool:
    """Where `auto` picks `cudnn`: Hopper (sm90+) with cuDNN, where it was measured fastest
    (docs/results.md: the EAGLE-3 step at seq 8192 on an H200, flex 29,273 / flash 30,130 /
    cudnn 31,679 tokens/s head frozen). Elsewhere flex, the backend measured before it."""
    hopper = torch.cuda.get_device_capability(device) >= (9, 0)
    return hopper and torch.backends.cudnn.is_available()


def pick_backend(name: str, device: torch.device | None = None) -> str:
    """`drafter.attention_backend` for `device` (`auto`: eager on the CPU; on CUDA cudnn on
    Hopper, flex elsewhere), or a one-line `ConfigError`; without a device only the name is
    checked. Kinds whose training attention is not TTT's (ptd's rollouts, dflash's blocks)
    run flex for any backend but `eager`."""
    if name != "auto" and name not in BACKENDS:
        raise ConfigError(
            f"drafter.attention_backend must be auto or one of {', '.join(BACKENDS)}; got {name!r}"
        )
    if device is None:
        return name
    if name == "auto":
        if device.type != "cuda":
            return "eager"
        return "cudnn" if _cudnn_attention_measured(device) else "flex"
    if name in CUDA_ONLY and device.type != "cuda":
        raise ConfigError(f"drafter.attention_backend={name} needs a CUDA device")
    return name


class TTTAttention:
    """`attn_fn` for the unrolled forward: remembers each layer's step-0 keys/values and the
    diagonal keys/values of later steps. Create one per batch.

    `at(k)` is the attention of TTT step k: it reads the keys of steps `0..k-1` and records
    step k's, once. A step's forward may run again (activation checkpointing recomputes it
    during backward, when the later steps' keys are recorded too): it then reads only steps
    `0..k-1` and records nothing. Called directly, the object is step `len(recorded)`."""

    def __init__(self, backend: str = "eager"):
        self.fn = BACKENDS[backend]
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def at(self, step: int) -> StepAttention:
        return StepAttention(self, step)

    def attend(
        self, step: int, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        entries = self.kv.setdefault(layer_idx, [])
        if len(entries) == step:
            entries.append((k, v))
        elif len(entries) < step:
            raise RuntimeError(f"TTT step {step} attends before step {len(entries)} ran")
        if step == 0:
            return self.fn(q, k, v, [])
        k0, v0 = entries[0]
        return self.fn(q, k0, v0, entries[1:step] + [(k, v)])

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self.attend(len(self.kv.get(layer_idx, [])), layer_idx, q, k, v)


class StepAttention:
    """The attention of one TTT step (`TTTAttention.at`). Run eagerly under `torch.compile`
    (a graph break): it keeps Python state, and its flex kernel is compiled on its own."""

    def __init__(self, ttt: TTTAttention, step: int):
        self.ttt, self.step = ttt, step

    @torch.compiler.disable
    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self.ttt.attend(self.step, layer_idx, q, k, v)
