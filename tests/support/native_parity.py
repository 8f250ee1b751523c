"""Parity of a native target with transformers' own model through the runner's cache paths:
the helpers the dense (`tests/infer/test_native_target.py`) and the MoE family tests
(`tests/families/test_{gpt_oss,qwen3_moe}_native.py`) share.

`speculative_rounds` drives one scenario over a padded batch and compares every live slot with
HF (eager attention, fp32, no cache: each sequence from scratch, so nothing of the runner's
cache design is assumed by the oracle):

1. a prefill of three prompts of different lengths in one padded forward (right and left
   padding), in permuted cache rows;
2. two one-token decode steps (one row a padding slot in the first);
3. verify passes of `K + 1` slots `[bonus, d_1..d_K]` where each row accepts a different
   number of drafts (0, some, all); the next pass starts at the accepted length, re-writing the
   cache rows the rejected drafts wrote (nothing is cleared: DESIGN 2, `kv_cache`).

Logits are compared at every live slot, and so are the features (`FeatureSpec` taps = HF
`output_hidden_states[j]`, the post-norm final hidden = HF's last entry).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftinfer.conventions.slots import Slots
from draftinfer.models.target import FeatureSpec


def rand_ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def load_hf(path: str | Path):
    """transformers' model of a checkpoint directory: fp32, eager attention, eval, no grads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval().requires_grad_(False)


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    """`load_hf`, cached per path (tests that reuse one checkpoint)."""
    return load_hf(path)


def run(model, ids, positions, rows, aux_layer_ids=None, final_hidden=None, attn_len=None):
    """(logits, features) of one native forward: slots at cache indices `positions` (RoPE =
    cache index), features = the inputs of `aux_layer_ids` then the final hidden state."""
    t = functools.partial(torch.tensor, dtype=torch.long)
    feats = None
    if aux_layer_ids is not None or final_hidden is not None:
        feats = FeatureSpec(tuple(aux_layer_ids or ()), final_hidden)
    out = model(t(ids), Slots(t(rows), t(positions), attn_len=attn_len), feats)
    return out.logits, out.features


@dataclass
class Diffs:
    """Max abs differences found, over every compared slot."""

    logits: float = 0.0
    features: float = 0.0
    feature_scale: float = 0.0  # max abs of HF's features (the residual stream grows)
    slots: int = 0  # live slots compared
    steps: list[str] = field(default_factory=list)

    def add(self, step: str, logits: float, features: float, scale: float, slots: int) -> None:
        self.logits = max(self.logits, logits)
        self.features = max(self.features, features)
        self.feature_scale = max(self.feature_scale, scale)
        self.slots += slots
        self.steps.append(f"{step}: logits {logits:.2e}, features {features:.2e}")

    def check(self, logits_atol: float = 1e-4, features_rtol: float = 2e-5) -> None:
        """Logits within `logits_atol`; features within `features_rtol` of their scale (fp32:
        the same sums in other orders, over a residual stream of growing magnitude)."""
        where = "; ".join(self.steps)
        assert self.logits <= logits_atol, f"logits differ by {self.logits:.2e} ({where})"
        bound = features_rtol * max(1.0, self.feature_scale)
        assert self.features <= bound, f"features differ by {self.features:.2e} ({where})"


def _hf_outputs(hf, seq: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    out = hf(torch.tensor([seq]), output_hidden_states=True)
    return out.logits[0].float(), tuple(h[0].float() for h in out.hidden_states)


def speculative_rounds(
    model,
    hf,
    lengths: tuple[int, int, int],
    taps: tuple[int, ...],
    *,
    k: int = 3,
    accepts: tuple[tuple[int, int, int], ...] = ((0, 3, 1), (2, 0, 3)),
    seed: int = 0,
    attn_len: int | None = None,
) -> Diffs:
    """The scenario of the module docstring on `model` (3 cache rows at least, room for
    `max(lengths) + 2 + (k + 1) * (len(accepts) + 1)` positions) against `hf`; returns the
    max differences (asserts nothing)."""
    vocab = model.config.vocab_size
    L = model.config.num_layers
    H = model.config.hidden_size
    rows = [2, 0, 1]
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    diffs = Diffs()
    feats_spec = FeatureSpec(tuple(taps), "post_norm")

    def compare(step, ids, cache_pos, seqs):
        """One native forward of `ids [B, T]` at `cache_pos [B, T]` against HF over each row's
        sequence `seqs[b]` (whose position p holds the token of the slot at cache index p)."""
        out = model(
            torch.tensor(ids),
            Slots(torch.tensor(rows), torch.tensor(cache_pos), attn_len=attn_len),
            feats_spec,
        )
        dl = df = scale = 0.0
        n = 0
        for b, seq in enumerate(seqs):
            live = [t for t, p in enumerate(cache_pos[b]) if p >= 0]
            if not live:
                continue
            pos = [cache_pos[b][t] for t in live]
            ref_logits, hidden = _hf_outputs(hf, seq[: max(pos) + 1])
            dl = max(dl, (out.logits[b, live] - ref_logits[pos]).abs().max().item())
            want = torch.cat([hidden[j][pos] for j in taps] + [hidden[L][pos]], dim=-1)
            assert out.features.shape[-1] == (len(taps) + 1) * H
            df = max(df, (out.features[b, live] - want).abs().max().item())
            scale = max(scale, want.abs().max().item())
            n += len(live)
        diffs.add(step, dl, df, scale, n)

    # 1. Prefill: row 0 unpadded, row 1 right-padded, row 2 left-padded.
    seqs = [tokens(n) for n in lengths]
    P = max(lengths)
    ids, pos = [], []
    for b, s in enumerate(seqs):
        pad = P - len(s)
        if b == 2:
            ids.append([0] * pad + s)
            pos.append([-1] * pad + list(range(len(s))))
        else:
            ids.append(s + [0] * pad)
            pos.append(list(range(len(s))) + [-1] * pad)
    compare("prefill", ids, pos, seqs)

    # 2. Two decode steps; row 1 is a padding slot in the first.
    for step in range(2):
        ids, pos = [], []
        for b, s in enumerate(seqs):
            if step == 0 and b == 1:
                ids.append([0])
                pos.append([-1])
                continue
            s.append(tokens(1)[0])
            ids.append([s[-1]])
            pos.append([len(s) - 1])
        compare(f"decode {step}", ids, pos, seqs)

    # 3. Verify passes of [bonus, d_1..d_k]; row b accepts accepts[r][b] drafts, so the next
    # pass starts at its committed length + 1 (the recovered token replaces d_{a+1}).
    committed = [list(s) for s in seqs]
    bonus = [tokens(1)[0] for _ in seqs]
    for r, accepted in enumerate((*accepts, None)):
        slots = [[bonus[b], *tokens(k)] for b in range(len(seqs))]
        ids = slots
        pos = [list(range(len(c), len(c) + k + 1)) for c in committed]
        compare(f"verify {r}", ids, pos, [c + s for c, s in zip(committed, slots)])
        if accepted is None:
            break
        for b, a in enumerate(accepted):
            committed[b] += slots[b][: a + 1]  # bonus + the accepted drafts
            recovered = tokens(1)[0]
            if a < k and recovered == slots[b][a + 1]:  # a rejection: another token
                recovered = 3 + (recovered - 2) % (vocab - 3)
            bonus[b] = recovered
    return diffs


def assert_forward_traces_as_one_graph(model) -> None:
    """With a fixed `attn_len` (the compiled round's call) the model's whole forward traces as
    one graph (`fullgraph=True`, the eager backend: tracing only): no host sync, no
    data-dependent shape; and the traced forward equals the eager one on a prefill (with a
    padding slot) and a decode step. `model` has at least 2 cache rows of 32 positions."""
    import torch

    from draftinfer.conventions.slots import Slots

    torch._dynamo.reset()

    def step(ids, rows, pos):
        return model(ids, Slots(rows, pos, attn_len=32)).logits

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    rows = torch.tensor([0, 1])
    for ids, pos in (
        (
            torch.tensor([rand_ids(4, 5), rand_ids(4, 6)]),
            torch.tensor([[0, 1, 2, 3], [0, 1, -1, -1]]),
        ),
        (torch.tensor([rand_ids(1, 7), rand_ids(1, 8)]), torch.tensor([[4], [2]])),
    ):
        assert torch.equal(compiled(ids, rows, pos), step(ids, rows, pos))


def edited_config(src, dst, **changes):
    """A copy of target directory `src` at `dst` with `config.json` fields changed."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@torch.no_grad()
def prefill_features(target, tokens: list[int], features) -> torch.Tensor:
    """The target's features over `tokens` in one prefill (cache row 0): `[len, F]`."""
    dev = next(target.parameters()).device
    ids = torch.tensor([tokens], device=dev)
    cache_pos = torch.arange(len(tokens), device=dev)[None]
    rows = torch.tensor([0], device=dev)
    plan = target.prefill_plan(ids, cache_pos, rows, [None])
    inputs, rope = plan.chunk(slice(0, len(tokens)))
    out = target(inputs, Slots(rows, cache_pos, rope), features, logit_index=cache_pos[:, -1:])
    return out.features[0]


def cpu_target(path, max_batch: int = 3, max_seq_len: int = 64, dtype=torch.float32):
    """The native target of the checkpoint at `path` on the CPU, at the parity tests' sizes."""
    from draftinfer.files.loading import load_native_target

    return load_native_target(path, "cpu", dtype, max_batch, max_seq_len)


def random_config_parity(
    cfg, index: int, tmp_path, record_property, lengths, logits_atol: float = 1e-4
) -> Diffs:
    """One config of a family's random parity sweep: saved with weights seeded by `index`,
    `speculative_rounds` against HF with taps `(0, L // 2, L - 1)`; the max logit difference
    recorded (`record_property`) and printed, then checked."""
    from tests.support.moe_checkpoints import save_moe_target

    path = save_moe_target(cfg, tmp_path, seed=index)
    L = cfg.num_hidden_layers
    diffs = speculative_rounds(
        cpu_target(path), hf_model(str(path)), lengths, taps=(0, L // 2, L - 1), seed=index
    )
    record_property("max_abs_logit_diff", diffs.logits)
    print(f"config {index}: max |logit diff| {diffs.logits:.2e}, features {diffs.features:.2e}")
    diffs.check(logits_atol=logits_atol)
    return diffs


def assert_greedy_matches_hf(native, path, hf, new_tokens: int) -> None:
    """Greedy decoding of three prompts by `native(path, max_batch=...)` equals HF `generate`
    token for token, batched and (the second prompt) alone: one row's one-token steps take
    the paths a batch does not (the experts' gather path, absorbed MLA of one slot)."""
    from draftinfer.decoding.baseline import greedy_generate

    prompts = [rand_ids(5, 1), rand_ids(11, 2), rand_ids(9, 3)]
    ours = greedy_generate(native(path), prompts, new_tokens, [])
    assert greedy_generate(native(path, max_batch=1), prompts[1:2], new_tokens, []) == ours[1:2]
    for p, mine in zip(prompts, ours):
        out = hf.generate(
            torch.tensor([p]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert out[0, len(p) :].tolist() == mine
