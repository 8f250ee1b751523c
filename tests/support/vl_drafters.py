"""Drafters for a native Qwen3-VL target built and briefly trained the way training does
(the kind's `TrainSpec.init_drafter` and objective), for runner tests that need a drafter that
accepts drafts on image prompts."""

from __future__ import annotations

import dataclasses

import torch

from draftinfer.conventions.slots import Slots
from drafttrain.registry import InitContext, train_spec

TRAIN_STEPS = 60


class AsTrainTarget:
    """The native target through what `TrainSpec.init_drafter` reads: sizes, the HF text
    config (its M-RoPE `rope_parameters`), shared weights, final norm."""

    def __init__(self, target):
        self.target, self.info = target, target.info
        self.config = target.config.hf_config.text_config
        self.layers = target.model.layers

    def shared_weights(self) -> dict[str, torch.Tensor]:
        return self.target.shared_weights()

    def final_norm_weight(self) -> torch.Tensor:
        return self.target.model.norm.weight


def build_drafter(kind: str, target, cache_dir):
    """(TrainSpec, train config, drafter) of `kind` for a native VL target, built the way
    training builds it (identity draft vocabulary, mask token = the last id)."""
    import datasets

    spec = train_spec(kind)
    V = target.info.vocab_size
    fields = {f.name for f in dataclasses.fields(spec.config_class)}
    wanted = {
        "num_layers": 1,
        "draft_vocab_size": V,
        "ttt_steps": 3,
        "parallel_k": 4,
        "mask_token_id": V - 1,
    }
    cfg = spec.config_class(**{k: v for k, v in wanted.items() if k in fields})
    data = datasets.Dataset.from_dict({"input_ids": [list(range(V))], "loss_mask": [[1] * V]})
    torch.manual_seed(0)
    d = spec.init_drafter(cfg, InitContext(AsTrainTarget(target), None, data, cache_dir))
    return spec, cfg, d.eval()


def target_window(target, seqs: list[list[int]], mm: list, features):
    """The native target's prefill over right-padded `seqs` through its `prefill_plan` (what
    the trainer's target returns for a batch): (ids [B, T], cache_pos [B, T], TargetOutput)."""
    B, T = len(seqs), max(map(len, seqs))
    ids = torch.zeros(B, T, dtype=torch.long)
    cache_pos = torch.full((B, T), -1, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        cache_pos[b, : len(s)] = torch.arange(len(s))
    rows = torch.arange(B)
    inputs, rope = target.prefill_plan(ids, cache_pos, rows, mm).chunk(slice(None))
    return ids, cache_pos, target(inputs, Slots(rows, cache_pos, rope), features)


def train(
    spec, cfg, d, target, seqs: list[list[int]], mm: list, steps: int = TRAIN_STEPS
) -> torch.nn.Module:
    """`steps` Adam steps of the kind's real objective on `seqs` (prompt + the target's
    greedy continuation), all in one batch."""
    ids, cache_pos, out = target_window(target, seqs, mm, d.config.features)
    live = (cache_pos >= 0).long()
    batch = {"input_ids": ids, "attention_mask": live, "loss_mask": live}
    obj = spec.objective(d, cfg, "eager")
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    d.train()
    torch.manual_seed(1)
    for _ in range(steps):
        loss, _ = obj(batch, out)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval().requires_grad_(False)
