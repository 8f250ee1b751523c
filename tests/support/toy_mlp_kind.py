"""A drafter kind that shares nothing with the shipped ones, defined outside the package: the
seam test's subject (`tests/kinds/test_toy_kind.py`, DESIGN 2.1 seam 1).

`toymlp` has no attention, no RoPE, no KV cache and no draft vocabulary: one target tap (the
input of the last decoder layer) projected to the hidden size, then per draft step a residual
MLP over `[carried feature, token embedding]`, a norm and a full-vocabulary head. Row i
consumes `(t_{i+1}, f_i)` and predicts `t_{i+2}` (convention 1); later steps carry the MLP's
pre-norm output (convention 5), as a chain. Being stateless, its proposer keeps nothing
between rounds: a rejection costs it nothing to repair, and it ignores positions altogether,
which is what makes it a fair test that shared code assumes neither a cache nor RoPE.

Registered only by the test (`register` / `unregister`), never by the package.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from draftinfer.conventions.window import shift_left
from draftinfer.decoding.proposer import (
    DraftChooser,
    FirstPass,
    Proposer,
    greedy_chooser,
    last_valid,
)
from draftinfer.files.checkfields import require
from draftinfer.files.errors import CheckpointError
from draftinfer.models.layers import RMSNorm
from draftinfer.models.target import FeatureSpec
from draftinfer.registry import DrafterSpec, register_drafter, unregister_drafter
from drafttrain.frozen.head import target_distribution
from drafttrain.jobs.config import DrafterTrainConfig
from drafttrain.objectives.fused_ce import linear_soft_ce
from drafttrain.objectives.loss_fns import SOFT_CE
from drafttrain.objectives.losses import DraftLoss
from drafttrain.registry import TrainSpec, register_train_kind, unregister_train_kind

KIND = "toymlp"


@dataclass
class ToyMLPConfig:
    kind: ClassVar[str] = KIND
    architecture: ClassVar[str] = "ToyMLPDrafter"

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    target_hidden_size: int
    tap: int  # the target layer whose input is the drafter's feature
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6

    @property
    def features(self) -> FeatureSpec:
        return FeatureSpec(layer_inputs=(self.tap,))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_hf(self) -> dict[str, Any]:
        return {"architectures": [self.architecture], **self.to_dict()}

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> ToyMLPConfig:
        return cls(**{f.name: require(d, f.name, where) for f in fields(cls)})


class ToyMLPDrafter(nn.Module):
    def __init__(self, config: ToyMLPConfig):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)  # the target's, frozen
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(c.target_hidden_size, c.hidden_size, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(2 * c.hidden_size, c.intermediate_size),
            nn.SiLU(),
            nn.Linear(c.intermediate_size, c.hidden_size),
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target tap `[..., target_hidden]` -> step-0 carried feature `[..., H]`."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, ids: torch.Tensor, carried: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """ids `[B, T]`, carried `[B, T, H]` -> (normed `[B, T, H]`, pre-norm `[B, T, H]`)."""
        x = torch.cat([carried, self.embed_tokens(ids).to(carried.dtype)], dim=-1)
        pre = carried + self.mlp(x)
        return self.norm(pre), pre

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed)

    def draft_vocab_ids(self) -> torch.Tensor:
        return torch.arange(self.config.vocab_size, device=self.lm_head.weight.device)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.load_state_dict({**tensors, "embed_tokens.weight": self.embed_tokens.weight})


def _chain(drafter, ids, carried, k, choose, record):
    """k chained steps from the last rows: ids `[B]`, carried `[B, H]`."""
    tok = ids
    for step in range(k):
        normed, carried = drafter(tok[:, None], carried[:, None])
        carried = carried[:, 0]
        tok = record(step, drafter.logits(normed[:, 0]), choose)


class ToyMLPProposer(Proposer):
    mode = "stateless MLP chain drafting"

    def kv_snapshot(self, row: int, n: int) -> list[torch.Tensor]:
        return []  # nothing is cached: nothing can go stale

    @torch.no_grad()
    def admit(self, first_pass: FirstPass, attn_len: int | None = None) -> FirstPass:
        return first_pass.take(-1)  # only the last prompt row matters

    @torch.no_grad()
    def propose(
        self,
        first_pass: FirstPass,
        num_drafts: torch.Tensor,
        k: int,
        choose: DraftChooser = greedy_chooser,
        attn_len: int | None = None,
    ):
        d, fp = self.drafter, first_pass
        B = fp.ids.shape[0]
        ar = torch.arange(B, device=fp.ids.device)
        last = last_valid(fp.cache_pos)  # [B]
        drafts = torch.zeros(B, k, dtype=torch.long, device=fp.ids.device)
        box: dict[str, Any] = {"qs": None}

        def record(step, logits, chooser):
            box["qs"] = self._record(drafts, box["qs"], step, logits, num_drafts > step, chooser)
            return drafts[:, step]

        carried = d.project_features(fp.features[ar, last])  # [B, H]
        _chain(d, fp.ids[ar, last], carried, k, choose, record)
        return drafts, box["qs"]

    @staticmethod
    @torch.no_grad()
    def reference_drafts(drafter, ids, features, rope_pos, n, choose, mm=None):
        drafts, qs = [], []

        def record(step, logits, chooser):
            choice, q = chooser(logits, step)
            drafts.append(int(choice[0]))
            qs.append(q)
            return choice

        _chain(drafter, ids[-1:], drafter.project_features(features[-1:]), n, choose, record)
        return drafts, qs


class ToyMLPSpec(DrafterSpec):
    name = KIND
    config_class = ToyMLPConfig
    module_class = ToyMLPDrafter
    proposer_class = ToyMLPProposer
    mode = ToyMLPProposer.mode
    needs = frozenset({"layer_inputs"})
    handles = frozenset()  # text targets only: a multimodal family is refused by check_pair

    def attach_shared(self, module, shared: dict[str, torch.Tensor]) -> None:
        emb = shared.get("input_embeddings")
        if emb is None or emb.shape != module.embed_tokens.weight.shape:
            raise CheckpointError(f"target embedding does not fit a {KIND} drafter")
        with torch.no_grad():
            module.embed_tokens.weight.copy_(emb)


@dataclass
class ToyMLPTrainConfig(DrafterTrainConfig):
    kind: str = KIND
    # Chained steps trained per row (and the export's advertised K).
    steps: int = 2


class ToyMLPObjective:
    def __init__(self, drafter: ToyMLPDrafter, cfg: ToyMLPTrainConfig, backend: str, loss=SOFT_CE):
        self.drafter, self.cfg, self.loss = drafter, cfg, loss

    def unroll(self, input_ids, features, steps):
        """Logits `[B, T, V]` of each chained step: row i at step k consumes t_{i+1+k}."""
        carried = self.drafter.project_features(features)
        out = []
        for k in range(steps):
            normed, carried = self.drafter(shift_left(input_ids, 1 + k), carried)
            out.append(normed)
        return out

    def anchor_logits(self, ids, features, rope_pos, anchor, k, mm=None) -> torch.Tensor:
        return torch.stack(
            [self.drafter.logits(n[0, anchor]) for n in self.unroll(ids, features, k)]
        )

    def __call__(self, batch, tgt):
        d = self.drafter
        dist = target_distribution(tgt)  # the full vocabulary
        B, T = dist.shape
        loss_mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        flat = torch.arange(B * T, device=loss_mask.device).view(B, T)
        out = DraftLoss(loss_mask.device)
        for k, normed in enumerate(self.unroll(batch["input_ids"], tgt.features, self.cfg.steps)):
            n = max(T - 2 - k, 0)
            valid = torch.zeros_like(loss_mask)
            valid[:, :n] = loss_mask[:, 2 + k :]
            rows = (flat + 1 + k).clamp(max=B * T - 1)
            loss_sum, hits, count = linear_soft_ce(
                normed.flatten(0, 1),
                d.lm_head.weight,
                dist.probs,
                rows.flatten(),
                dist.top1,
                valid.flatten().long() - 1,
                loss=self.loss,
            )
            out.add_sums(k, loss_sum[0], hits[0], count[0], 1.0)
        return out.result(loss_mask)

    def checkpoint_meta(self) -> dict:
        return {"serving_k": self.cfg.steps}


class ToyMLPTrainSpec(TrainSpec):
    name = KIND
    config_class = ToyMLPTrainConfig
    objective_class = ToyMLPObjective

    def arch(self, cfg, ctx) -> ToyMLPConfig:
        info = ctx.target.info
        H = info.hidden_size
        return ToyMLPConfig(
            hidden_size=H,
            intermediate_size=cfg.intermediate_size or 2 * H,
            vocab_size=info.vocab_size,
            target_hidden_size=H,
            tap=info.num_layers - 1,
            max_position_embeddings=info.max_position_embeddings,
        )

    def features(self, cfg, ctx) -> FeatureSpec:
        return self.arch(cfg, ctx).features

    @torch.no_grad()
    def init_drafter(self, cfg, ctx) -> ToyMLPDrafter:
        d = ToyMLPDrafter(self.arch(cfg, ctx))
        shared = ctx.target.shared_weights()
        d.embed_tokens.weight.copy_(shared["input_embeddings"].float())
        d.lm_head.weight.copy_(shared["output_embeddings"].float())
        norm = ctx.target.final_norm_weight()
        if norm is not None:
            d.norm.weight.copy_(norm.float())
        d.mlp[-1].weight.zero_()  # the residual MLP starts as the identity on the feature
        d.mlp[-1].bias.zero_()
        return d

    def blocks(self, drafter) -> list:
        return [drafter.mlp]


def register() -> None:
    register_drafter(ToyMLPSpec())
    register_train_kind(ToyMLPTrainSpec())


def unregister() -> None:
    unregister_drafter(KIND)
    unregister_train_kind(KIND)
