"""Block drafter module (`dflash`): one definition used by training (`drafttrain`) and the runner.

Architecture (z-lab `DFlashDraftModel`, REFERENCES A1): N Qwen3-style decoder layers (q/k
RMSNorms) that own no embedding and no head: the block is embedded with the target's input
embedding and scored with the target's `lm_head` (both frozen, never exported). The target
features of committed tokens (the inputs of `n` tapped target layers, concatenated) become one
*context* tensor `hidden_norm(fc(concat))` `[..., H]`, shared by every layer, which enters each
layer only as extra keys and values: `k = k_norm(k_proj(ctx))` RoPE'd at the context row's own
position, `v = v_proj(ctx)`; no query, no `input_layernorm` on it (`context_kv`). The queries
are the block slots `[anchor, MASK x (n - 1)]`; which keys a slot sees is
`draftinfer.kinds.dflash.attention` (the caller's `attn_fn` applies it).

DFlash2 options (identity-initialised, so the defaults are plain DFlash):
- `GroupedDynamicCausalConv` around each sublayer (`attention_conv`, `mlp_conv`): `prepare`
  after the pre-norm, `finish` on the sublayer output, both with kernels `base + delta_t`
  where `delta = kernel_projection(normed sublayer input)` `[2, k, H / group]`, causal along
  the block and never crossing a block boundary (slot 0 reads zero padding);
- `CandidateSelector`: over the top-k draft logits `U` of a slot, the score of candidate `b`
  after predecessor `a` is `U(b) + <A[a] * P h, B[b]>` (`A`, `B` the predecessor / successor
  codebooks `[V, r]`, `P` the hidden projection `[r, H]`); drafting walks the block from the
  anchor (`selector_logits`).

DSpark options (REFERENCES A1, "DSpark"):
- `MarkovHead` (`vanilla`): a first-order low-rank bias on the logits of draft j from the token
  before it (the anchor for draft 1): `markov_w2(markov_w1[prev])` `[V]`, `markov_w1` an
  embedding `[V, r]`, `markov_w2` a `Linear(r -> V)` (weight `[V, r]`); `markov_w2` starts at
  zero, so an untrained head is plain DFlash. `gated` (training only; speculators 0.9.0's
  definition) scales `markov_w1[prev]` by `sigmoid(gate_proj([h, markov_w1[prev]]))` first;
- `ConfidenceHead`: `proj = Linear(H -> 1)` on a drafting slot's normed hidden (`Linear(H + r
  -> 1)` on `[h, markov_w1[prev]]` with `confidence_head_with_markov`), the logit of the
  probability that the draft is accepted (trained by BCE on `sum min(p, q)`).

LiLiCorr option (`LatticeCorrelator`; arXiv 2608.20530, ModelOpt #2342, sglang #37462): the
lattice is each drafting slot's top-k candidates under the head's logits `U`; a two-layer
transformer of width `d` runs causally over the block's slots (input: `slot_projection` of each
slot's normed hidden plus a learned slot embedding) and gives slot s a context `z_s` `[d]`;
lattice node (s, c) is `z_s + token_projection(E[c])` (`E` the target's frozen input
embedding); the transition from token `a` at slot s-1 to candidate `b` at slot s scores
`U_s(b) + <W_u node(s-1, a), W_v node(s, b)>` (every pair of adjacent slots' candidates: one
batched matmul, `transition_scores`). Drafting walks the lattice from the anchor (node (0,
anchor)): greedily the argmax, sampled over the K candidates (q over the candidates, -inf
elsewhere, as DFlash2's selector, so the same rejection sampling keeps it exact). `W_v` starts at
zero, so an untrained correlator drafts plain DFlash's argmax.
`draft_logits` is the one function training (teacher-forced predecessors) and the runner
(the previous draft) score a drafting slot with; `lattice_contexts` the one that gives it the
correlator's slot contexts.

Shapes: block rows `[B, S]` with `S = (blocks per row) * n`, blocks contiguous, `n` the block
length (`block`); RoPE positions `[B, S]` or `[3, B, S]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftinfer.kinds.dflash.config import DFlashConfig
from draftinfer.models.layers import Attention, AttnFn, RMSNorm, SwiGLU, head_logits
from draftinfer.models.rope import RotaryEmbedding, apply_rope


def grouped_causal_conv(
    x: torch.Tensor,  # [B, S, H]
    dynamic: torch.Tensor,  # [B, S, k, G]: per-slot kernel deltas, one per channel group
    base: torch.Tensor,  # [k, H]
    block: int,
) -> torch.Tensor:
    """`out_t = sum_o (base[o] + dynamic_t[o, group(c)]) * x_{t-o}`, within each block of
    `block` rows (offsets before a block's first row read zeros). -> `[B, S, H]`."""
    B, S, H = x.shape
    k, G = dynamic.shape[-2:]
    xb = x.reshape(B * (S // block), block, G, H // G)
    dyn = dynamic.reshape(B * (S // block), block, k, G, 1).to(x.dtype)
    out = torch.zeros_like(xb)
    for o in range(min(k, block)):
        shifted = xb if o == 0 else F.pad(xb[:, :-o], (0, 0, 0, 0, o, 0))
        # The reference's order (base product, then the dynamic one): the same bf16 rounding.
        out = out + base[o].view(1, 1, G, H // G).to(x.dtype) * shifted
        out = torch.addcmul(out, dyn[:, :, o], shifted)
    return out.reshape(B, S, H)


class GroupedDynamicCausalConv(nn.Module):
    """DFlash2's two-sided conv around one sublayer; identity at init."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.groups = kernel_size, hidden // group_size
        base = torch.zeros(2, kernel_size, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)  # [2 (prepare, finish), k, H]
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, S, H]` (the normed sublayer input) -> (its conv, the finish side's deltas)."""
        dyn = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))
        return grouped_causal_conv(x, dyn[..., 0, :, :], self.base_kernel[0], block), dyn[
            ..., 1, :, :
        ]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor, block: int) -> torch.Tensor:
        return grouped_causal_conv(y, dynamic, self.base_kernel[1], block)


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer whose attention also reads the context keys/values
    (through `attn_fn`), with DFlash2's convs when configured."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        H = c.hidden_size
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = Attention(
            H,
            H,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            False,
            qk_norm=True,
            eps=c.rms_norm_eps,
        )
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.mlp = SwiGLU(H, c.intermediate_size)
        if c.conv_kernel_size:
            self.attention_conv = GroupedDynamicCausalConv(H, c.conv_kernel_size, c.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(H, c.conv_kernel_size, c.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, x, cos, sin, attn_fn: AttnFn, idx: int, block: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.attention_conv is not None:
            h, dyn = self.attention_conv.prepare(h, block)
        a = self.self_attn(h, cos, sin, attn_fn, idx)
        if self.attention_conv is not None:
            a = self.attention_conv.finish(a, dyn, block)
        x = x + a
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            h, dyn = self.mlp_conv.prepare(h, block)
        m = self.mlp(h)
        if self.mlp_conv is not None:
            m = self.mlp_conv.finish(m, dyn, block)
        return x + m

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Context rows `[..., T, H]` -> this layer's (k, v) `[..., T, nkv, D]`: k_norm then
        RoPE at the rows' own positions on k, nothing on v (no input_layernorm: ctx is
        already `hidden_norm`ed)."""
        a = self.self_attn
        lead = ctx.shape[:-1]
        k, v = a.project_kv(ctx)
        k = a.k_norm(k.view(*lead, a.n_kv, a.head_dim))
        v = v.view(*lead, a.n_kv, a.head_dim)
        return apply_rope(k, cos, sin), v


class CandidateSelector(nn.Module):
    """DFlash2's low-rank candidate selector; identity at init (successor codebook zero)."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # Parameters named as the z-lab checkpoints store them (no `.weight` suffix).
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)  # [V, r]
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # [V, r]
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def scores(
        self,
        proj: torch.Tensor,  # [..., r] hidden_projection of the slot's normed hidden
        pred: torch.Tensor,  # [...] predecessor token ids
        unary: torch.Tensor,  # [..., K] draft logits of the candidates
        cand: torch.Tensor,  # [..., K] candidate token ids
    ) -> torch.Tensor:
        """`U(b) + <A[a] * h', B[b]>` `[..., K]` (fp32)."""
        left = self.predecessor_codebook[pred] * proj  # [..., r]
        pair = (left.unsqueeze(-2) * self.successor_codebook[cand]).sum(-1)  # [..., K]
        return unary.float() + pair.float()


def selector_logits(
    selector: CandidateSelector,
    proj: torch.Tensor,  # [..., r]
    pred: torch.Tensor,  # [...]
    logits: torch.Tensor,  # [..., V] the slot's draft logits
) -> torch.Tensor:
    """The selector's draft logits of one slot `[..., V]` fp32: its scores on the top-k
    candidates, -inf elsewhere, so any sampler's q is a distribution over the candidates
    (what rejection sampling needs to stay exact)."""
    unary, cand = logits.topk(selector.top_k, dim=-1)  # [..., K]
    s = selector.scores(proj, pred, unary, cand)
    out = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)
    return out.scatter(-1, cand, s)


class LatticeLayer(nn.Module):
    """One pre-norm layer of the correlator: causal multi-head self-attention over a block's
    slots (slot s sees slots <= s, so capped trailing slots never move live ones), then a GELU
    MLP of width 4d."""

    def __init__(self, d: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(d, eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d, eps)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[N, n, d]` -> `[N, n, d]`."""
        N, n, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(N, n, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [N, heads, n, d / heads]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(N, n, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class LatticeCorrelator(nn.Module):
    """LiLiCorr's scorer of transitions between candidates of adjacent slots (module
    docstring); identity at init (`successor` zero: the scores are the head's logits)."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        H, d = c.hidden_size, c.lilicorr_rank
        self.top_k = c.lilicorr_top_k
        self.slot_projection = nn.Linear(H, d, bias=False)
        self.slot_embedding = nn.Parameter(torch.randn(c.block_size, d) * 0.02)  # [B, d]
        self.layers = nn.ModuleList(
            LatticeLayer(d, c.lilicorr_heads, c.rms_norm_eps) for _ in range(c.lilicorr_layers)
        )
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.token_projection = nn.Linear(H, d, bias=False)
        self.predecessor = nn.Linear(d, d, bias=False)  # W_u
        self.successor = nn.Linear(d, d, bias=False)  # W_v
        nn.init.zeros_(self.successor.weight)

    def contexts(self, normed: torch.Tensor) -> torch.Tensor:
        """A block's slots' normed hidden `[..., n, H]` (slot 0 the anchor's) -> the slots'
        contexts `z` `[..., n, d]`."""
        *lead, n, _ = normed.shape
        w = self.slot_projection.weight
        x = self.slot_projection(normed.to(w.dtype)) + self.slot_embedding[:n].to(w.dtype)
        x = x.reshape(-1, n, x.shape[-1])
        for layer in self.layers:
            x = layer(x)
        return self.norm(x).view(*lead, n, -1)

    def transition_scores(
        self,
        z_prev: torch.Tensor,  # [..., d] context of slot s - 1
        prev_emb: torch.Tensor,  # [..., Kp, H] input embeddings of slot s - 1's tokens
        z_cur: torch.Tensor,  # [..., d] context of slot s
        cand_emb: torch.Tensor,  # [..., K, H] input embeddings of slot s's candidates
    ) -> torch.Tensor:
        """`<W_u node(s-1, a), W_v node(s, b)>` for every pair `[..., Kp, K]` (fp32)."""
        w = self.token_projection.weight
        u = self.predecessor(z_prev[..., None, :] + self.token_projection(prev_emb.to(w.dtype)))
        v = self.successor(z_cur[..., None, :] + self.token_projection(cand_emb.to(w.dtype)))
        return (u @ v.transpose(-1, -2)).float()

    def scores(self, embed, z_prev, z_cur, pred, unary, cand) -> torch.Tensor:
        """Slot s's candidates after token `pred [...]` at slot s - 1: `U(b) + transition`
        `[..., K]` fp32 (`embed`: the target's input embedding, unary `[..., K]` the head's
        logits of the candidates `cand [..., K]`)."""
        pair = self.transition_scores(z_prev, embed(pred)[..., None, :], z_cur, embed(cand))
        return unary.float() + pair[..., 0, :]


def lattice_logits(drafter, lattice, pred: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The correlator's draft logits of one slot `[..., V]` fp32 given its predecessor token
    `pred [...]` and `lattice = (z_prev, z_cur)` `[..., d]` each: its scores on the head's
    top-k candidates, -inf elsewhere (q over the candidates, as `selector_logits`)."""
    corr = drafter.lattice_correlator
    unary, cand = logits.topk(corr.top_k, dim=-1)  # [..., K]
    z_prev, z_cur = lattice
    s = corr.scores(drafter.embed_tokens, z_prev, z_cur, pred, unary, cand)
    out = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)
    return out.scatter(-1, cand, s)


def lattice_contexts(drafter, normed: torch.Tensor) -> torch.Tensor | None:
    """A block's normed hidden `[..., n, H]` (every slot, the anchor's first) -> the
    correlator's slot contexts `[..., n, d]`, or None without LiLiCorr."""
    corr = drafter.lattice_correlator
    return None if corr is None else corr.contexts(normed)


def slot_lattice(z: torch.Tensor | None, j: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(z_prev, z_cur)` of draft j (0-based: slot j + 1, its predecessor slot j) from a
    block's contexts `z [..., n, d]`, or None."""
    return None if z is None else (z[..., j, :], z[..., j + 1, :])


class MarkovHead(nn.Module):
    """DSpark's Markov head: a logit bias `[..., V]` from the token before the drafted one.

    - `vanilla`: `markov_w2(markov_w1[prev])`;
    - `gated`: `markov_w2(sigmoid(gate_proj([h, markov_w1[prev]])) * markov_w1[prev])`, `h` the
      drafting slot's normed hidden, `gate_proj = Linear(H + r -> r)` with a bias. REFERENCES
      A1 names `gated` (training only) without defining it; this is vllm-project/speculators
      0.9.0's definition (`models/dspark/model_definitions.py::MarkovHead`), so the speculators
      `dspark` layout loads it as trained. No engine serves it (vLLM: `vanilla` only)."""

    def __init__(self, vocab: int, rank: int, hidden: int = 0, head_type: str = "vanilla"):
        super().__init__()
        self.head_type = head_type
        self.markov_w1 = nn.Embedding(vocab, rank)  # [V, r]
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)  # weight [V, r]
        nn.init.zeros_(self.markov_w2.weight)
        self.gate_proj = nn.Linear(hidden + rank, rank) if head_type == "gated" else None

    def forward(self, prev: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """prev `[...]` token ids (and, gated, the slot's normed hidden `[..., H]`) -> logit
        bias `[..., V]`."""
        e = self.markov_w1(prev)  # [..., r]
        if self.gate_proj is not None:
            h = normed.to(e.dtype)
            e = torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e
        return self.markov_w2(e)


class ConfidenceHead(nn.Module):
    """DSpark's per-slot accept-rate predictor: `proj = Linear(H -> 1)` on the normed hidden,
    or `Linear(H + r -> 1)` on `[h, markov_w1[prev]]` with `confidence_head_with_markov`
    (REFERENCES A1) -> a logit `[...]` (`confidence_logit`)."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features.to(self.proj.weight.dtype))[..., 0]


def confidence_logit(
    drafter,
    normed: torch.Tensor,  # [..., H] a drafting slot's normed hidden
    prev: torch.Tensor,  # [...] the token before the one drafted (anchor for draft 1)
) -> torch.Tensor:
    """The confidence head's logit `[...]` of one drafting slot: on `h`, or on `[h,
    markov_w1[prev]]` with `confidence_head_with_markov` (training: the ground-truth
    predecessor; the runner: the previous draft)."""
    head = drafter.confidence_head
    if not drafter.config.confidence_head_with_markov:
        return head(normed)
    dt = head.proj.weight.dtype
    return head(torch.cat([normed.to(dt), drafter.markov_head.markov_w1(prev).to(dt)], -1))


def draft_logits(
    drafter,
    normed: torch.Tensor,  # [..., H] a drafting slot's normed hidden
    prev: torch.Tensor,  # [...] the token before the one drafted (anchor for draft 1)
    lattice: tuple[torch.Tensor, torch.Tensor] | None = None,  # LiLiCorr: (z_prev, z_cur)
) -> torch.Tensor:
    """The draft logits of one drafting slot `[..., V]`: the head's, plus DSpark's Markov bias
    of `prev`, or DFlash2's selector scores over the top-k given `prev`, or LiLiCorr's
    transition scores over the top-k given `prev` and the slot contexts `lattice`
    (`slot_lattice`). Training passes the ground-truth predecessors, the runner the previous
    draft."""
    logits = drafter.logits(normed)
    if drafter.lattice_correlator is not None:
        return lattice_logits(drafter, lattice, prev, logits)
    if drafter.markov_head is not None:
        logits = logits + drafter.markov_head(prev, normed).to(logits.dtype)
    sel = drafter.candidate_selector
    if sel is not None:
        logits = selector_logits(sel, sel.hidden_projection(normed), prev, logits)
    return logits


class DFlashDrafter(nn.Module):
    """`fc` + `hidden_norm` (context) + decoder layers + `norm`; the target's embedding and
    head (frozen, `requires_grad=False`, not in `trainable_state_dict`)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = self.config = config
        H, V = c.hidden_size, c.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.fc = nn.Linear(len(c.tap_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        self.candidate_selector = (
            CandidateSelector(H, V, c.selector_rank, c.selector_top_k) if c.selector_top_k else None
        )
        self.markov_head = (
            MarkovHead(V, c.markov_rank, H, c.markov_head_type) if c.markov_rank else None
        )
        conf_in = H + (c.markov_rank if c.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(conf_in) if c.confidence_head else None
        self.lattice_correlator = LatticeCorrelator(c) if c.lilicorr_top_k else None

    @property
    def chained(self) -> bool:
        """Whether a draft's logits depend on the previous draft (Markov head, selector,
        LiLiCorr's lattice)."""
        return (
            self.markov_head is not None
            or self.candidate_selector is not None
            or self.lattice_correlator is not None
        )

    # -- the context --------------------------------------------------------------------------
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features `[..., n * H]` (the taps, concatenated) -> context `[..., H]`."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, rope_pos: torch.Tensor):
        """Context `[B, T, H]` at RoPE positions `[B, T]` / `[3, B, T]` -> per layer (k, v)
        `[B, T, nkv, D]`: what the runner stores in the drafter's KV cache."""
        cos, sin = self.rotary(rope_pos)
        return [layer.context_kv(ctx, cos, sin) for layer in self.layers]

    # -- the block ----------------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, rope_pos: torch.Tensor, attn_fn: AttnFn, block: int
    ) -> torch.Tensor:
        """Block rows: input_ids `[B, S]` (anchor or mask token per slot), rope_pos `[B, S]` /
        `[3, B, S]`, `attn_fn(layer, q, k, v)` adding the context keys and the block mask,
        `block` = slots per block -> normed hidden `[B, S, H]` (the head's input)."""
        x = self.embed_tokens(input_ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(rope_pos)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_fn, i, block)
        return self.norm(x)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """`[..., H]` -> full-vocabulary logits `[..., V]` (the target's head)."""
        return head_logits(self.lm_head, normed)

    def draft_vocab_ids(self) -> torch.Tensor:
        """A block drafter scores the target's whole vocabulary."""
        return torch.arange(self.config.vocab_size, device=self.lm_head.weight.device)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything the drafter owns: not the target's embedding and head."""
        skip = ("embed_tokens.", "lm_head.")
        return {k: v for k, v in self.state_dict().items() if not k.startswith(skip)}

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        shared = {
            "embed_tokens.weight": self.embed_tokens.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        self.load_state_dict({**tensors, **shared})
