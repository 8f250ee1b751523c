"""A proposer-level harness for the MTP serving contract (REFERENCES C, vLLM MRv2): one known
token sequence, rounds whose drafts are forced to be accepted or rejected, the commit an engine
would make, and the fresh-prefill reference the drafter state must equal after every round.

Row i of the sequence consumes `(t_{i+1}, f_i)` at `pos_i` (convention 1); after a round over
rows `a..b-1`, the committed rows are `0..b-1`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftinfer.decoding.proposer import FirstPass
from draftinfer.registry import drafter_spec


def mrope_positions(T: int) -> torch.Tensor:
    """`[3, T]` positions whose three axes differ (an image grid in the middle)."""
    t = torch.arange(T)
    grid = (t >= 3) & (t < 9)
    h = torch.where(grid, 3 + (t - 3) // 3, t)
    w = torch.where(grid, 3 + (t - 3) % 3, t)
    return torch.stack([torch.where(grid, 3, t), h, w])


@dataclass
class MTPSequence:
    drafter: torch.nn.Module
    M: int = 40  # rows; tokens t_0..t_M
    seed: int = 0
    rope: str = "1d"
    # Per module call of a recording proposer: (module, ids, h_in, rope, cache_pos, carry).
    calls: list = field(default_factory=list)

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        d = self.drafter
        self.V = d.embed_tokens.weight.shape[0]
        self.N = d.config.n_predict
        self.tok = torch.randint(1, self.V, (self.M + 1,), generator=g)
        self.feat = torch.randn(self.M, d.config.hidden_size, generator=g)
        self.pos = mrope_positions(self.M) if self.rope == "mrope" else torch.arange(self.M)

    def proposer(self, record: bool = False):
        prop = drafter_spec("mtp").proposer_class(
            self.drafter, 2, 64, torch.device("cpu"), torch.float32
        )
        if record:
            fwd = prop._fwd

            def spy(drafter, k, v, j, ids, h_in, rope, rows, cache_pos, attn_len, mm=None):
                normed, pre = fwd(drafter, k, v, j, ids, h_in, rope, rows, cache_pos, attn_len, mm)
                carry = drafter.carry(normed, pre)
                self.calls.append((j, ids.clone(), h_in.clone(), rope.clone(), cache_pos, carry))
                return normed, pre

            prop._fwd = spy
        return prop

    def rows(self, a: int, b: int, idle: bool = False) -> FirstPass:
        """Rows a..b-1 as one request's first pass (cache row 0); `idle`: and cache row 1 with
        no request (every slot padding), as an engine's batch carries a free row."""
        fp = FirstPass(
            torch.tensor([0]),
            self.tok[a + 1 : b + 1][None],
            self.feat[a:b][None],
            torch.arange(a, b)[None],
            self.pos[..., a:b].unsqueeze(-2),
        )
        if not idle:
            return fp

        def pad(x: torch.Tensor, dim: int, fill: int = 0) -> torch.Tensor:
            return torch.cat([x, torch.full_like(x, fill)], dim)

        return FirstPass(
            torch.tensor([0, 1]),
            pad(fp.ids, 0),
            pad(fp.features, 0),
            pad(fp.cache_pos, 0, -1),
            pad(fp.rope_pos, -2),
        )

    def forced(self, b: int, accept: int):
        """A chooser for a round whose last row is b-1: draft s is the true `t_{b+1+s}` for
        s < accept, a wrong token after."""

        def choose(logits: torch.Tensor, step: int):
            true = int(self.tok[b + 1 + step])
            pick = true if step < accept else (true + 1) % self.V
            return torch.full((logits.shape[0],), pick, dtype=torch.long), None

        return choose

    def round(self, prop, a: int, b: int, k: int, accept: int) -> int:
        """Propose over rows a..b-1 with k drafts of which the first `accept` are right; the
        engine then commits accept + 1 tokens. Returns the next round's end row."""
        prop.propose(self.rows(a, b), torch.tensor([k]), k, self.forced(b, min(accept, k)))
        return b + min(accept, k) + 1

    def fresh_kv(self, n: int) -> list[torch.Tensor]:
        """Every module's KV at the committed rows 0..n-1 from a fresh proposer: a prefill
        of the committed prefix with target features and no history."""
        fresh = self.proposer()
        fresh.propose(fresh.admit(self.rows(0, n)), torch.tensor([0]), self.N)
        return fresh.kv_snapshot(0, n)


def assert_kv_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for j, (x, y) in enumerate(zip(got, want)):
        assert x.shape == y.shape, (what, j, x.shape, y.shape)
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=f"{what}: tensor {j}")


def hist_rows_run(calls: list, N: int) -> int:
    """How many of the window's N-1 history rows the last round's module-0 call ran (the
    re-prefilled rows; the rest are padding)."""
    cache_pos = [c for c in calls if c[0] == 0][-1][4]
    return int((cache_pos[0, : N - 1] >= 0).sum())


def assert_compiled_round_equals_eager(drafter, N: int, seed: int = 3) -> None:
    """A drafter of N modules' round compiled as the engine compiles it (dynamic shapes,
    fullgraph: no graph break, traced by dynamo with `aot_eager`): rounds with all, none and
    some drafts accepted, a draft cap, module reuse (K = 2N) and an idle row give the same
    draft logits, drafts and module caches as the eager proposer."""
    seq = MTPSequence(drafter, M=40, seed=seed)
    runs = []
    plan = [(N, N, N), (N, N, 0), (N, 1, 1), (2 * N, 2 * N, 3), (N, N, 1)]
    torch._dynamo.reset()
    for compile_it in (False, True):
        prop = seq.proposer()
        if compile_it:
            prop.compile(backend="aot_eager", dynamic=True, fullgraph=True)
        seen, drafts = [], []
        P, split, L = 9, 4, prop.max_seq_len
        prop.admit(seq.rows(0, split, idle=True), L)
        prop.propose(seq.rows(split - 1, P, idle=True), torch.tensor([0, 0]), N, attn_len=L)
        a, b = P, P + 1
        for k, cap, accept in plan:
            forced = seq.forced(b, accept)

            def choose(logits, step, forced=forced, seen=seen):
                seen.append(logits.clone())
                return forced(logits, step)

            fp = seq.rows(a, b, idle=True)
            drafts.append(prop.propose(fp, torch.tensor([cap, 0]), k, choose, L)[0])
            a, b = b, b + accept + 1
        runs.append((seen, drafts, prop.kv_snapshot(0, b)))
    (seen, drafts, kv), (seen_c, drafts_c, kv_c) = runs
    assert len(seen) == len(seen_c) == sum(k for k, _, _ in plan)
    for eager, traced in zip(seen, seen_c):
        torch.testing.assert_close(traced, eager, atol=1e-5, rtol=0)
    assert [x.tolist() for x in drafts] == [x.tolist() for x in drafts_c]
    for x, y in zip(kv, kv_c):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=0)
