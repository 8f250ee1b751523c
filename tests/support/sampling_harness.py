"""A statistical harness for lossless speculative *sampling* over whole sequences.

Speculative sampling is exact only if every draft is a fresh sample from its step's q given
everything before it and the verifier's uniforms are independent of the draft noise. A bug
that correlates noise across draft steps or parallel slots leaves the first token of a round
exact and biases the second and later ones, so this harness tests the **joint distribution of
the first three emitted tokens** (and the marginals at positions 2 and 3) of many independent
seeded requests against the target's exact distribution.

- **Oracle** (`enumerate_oracle`): the target's next-token probabilities after temperature,
  top-k and top-p (`logits_to_probs`, the plain sampler's definition) for every context of up
  to two emitted tokens with non-zero probability, computed by transformers' own model (not
  the runner's native one) over a fixed prompt. The joint of three tokens is their product.
- **Runs**: the real engine (`SpecDecoder`), one seeded request per sample, all in one batch,
  each finished once it has its first three tokens (`speculative_samples`); plain sampling of the same target (`plain_samples`) checks the
  oracle itself.
- **Drafters** that make the test sharp (`HarnessDecoder`): the kind's own drafter with its
  logits replaced, where the exact target distribution of the draft's context is known, by a
  *close* drafter (`0.85 p + 0.15 q_own`: most drafts accepted, so positions 2 and 3 are
  reached through acceptance and rounds reject in the middle) or an *adversarial* one (mass on
  the target's least likely tokens and on its p = 0 tokens). Everything else (the proposer's
  chain or parallel slots, its KV caches, the keys of its draws) is the kind's own.
- **Statistics** (`goodness_of_fit`): Pearson chi-square against the oracle, cells with an
  expected count below `MIN_EXPECTED` pooled into one; a sequence the oracle gives
  probability 0 fails outright. p-values from the regularized upper incomplete gamma
  function (`torch.special.gammaincc`), so no scipy is needed.

**Power** (`power_to_detect`): a probability of 0.2 shifted by 3 points (0.20 -> 0.23, the
other cells rescaled to compensate) gives the Pearson statistic the non-centrality
`lambda = n * delta^2 * (1/p + 1/(1-p)) = n * 0.005625` whatever the other cells are; the
power is `P[chi2'(df, lambda) > chi2_crit(df, alpha)]`, the non-central chi-square as a
Poisson mixture of central ones (`ncx2_sf`). Each test computes it for its own `df` and `n`
and asserts it is at least 0.9 (`tests/test_lossless_sampling.py`).
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.sampling import SamplingParams, logits_to_probs, sampling_tensors
from draftinfer.decoding.verify import Verifier

ALPHA = 1e-4  # significance of every test (seeded: a correct sampler passes deterministically)
MIN_EXPECTED = 5.0  # cells expected to hold fewer samples are pooled into one
SHIFT, SHIFTED_P, POWER = 0.03, 0.2, 0.9  # the deviation each test must detect, and how surely
DEPTH = 3  # emitted tokens whose joint distribution is tested
JOINT_CELLS = 32  # cells of a test: the 31 most likely outcomes and the pooled rest

# The harness target: a vocabulary of a few dozen tokens, its lm_head scaled so a next-token
# distribution is spread (entropy ~2 nats of ln 32 = 3.5, top token ~0.3) but far from uniform.
HARNESS_TARGET = dict(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
LOGIT_SCALE = 18.0
HARNESS_PROMPT = [1, 7, 3, 12]


@functools.lru_cache(maxsize=1)
def harness_target_dir() -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**HARNESS_TARGET, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    path = Path(tempfile.mkdtemp(prefix="harness_target_"))
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


@functools.lru_cache(maxsize=2)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    t = sampling_tensors([params] * logits.shape[0])
    return logits_to_probs(logits, t["temperature"], t["top_k"], t["top_p"])


# ---- the oracle ---------------------------------------------------------------------------
@dataclass
class Oracle:
    """Exact next-token probabilities `[V]` (fp64) per context of emitted tokens."""

    vocab: int
    rows: dict[tuple[int, ...], torch.Tensor]

    def joint(self, depth: int = DEPTH) -> dict[tuple[int, ...], float]:
        """Probability of every `depth`-token sequence with non-zero probability."""
        out: dict[tuple[int, ...], float] = {(): 1.0}
        for _ in range(depth):
            nxt = {}
            for ctx, mass in out.items():
                p = self.rows[ctx]
                for x in torch.nonzero(p)[:, 0].tolist():
                    nxt[ctx + (x,)] = mass * float(p[x])
            out = nxt
        return out

    def marginal(self, position: int) -> dict[tuple[int], float]:
        """Distribution of the token at emitted position `position` (1-based)."""
        out: Counter = Counter()
        for seq, mass in self.joint(position).items():
            out[(seq[-1],)] += mass
        return dict(out)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense `P2 [V, V]` (row x1) and `P3 [V, V, V]` (row x1, x2), fp32; a context with no
        oracle row (probability 0) is all zeros. For small vocabularies only."""
        V = self.vocab
        p2, p3 = torch.zeros(V, V), torch.zeros(V, V, V)
        for ctx, p in self.rows.items():
            if len(ctx) == 1:
                p2[ctx[0]] = p.float()
            elif len(ctx) == 2:
                p3[ctx[0], ctx[1]] = p.float()
        return p2, p3


@torch.no_grad()
def enumerate_oracle(
    model_dir: str, prompt: list[int], params: SamplingParams, depth: int = DEPTH
) -> Oracle:
    """Probabilities of the target (transformers' model) for every context of up to
    `depth - 1` emitted tokens reachable with non-zero probability."""
    model = hf_model(model_dir)
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    frontier: list[tuple[int, ...]] = [()]
    for d in range(depth):
        for start in range(0, len(frontier), 2048):
            part = frontier[start : start + 2048]
            ids = torch.tensor([prompt + list(c) for c in part])
            probs = _probs(model(ids).logits[:, -1], params).double()
            rows.update(zip(part, probs))
        if d + 1 < depth:
            frontier = [c + (x,) for c in frontier for x in torch.nonzero(rows[c])[:, 0].tolist()]
    return Oracle(model.config.vocab_size, rows)


# ---- runs ---------------------------------------------------------------------------------
@torch.no_grad()
def plain_samples(
    model_dir: str, prompt: list[int], params: SamplingParams, n: int, seed: int, depth=DEPTH
) -> torch.Tensor:
    """`n` independent plain samples of `depth` tokens from the target alone. `[n, depth]`."""
    model = hf_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(prompt).expand(n, -1)
    for _ in range(depth):
        probs = _probs(model(ids).logits[:, -1], params)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return ids[:, len(prompt) :]


OWN, CLOSE, ADVERSARIAL = 0, 1, 2  # steering modes


class SteeredVerifier(Verifier):
    """The engine's verifier, whose draft chooser first replaces the drafter's logits, where
    the exact target distribution `p` of the draft's context is known (the draft would be
    emitted token 2 or 3), by a close or an adversarial drafter's, per request row."""

    def __init__(self, base: Verifier, oracles: list[Oracle]):
        super().__init__(base.mode, base.vocab)
        tables = [o.tables() for o in oracles]
        self.p2 = torch.stack([t[0] for t in tables])  # [S, V, V]
        self.p3 = torch.stack([t[1] for t in tables])  # [S, V, V, V]
        # Set before each round, per cache row: the first emitted tokens [B, 2] (-1: not yet),
        # how many tokens were emitted [B], the oracle [B] and the steering mode [B].
        self.context: tuple[torch.Tensor, ...] | None = None

    def draft_chooser(self, t, L):
        base = super().draft_chooser(t, L)
        hist, n_out, which, modes = self.context
        chosen: list[torch.Tensor] = []

        def choose(logits: torch.Tensor, step: int):
            e = n_out + step  # the draft would be emitted token e + 1 (0-based e)
            x1 = hist[:, 0]
            x2 = hist[:, 1] if step == 0 else torch.where(n_out >= 2, hist[:, 1], chosen[0])
            p = torch.zeros_like(logits, dtype=torch.float32)
            x1, x2 = x1.clamp(min=0), x2.clamp(min=0)
            p = torch.where((e == 1)[:, None], self.p2[which, x1], p)
            p = torch.where((e == 2)[:, None], self.p3[which, x1, x2], p)
            known = p.sum(-1) > 0
            own = torch.softmax(logits.float(), -1)
            close = torch.log(0.85 * p + 0.15 * own)
            adversarial = -torch.log(p + 0.02)  # mass on low-p and p = 0 tokens
            steered = torch.where((known & (modes == CLOSE))[:, None], close, logits.float())
            steered = torch.where((known & (modes == ADVERSARIAL))[:, None], adversarial, steered)
            choice, q = base(steered, step)
            chosen.append(choice)
            return choice, q

        return choose


class HarnessDecoder(SpecDecoder):
    """`SpecDecoder` unchanged but for two things around each round: a request is finished
    once it has its first DEPTH tokens (so a run takes at most DEPTH - 1 rounds), and with
    `steer` the verifier gets every row's first emitted tokens (the context of the drafts it
    steers) before the round."""

    def __init__(self, *args, oracles: list[Oracle] | None = None, steer=None, **kw):
        super().__init__(*args, **kw)
        if steer is not None:
            self.verifier = SteeredVerifier(self.verifier, oracles)
        self.steer = steer  # per request of the next `generate`: (oracle index, mode)

    def _launch(self, live, in_flight=frozenset()):
        if self.steer is not None:
            B = self.max_batch
            hist, n_out, which, modes = [[-1, -1] for _ in range(B)], [0] * B, [0] * B, [0] * B
            for s in live:
                first = s.out[:2]
                hist[s.row][: len(first)] = first
                n_out[s.row] = len(s.out)
                which[s.row], modes[s.row] = self.steer[s.idx]
            self.verifier.context = tuple(
                torch.tensor(x, device=self.device) for x in (hist, n_out, which, modes)
            )
        return super()._launch(live, in_flight)

    def _process(self, launched):
        running = super()._process(launched)
        for s in launched.slots:
            if s.finish is None and len(s.out) >= DEPTH:
                s.finish = "length"
        return running


@dataclass
class SpecRun:
    tokens: torch.Tensor  # [n, DEPTH] the first emitted tokens of every request
    accepted_first_round: torch.Tensor  # [n] drafts accepted in each request's first round
    proposed_first_round: torch.Tensor  # [n]


def speculative_samples(
    target,
    drafter,
    k: int,
    verify: str,
    requests_params: list[SamplingParams],
    prompt: list[int],
    *,
    oracles: list[Oracle] | None = None,
    steer: list[tuple[int, int]] | None = None,
    max_batch: int | None = None,
    **engine,
) -> SpecRun:
    """One seeded request per entry of `requests_params` (seeds included), run through the
    engine with K = `k` (each request asks for K + 2 tokens so its first round drafts K);
    `steer` (per request: the index of its oracle in `oracles`, and OWN / CLOSE /
    ADVERSARIAL) steers the drafts; `engine`: more `SpecDecoder` options (`verify_threshold`)."""
    n = len(requests_params)
    max_batch = max_batch or n
    kw = dict(max_batch=max_batch, max_model_len=len(prompt) + k + 4, verify=verify, **engine)
    dec = HarnessDecoder(target, drafter, k, oracles=oracles, steer=steer, **kw)
    reqs = [Request(list(prompt), p, max_tokens=k + 2) for p in requests_params]
    outs, _ = dec.generate(reqs)
    return SpecRun(
        torch.tensor([o.token_ids[:DEPTH] for o in outs]),
        torch.tensor([o.accepted[0] for o in outs]),
        torch.tensor([o.proposed[0] for o in outs]),
    )


# ---- statistics ---------------------------------------------------------------------------
@dataclass
class Fit:
    statistic: float
    df: int
    pvalue: float
    n: int
    impossible: int  # samples the oracle gives probability 0

    @property
    def power(self) -> float:
        return power_to_detect(self.n, self.df)

    def __str__(self) -> str:
        return (
            f"chi2={self.statistic:.1f} df={self.df} p={self.pvalue:.3g} n={self.n} "
            f"power={self.power:.3f} impossible={self.impossible}"
        )


def chi2_sf(x: float, df: int) -> float:
    """P[chi2(df) > x]."""
    a, z = torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, z))


def chi2_isf(alpha: float, df: int) -> float:
    """The critical value c with P[chi2(df) > c] = alpha (bisection)."""
    lo, hi = 0.0, float(df) + 20 * math.sqrt(2 * df) + 100
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


def ncx2_sf(x: float, df: int, lam: float) -> float:
    """P[chi2'(df, lam) > x]: a Poisson(lam / 2) mixture of central chi2(df + 2j)."""
    total, j_max = 0.0, int(lam / 2 + 12 * math.sqrt(lam / 2 + 1) + 20)
    for j in range(j_max + 1):
        w = math.exp(-lam / 2 + j * math.log(lam / 2) - math.lgamma(j + 1)) if lam > 0 else j == 0
        total += w * chi2_sf(x, df + 2 * j)
    return total


def power_to_detect(n: int, df: int, alpha=ALPHA, shift=SHIFT, p=SHIFTED_P) -> float:
    """Power of the chi-square test (df, alpha) with n samples against a probability p
    shifted by `shift`, the other cells rescaled: non-centrality n shift^2 (1/p + 1/(1-p))."""
    lam = n * shift**2 * (1 / p + 1 / (1 - p))
    return ncx2_sf(chi2_isf(alpha, df), df, lam)


def goodness_of_fit(
    samples: torch.Tensor, expected: dict[tuple[int, ...], float], max_cells: int | None = None
) -> Fit:
    """Pearson chi-square of sample rows `[n, d]` against cell probabilities `expected`
    (keys: d-tuples). Kept cells: those expected to hold at least MIN_EXPECTED samples, at
    most the `max_cells - 1` most likely; the rest are pooled into one cell (merged into the
    smallest kept cell if the pool itself is expected below MIN_EXPECTED)."""
    n = samples.shape[0]
    observed = Counter(map(tuple, samples.tolist()))
    impossible = sum(c for cell, c in observed.items() if expected.get(cell, 0.0) == 0.0)
    big = sorted((c for c, p in expected.items() if p * n >= MIN_EXPECTED), key=expected.get)
    if max_cells is not None:
        big = big[-(max_cells - 1) :]
    obs = [observed.get(c, 0) for c in big]
    exp = [expected[c] * n for c in big]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp >= MIN_EXPECTED:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif big:  # fold a too-small pool into the smallest kept cell
        obs[0] += rest_obs
        exp[0] += rest_exp
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    pvalue = chi2_sf(stat, df) if df > 0 else 1.0
    return Fit(stat, df, 0.0 if impossible else pvalue, n, impossible)


def fits(samples: torch.Tensor, oracle: Oracle) -> dict[str, Fit]:
    """The joint of the first DEPTH tokens, on the `JOINT_CELLS - 1` most likely sequences and
    the pooled rest (`joint`, the test whose power is stated) and on every sequence expected
    MIN_EXPECTED times (`joint_all`: more cells, less power per cell, sees diffuse changes),
    and the marginals at positions 1..DEPTH (at most JOINT_CELLS cells each)."""
    joint = oracle.joint()
    out = {
        "joint": goodness_of_fit(samples, joint, JOINT_CELLS),
        "joint_all": goodness_of_fit(samples, joint),
    }
    for pos in range(1, DEPTH + 1):
        marginal = oracle.marginal(pos)
        out[f"pos{pos}"] = goodness_of_fit(samples[:, pos - 1 : pos], marginal, JOINT_CELLS)
    return out
