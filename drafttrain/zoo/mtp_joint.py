"""A target trained with its own MTP layers, as DeepSeek-V3 trains them (the technical report's
multi-token prediction, section 2.2), and those layers written where DeepSeek's checkpoints keep
them: the start of the zoo's DeepSeek-V3 target, whose released layer `drafter=native` serves.

- `NextTokenWithMTP`: the objective. The main next-token loss (`NextTokenLM`'s) plus `weight`
  times the mean over depths k of module k's loss: at row i, module k consumes the token
  `t_{i+k+1}` (its embedding zeroed at position 0) with the carried hidden state (the main
  model's post-final-norm state for k = 0; module k-1's output after) at position `pos_i + k`
  and predicts `t_{i+k+2}`, scored where that token is trained (`labels`). The modules are
  transformers' own `MtpModel` layers (its embedding and head the main model's), and the
  gradient reaches the main model through the hidden state, as in DeepSeek's joint training.
- `released_names`: such layers under the names DeepSeek's checkpoints use,
  `model.layers.{L+k}.{enorm, hnorm, eh_proj, shared_head.norm}` plus the block's keys with the
  experts per expert (the inverse of transformers' MTP conversion); `save_released_mtp` writes
  them into a saved target's `model.safetensors` with `num_nextn_predict_layers`.

transformers' `MtpModel` chains a module's post-norm output; DeepSeek-V3 ships one layer, and
with one layer the carry is never used (vLLM's pre-norm carry, which `drafter=native` serves,
and this one agree).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class NextTokenWithMTP(nn.Module):
    """`forward(batch) -> (loss, metrics)` (module docstring); `batch`: `input_ids [B, T]` and
    `labels [B, T]` (the token at t + 1, or -100), right-padded."""

    def __init__(self, model: nn.Module, mtp: nn.Module, weight: float = 0.3):
        super().__init__()
        self.model, self.mtp, self.weight = model, mtp, weight

    def forward(self, batch: dict[str, torch.Tensor]):
        labels, ids = batch["labels"], batch["input_ids"]
        out = self.model(input_ids=ids, use_cache=False, output_hidden_states=True)
        n = (labels != -100).sum()
        main = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        main = main / n
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device).expand(B, T)
        embed = self.model.get_input_embeddings()
        carry = out.hidden_states[-1]  # post final norm
        depth_losses = []
        for k in range(len(self.mtp.layers)):
            rows = T - 1 - k  # row i < rows consumes t_{i+k+1} and predicts t_{i+k+2}
            if rows < 1:
                break
            k_pos = pos[:, :rows] + k
            emb = embed(ids[:, 1 + k : 1 + k + rows])
            emb = torch.where((k_pos == 0)[..., None], torch.zeros_like(emb), emb)
            carry = self.mtp.forward_layer(k, carry[:, :rows], k_pos, None, inputs_embeds=emb)
            logits = self.mtp._project_to_logits(carry)
            want = labels[:, 1 + k : 1 + k + rows]
            m = (want != -100).sum().clamp(min=1)
            ce = F.cross_entropy(logits.flatten(0, 1).float(), want.flatten(), reduction="sum")
            depth_losses.append(ce / m)
        mtp = torch.stack(depth_losses).mean()
        metrics = {"loss": main.detach(), "mtp_loss": mtp.detach(), "tokens": n}
        return main + self.weight * mtp, metrics


def released_names(state: dict[str, torch.Tensor], L: int) -> dict[str, torch.Tensor]:
    """transformers' `MtpModel` state (`layers.{k}.{enorm, hnorm, eh_proj, post_norm,
    mtp_block.*}`) under DeepSeek's released names (module docstring), experts per expert;
    the shared embedding and head (not under `layers.`) are left out."""
    out = {}
    for name, t in state.items():
        m = re.match(r"^layers\.(\d+)\.(.*)$", name)
        if m is None:
            continue
        prefix, rest = f"model.layers.{L + int(m.group(1))}.", m.group(2)
        if rest.startswith("mtp_block."):
            rest = rest[len("mtp_block.") :]
        elif rest.startswith("post_norm."):
            rest = "shared_head.norm." + rest[len("post_norm.") :]
        if rest.endswith("experts.gate_up_proj"):
            base = prefix + rest[: -len(".gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}.{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif rest.endswith("experts.down_proj"):
            base = prefix + rest[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[prefix + rest] = t.contiguous()
    return out


@torch.no_grad()
def save_released_mtp(mtp: nn.Module, main: nn.Module, target_dir: Path) -> None:
    """Write `mtp`'s layers into the saved target at `target_dir` (a single
    `model.safetensors`) under DeepSeek's names, with the engine copies of the head and the
    embedding (`shared_head.head`, `embed_tokens`) the released checkpoints carry, and set
    `num_nextn_predict_layers` in its config.json."""
    from safetensors.torch import load_file, save_file

    L = main.config.num_hidden_layers
    state = {k: v.detach().float() for k, v in mtp.state_dict().items()}
    released = released_names(state, L)
    for k in range(len(mtp.layers)):
        released[f"model.layers.{L + k}.shared_head.head.weight"] = main.lm_head.weight
        released[f"model.layers.{L + k}.embed_tokens.weight"] = main.get_input_embeddings().weight
    file = Path(target_dir) / "model.safetensors"
    tensors = load_file(str(file))
    dtype = next(iter(tensors.values())).dtype
    tensors.update({k: v.detach().to(dtype).contiguous().clone() for k, v in released.items()})
    save_file(tensors, str(file), metadata={"format": "pt"})
    cfg_path = Path(target_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = len(mtp.layers)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
