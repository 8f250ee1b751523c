"""Sampling: per-request parameters, logits -> probabilities, and seeded randomness.

Three pieces, used by verification (`draftkernels.rejection_sampler`) and the decode loop:

1. `SamplingParams`: temperature (0 = greedy), top-k, top-p, seed.
2. `logits_to_probs`: temperature, then top-k, then top-p (the Hugging Face / vLLM order),
   then softmax, per row, in fp32. Greedy rows (temperature 0) become one-hot at
   `argmax(logits)` (lowest id on ties), so every consumer that takes an argmax of the probs
   (greedy verification, `sample_from_probs`) returns exactly the plain-greedy token.
3. Randomness keyed by `(request seed, position, stream)` (DESIGN 3.12). Every random number is
   a pure function of that key, computed by a counter-based hash (splitmix64) with integer
   tensor ops: a request draws the same numbers whatever else is in the batch and in whatever
   order, on CPU and GPU alike, with no `torch.Generator` state, no host sync and nothing that
   stops the round from being captured in a CUDA graph.

Sampling by the exponential race. With `E_v ~ Exp(1)` i.i.d., `argmax_v p(v) / E_v` is a sample
of `p / sum(p)`: `E_v / p(v) ~ Exp(p(v))`, and the smallest of independent exponentials is the
one of rate `p(v)` with probability `p(v) / sum(p)`. This is the Gumbel-max trick written with
`-log U` instead of `-log(-log U)`, and it is how the rejection sampler draws recovered tokens;
the same noise layout serves bonus tokens and plain sampling (`sample_from_probs`).

Keys. Every random draw of the runner is a pure function of `(request seed, position,
stream, counter)`, and one class says which key each draw reads: `RoundKeys` (below). For a
round that starts with `L` committed tokens (its first draft sits at position `L`):

| draw                                   | position       | stream            |
|----------------------------------------|----------------|-------------------|
| first token after prefill (P tokens)   | `P`            | `STREAM_SAMPLE`   |
| draft of step / parallel slot `s`      | `L + s`        | `STREAM_DRAFT`    |
| acceptance uniform of draft `j`        | `L + j`        | `STREAM_ACCEPT`   |
| recovered token (first rejection)      | `L`            | `STREAM_RECOVERY` |
| bonus token (all `n` drafts accepted)  | `L + n`        | `STREAM_SAMPLE`   |

(the counter is the token id for exponential noise, 0 for uniforms). Why these are
independent where exactness needs it: draws of different purposes never share a stream, and
within a stream two draws share a key only if they decide the same position in different
rounds. A round never revisits a position an earlier round *emitted*: the next round starts at
`L + a + 1`, past every emitted token, so the uniforms, recovered and bonus noise it reads
were never read by an emitted decision. It does redraw drafts at positions the last round
drafted but did not emit (after the first rejection): those drafts (and their uniforms)
decided nothing that was emitted, so their noise is still fresh given everything emitted.
Within a round, each draft step and each parallel slot reads its own position, so drafts are
independent given their q. `tests/infer/test_lossless_sampling.py` tests the joint distribution of
several emitted tokens against the target's, for every kind.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

# Stream ids: one per purpose, so draws at the same (seed, position) are independent.
STREAM_ACCEPT = 1  # uniforms of the p/q acceptance test
STREAM_RECOVERY = 2  # exponential noise for the recovered token of a round
STREAM_SAMPLE = 3  # exponential noise for bonus tokens and plain sampling
STREAM_DRAFT = 4  # exponential noise for a random drafter's own samples


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling fields. temperature 0 = greedy; top_k 0/-1 and top_p 1.0 = off.

    `seed=None` means "unseeded": the engine draws one with `resolve_seed` when the request
    is admitted, so every request is seeded inside the engine (DESIGN 3.12).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit in int64, got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def resolve_seed(seed: int | None) -> int:
    """The request's seed, or a fresh non-negative 63-bit one for an unseeded request."""
    return seed if seed is not None else random.SystemRandom().getrandbits(63)


def sampling_tensors(
    params: Sequence[SamplingParams], device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Per-row tensors for `logits_to_probs` and verification, from R requests' params.

    Returns `temperature [R] fp32`, `top_k [R] int64`, `top_p [R] fp32`, `is_greedy [R] bool`.
    """
    rows = {
        "temperature": ([p.temperature for p in params], torch.float32),
        "top_k": ([p.top_k for p in params], torch.int64),
        "top_p": ([p.top_p for p in params], torch.float32),
        "is_greedy": ([p.is_greedy for p in params], torch.bool),
    }
    return {name: torch.tensor(v, dtype=dt, device=device) for name, (v, dt) in rows.items()}


def apply_top_k_top_p(
    logits: torch.Tensor,  # [R, V] fp32, already divided by the temperature
    top_k: torch.Tensor,  # [R] int, <= 0 or >= V: off
    top_p: torch.Tensor,  # [R] fp32 in (0, 1], 1.0: off
) -> torch.Tensor:
    """Logits with the tokens outside top-k, then outside top-p, set to -inf. [R, V] fp32.

    top-k keeps every token whose logit is >= the k-th largest (ties at the k-th value are
    kept, as in Hugging Face and vLLM). top-p then keeps, in descending order of the top-k
    renormalized probabilities, each token whose *preceding* mass is < top_p: the smallest
    prefix whose mass reaches top_p, and always at least the most likely token.
    """
    r, v = logits.shape
    if logits.device.type == "cpu" and not bool((top_p < 1.0).any()):
        return _top_k_only(logits, top_k)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [R, V]
    k = top_k.to(torch.int64)
    k_on = (k > 0) & (k < v)
    kth = sorted_logits.gather(1, (k.clamp(1, v) - 1)[:, None])  # [R, 1] k-th largest logit
    keep_k = ~k_on[:, None] | (sorted_logits >= kth)  # [R, V] in sorted order
    sorted_logits = sorted_logits.masked_fill(~keep_k, float("-inf"))

    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # exclusive cumsum
    p_on = top_p < 1.0
    keep_p = ~p_on[:, None] | (mass_before < top_p[:, None])
    keep_p[:, 0] = True  # the most likely token always survives
    keep_sorted = keep_k & keep_p
    keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)  # back to vocab order
    return logits.masked_fill(~keep, float("-inf"))


def _top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """`apply_top_k_top_p` when no row has top-p on, without sorting the vocabulary: the k-th
    largest logit from `torch.topk` (the value the sort gives), ties kept the same way. It
    reads the largest k on the host, so it runs only where a sync costs nothing (CPU); a
    captured CUDA round takes the sorting path."""
    v = logits.shape[-1]
    k = top_k.to(torch.int64)
    k_on = (k > 0) & (k < v)
    if not bool(k_on.any()):
        return logits
    k_max = int(k[k_on].max())
    top = torch.topk(logits, k_max, dim=-1).values  # [R, k_max], descending
    kth = top.gather(1, (k.clamp(1, k_max) - 1)[:, None])  # [R, 1]
    keep = ~k_on[:, None] | (logits >= kth)
    return logits.masked_fill(~keep, float("-inf"))


# A last axis this long is reduced in two passes (`argmax_ids`); shorter ones in one.
ARGMAX_TWO_PASS = 8192


@functools.cache
def _argmax_chunk(V: int) -> int | None:
    """The chunk length of `argmax_ids`' first pass over `V` ids: the divisor of `V` giving
    the chunk count closest to 256 among 64..2048 chunks (None: one pass)."""
    if V < ARGMAX_TWO_PASS:
        return None
    best = None
    for n in range(64, 2049):
        if V % n == 0 and (best is None or abs(n - 256) < abs(best - 256)):
            best = n
    return None if best is None else V // best


def argmax_ids(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` (the lowest index on ties; NaN counts as the largest), in two passes
    over a vocabulary-long last axis: the argmax within each chunk, then the first chunk
    holding the largest of their maxima. The same result; one pass over `[B, V]` is a
    reduction of one thread block per row on CUDA (37 us at V = 128256, one row, on an H100),
    two passes take many blocks. Shape `[..., V]` -> `[...]` int64."""
    V = x.shape[-1]
    # Traced, the plain function: dynamo would trace through the cache wrapper anyway (and warn).
    c = _argmax_chunk.__wrapped__(V) if torch.compiler.is_compiling() else _argmax_chunk(V)
    if c is None:
        return x.argmax(-1)
    chunks = x.unflatten(-1, (V // c, c))  # [..., n, c]
    inner = chunks.argmax(-1)  # [..., n]
    best = chunks.gather(-1, inner.unsqueeze(-1)).squeeze(-1)  # [..., n]
    j = best.argmax(-1, keepdim=True)  # [..., 1] the first chunk with the maximum
    return (j * c + inner.gather(-1, j)).squeeze(-1)


def logits_to_probs(
    logits: torch.Tensor,  # [R, V] any float dtype
    temperature: torch.Tensor,  # [R] fp32, 0: greedy
    top_k: torch.Tensor,  # [R] int, <= 0: off
    top_p: torch.Tensor,  # [R] fp32, 1.0: off
) -> torch.Tensor:
    """Target (or drafter) probabilities after temperature, top-k and top-p. [R, V] fp32.

    Greedy rows (temperature 0) are one-hot at `argmax(logits)` (lowest id on ties); their
    top-k / top-p are ignored.
    """
    logits = logits.float()
    temperature = temperature.to(device=logits.device, dtype=torch.float32)
    greedy = temperature == 0.0
    # Greedy rows divide by 1 so they stay finite; their probs are replaced below.
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    masked = apply_top_k_top_p(
        scaled, top_k.to(logits.device), top_p.to(device=logits.device, dtype=torch.float32)
    )
    probs = torch.softmax(masked, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(1, argmax_ids(logits)[:, None], 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample_from_probs(
    probs: torch.Tensor,  # [R, V] fp32
    noise: torch.Tensor,  # [R, V] fp32, i.i.d. Exp(1) (e.g. from `exponential_noise`)
) -> torch.Tensor:
    """One token per row, distributed as `probs` (exponential race, module docstring). [R] int64.

    Zero-probability tokens score -1 and never win; one-hot rows return their hot token.
    """
    score = torch.where(probs > 0.0, probs / noise, -1.0)
    return argmax_ids(score)


# ---------------------------------------------------------------------------------------------
# Counter-based randomness: splitmix64 on int64 tensors.
#
# torch int64 arithmetic wraps modulo 2**64 (two's complement), which is exactly the uint64
# arithmetic splitmix64 needs, except that `>>` is arithmetic on negative values: `_shr`
# masks the sign-extended bits off to make it a logical shift.
# ---------------------------------------------------------------------------------------------


def _as_int64(x: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_2 = _as_int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def _xor_shr_(x: torch.Tensor, s: int) -> torch.Tensor:
    """x ^= x >>> s (logical shift), in place: one temporary instead of three (the [B, V]
    noise is memory-bound)."""
    t = x >> s
    t &= (1 << (64 - s)) - 1
    return x.bitwise_xor_(t)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 (Steele, Lea, Flood 2014): a bijective 64-bit mixer with full avalanche."""
    x = x + _GOLDEN  # a new tensor: the caller's is never written
    _xor_shr_(x, 30).mul_(_MIX_1)
    _xor_shr_(x, 27).mul_(_MIX_2)
    return _xor_shr_(x, 31)


def random_bits(
    seeds: torch.Tensor,  # [...] int64
    positions: torch.Tensor,  # broadcastable to seeds, int64
    stream: int,
    counters: torch.Tensor | int = 0,  # broadcastable, int64: index within one (seed, pos)
) -> torch.Tensor:
    """64 pseudo-random bits per key `(seed, stream, position, counter)`, as int64."""
    h = _splitmix64(seeds.to(torch.int64))
    h = _splitmix64(h ^ stream)
    h = _splitmix64(h ^ positions.to(torch.int64))
    return _splitmix64(h ^ counters)


def _as_tensor(x, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.int64)
    return torch.as_tensor(x, dtype=torch.int64, device=device)


def uniforms_for(
    seeds: torch.Tensor,  # [B] int64, one seed per request
    positions: torch.Tensor,  # [B] int64, position of each request's first draft token
    cu_num_draft: torch.Tensor,  # [B + 1] int, request b owns draft rows cu[b]:cu[b+1]
    num_draft_tokens: int,  # N >= cu[-1] (passed so no host sync is needed)
    stream: int = STREAM_ACCEPT,
) -> torch.Tensor:
    """Uniforms in (0, 1] for the acceptance test of every draft row. [N] fp32.

    Row `cu[b] + j` is keyed by `(seeds[b], positions[b] + j)`: the draft's own position, so
    the value does not depend on the batch or on how many drafts the round has. `N` may exceed
    `cu[-1]` (a static-shape buffer); rows past it hold values nobody reads.
    """
    device = cu_num_draft.device
    seeds, positions = _as_tensor(seeds, device), _as_tensor(positions, device)
    cu = cu_num_draft.to(torch.int64)
    rows = torch.arange(num_draft_tokens, device=device)
    req = torch.searchsorted(cu[1:], rows, right=True).clamp(max=cu.numel() - 2)  # [N]
    row_pos = positions[req] + (rows - cu[req])
    bits = random_bits(seeds[req], row_pos, stream)
    # Top 24 bits + 1 over 2**24: exactly representable fp32 in (0, 1], never 0, so a draft
    # with p(d) = 0 < q(d) always fails `u * q(d) <= p(d)`.
    return (_shr(bits, 40) + 1).to(torch.float32) * 2.0**-24


def exponential_noise(
    seeds: torch.Tensor | int,  # [B] int64 or one int
    positions: torch.Tensor | int,  # [B] int64 or one int
    vocab_size: int,
    device: torch.device | str | None = None,
    *,
    stream: int = STREAM_SAMPLE,
) -> torch.Tensor:
    """I.i.d. Exp(1) noise keyed by `(seed, position, stream, token id)`. [B, V] fp32 ([V] for ints).

    Each row depends only on its own `(seed, position)`, never on the rest of the batch.
    """
    scalar = not isinstance(seeds, torch.Tensor) and not isinstance(positions, torch.Tensor)
    if device is None:
        device = seeds.device if isinstance(seeds, torch.Tensor) else "cpu"
    seeds = _as_tensor(seeds, device).reshape(-1, 1)  # [B, 1]
    positions = _as_tensor(positions, device).reshape(-1, 1)  # [B, 1]
    token_ids = torch.arange(vocab_size, device=device)[None, :]  # [1, V]
    bits = random_bits(seeds, positions, stream, token_ids)  # [B, V]
    # 53 bits -> U in (0, 1] in fp64, E = -log U; fp64 keeps the tail (E up to ~36.7).
    bits = _shr(bits, 11).add_(1)
    u = bits.to(torch.float64).mul_(2.0**-53)
    noise = u.log_().neg_().to(torch.float32)
    return noise[0] if scalar else noise


class RoundKeys:
    """The keys `(position, stream)` of every random draw of one round (module docstring's
    table): the one place that decides them. `L [B]`: committed tokens per request."""

    def __init__(self, L: torch.Tensor):
        self.L = L

    @staticmethod
    def sample(position: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A token sampled from the target alone (the first after prefill) at `position`."""
        return position, STREAM_SAMPLE

    def draft(self, step: int) -> tuple[torch.Tensor, int]:
        """The draft of chain step (or parallel slot) `step`."""
        return self.L + step, STREAM_DRAFT

    def accept(self) -> tuple[torch.Tensor, int]:
        """The first draft's uniform; draft `j` reads position `L + j` (`uniforms_for`)."""
        return self.L, STREAM_ACCEPT

    def recovered(self) -> tuple[torch.Tensor, int]:
        return self.L, STREAM_RECOVERY

    def bonus(self, num_drafts: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.L + num_drafts, STREAM_SAMPLE


def with_seed(params: SamplingParams) -> SamplingParams:
    """The request's params with its seed fixed (a fresh one when unseeded)."""
    return replace(params, seed=resolve_seed(params.seed))


class SamplingState:
    """Per-row sampling tensors on the device (`temperature`, `top_k`, `top_p`, `is_greedy`,
    `seed`, each `[R]`), written when a request is admitted to a row, so a round reads them
    without building tensors from Python lists (no host-to-device copy inside the round).
    `greedy` mirrors `is_greedy` on the host (the all-greedy fast path is a host decision)."""

    def __init__(self, rows: int, device: torch.device | str):
        self.device = torch.device(device)
        self.tensors = sampling_tensors([SamplingParams(0.0, seed=0)] * rows, self.device)
        self.tensors["seed"] = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.greedy = [True] * rows

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str) -> SamplingState:
        state = cls(len(params), device)
        state.set_rows(range(len(params)), params)
        return state

    def set_rows(self, rows: Sequence[int], params: Sequence[SamplingParams]) -> None:
        """Rows `rows` now sample with `params` (seeds resolved beforehand), in one copy each."""
        if any(p.seed is None for p in params):
            raise ValueError("unresolved seed: admit requests through with_seed()")
        new = sampling_tensors(params, self.device)
        new["seed"] = torch.tensor([p.seed for p in params], dtype=torch.long, device=self.device)
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        for name, t in new.items():
            self.tensors[name][index] = t
        for row, p in zip(rows, params):
            self.greedy[row] = p.is_greedy
