"""The MTP checkpoint layouts: our module names <-> the names engines load (`MTPConfig.layout`).

Our module names (`MTPDrafter.trainable_state_dict`): `layers.{k}.{enorm,hnorm,eh_proj}.*`,
`layers.{k}.block.*` (a decoder layer: `self_attn.*`, `mlp.*`, `input_layernorm`,
`post_attention_layernorm`), and the final norm `layers.{k}.norm.*` (one per module) or
`chain_norm.*` (shared).

- `deepseek` (vLLM's `deepseek_mtp.py`, transformers' `MtpModel`; DESIGN section 4): module k
  of a target with L decoder layers is `model.layers.{L+k}.*` with `enorm`, `hnorm`, `eh_proj`
  (`[H, 2H]`, embedding first), `shared_head.norm` and the block's keys directly under the
  prefix (vLLM inserts `mtp_block.`), plus the engine copies `shared_head.head` (per module)
  and `embed_tokens` (first module; vLLM lifts it to the shared embedding), which we ignore.
  Routed experts are written per expert, as the released DeepSeek/GLM checkpoints and
  transformers 5's `save_pretrained` store them and vLLM's loaders map them
  (`experts.{e}.{gate,up,down}_proj.weight`, `(out, in)`; `unstack_experts`), and read either
  way: per expert or stacked (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`,
  what our blocks hold and exports before the per-expert names wrote; `stack_experts`).
- `mrv2` (Inkling, vLLM MRv2's multi-module user; REFERENCES C, "Checkpoint layouts"):
  `model.mtp.layers.{k}.{hidden_norm, embed_norm, input_proj, transformer_block.*}` with
  `input_proj` `[H, 2H]` reading `[hidden_norm(h) ‖ embed_norm(emb)]` (hidden first) and one
  `model.mtp.chain_norm` shared by all modules; embedding and head are the target's (no copies).
"""

from __future__ import annotations

import re

import torch

OWN_NAME = re.compile(r"^layers\.(\d+)\.(enorm|hnorm|eh_proj|norm|block)\.(.*)$")


class DeepSeekLayout:
    name = "deepseek"

    def module_prefix(self, arch, k: int) -> str:
        return f"model.layers.{arch.target_num_layers + k}"

    def to_serving(self, module) -> dict[str, torch.Tensor]:
        L = module.config.target_num_layers
        out = {}
        for name, t in module.trainable_state_dict().items():
            m = OWN_NAME.match(name)
            k, part, rest = int(m.group(1)), m.group(2), m.group(3)
            prefix = f"model.layers.{L + k}."
            if part == "block":
                out[prefix + rest] = t
            elif part == "norm":
                out[prefix + "shared_head.norm." + rest] = t
            else:
                out[prefix + f"{part}.{rest}"] = t
        for k in range(module.config.n_predict):
            out[f"model.layers.{L + k}.shared_head.head.weight"] = module.lm_head.weight
        out[f"model.layers.{L}.embed_tokens.weight"] = module.embed_tokens.weight
        return unstack_experts(out)

    def wants(self, arch, name: str) -> bool:
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        return m is not None and int(m.group(1)) >= arch.target_num_layers

    def from_serving(self, arch, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        L = arch.target_num_layers
        out = {}
        pat = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
        for name, t in tensors.items():
            m = pat.match(name)
            if m is None or int(m.group(1)) < L:
                out[name] = t  # reported as unexpected by validate_state_dict
                continue
            k, rest = int(m.group(1)) - L, m.group(2)
            if rest.startswith(("shared_head.head.", "embed_tokens.")):
                continue  # engine copies of the target's head / embedding
            if rest.startswith("shared_head.norm."):
                out[f"layers.{k}.norm.{rest[len('shared_head.norm.') :]}"] = t
            elif rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
                out[f"layers.{k}.{rest}"] = t
            else:
                out[f"layers.{k}.block.{rest}"] = t
        return stack_experts(out)


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors as released DeepSeek checkpoints store them
    (`{prefix}.{e}.{gate,up,down}_proj.weight`, `(out, in)`) stacked into the layout our blocks
    and transformers 5 hold, `{prefix}.gate_up_proj [E, 2I, H]` (gate rows first, then up:
    `Experts.per_expert_sources`) and `{prefix}.down_proj [E, H, I]`; a prefix whose experts
    are not all there (0..E-1, three each) is left as it is (reported as unexpected names)."""
    groups: dict[str, dict[tuple[int, str], str]] = {}
    for name in tensors:
        m = _PER_EXPERT.match(name)
        if m is not None:
            groups.setdefault(m.group(1), {})[int(m.group(2)), m.group(3)] = name
    out = dict(tensors)
    for prefix, parts in groups.items():
        E = 1 + max(e for e, _ in parts)
        if len(parts) != 3 * E:
            continue
        gate_up = [
            torch.cat([tensors[parts[e, "gate"]], tensors[parts[e, "up"]]]) for e in range(E)
        ]
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.down_proj"] = torch.stack([tensors[parts[e, "down"]] for e in range(E)])
        for name in parts.values():
            del out[name]
    return out


_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def unstack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `stack_experts`: every stacked `{prefix}.gate_up_proj [E, 2I, H]` (gate
    rows first, then up) and `{prefix}.down_proj [E, H, I]` written as the per-expert tensors
    released checkpoints hold, `{prefix}.{e}.{gate,up,down}_proj.weight` (`[I, H]`, `[I, H]`,
    `[H, I]`), each its own storage (safetensors refuses views of one tensor)."""
    out = {}
    for name, t in tensors.items():
        m = _STACKED.match(name)
        if m is None or t.dim() != 3:
            out[name] = t
            continue
        prefix, which = m.group(1), m.group(2)
        if which == "gate_up_proj":
            if t.shape[1] % 2:
                raise ValueError(f"{name}: {tuple(t.shape)} does not split into gate and up")
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:].clone()
        else:
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
    return out


# Our per-module part -> Inkling's name under `model.mtp.layers.{k}.`.
_MRV2 = {"enorm": "embed_norm", "hnorm": "hidden_norm", "eh_proj": "input_proj"}
_MRV2_BACK = {v: k for k, v in _MRV2.items()}
_MRV2_PAT = re.compile(r"^model\.mtp\.layers\.(\d+)\.([a-z_]+)\.(.*)$")


class MRv2Layout:
    name = "mrv2"

    def module_prefix(self, arch, k: int) -> str:
        return f"model.mtp.layers.{k}"

    def to_serving(self, module) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in module.trainable_state_dict().items():
            if name.startswith("chain_norm."):
                out[f"model.mtp.{name}"] = t
                continue
            m = OWN_NAME.match(name)
            k, part, rest = int(m.group(1)), m.group(2), m.group(3)
            part = "transformer_block" if part == "block" else _MRV2[part]
            out[f"model.mtp.layers.{k}.{part}.{rest}"] = t
        return out

    def wants(self, arch, name: str) -> bool:
        return name.startswith("model.mtp.")

    def from_serving(self, arch, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            if name.startswith("model.mtp.chain_norm."):
                out[name[len("model.mtp.") :]] = t
                continue
            m = _MRV2_PAT.match(name)
            part = None if m is None else m.group(2)
            if part == "transformer_block":
                out[f"layers.{m.group(1)}.block.{m.group(3)}"] = t
            elif part in _MRV2_BACK:
                out[f"layers.{m.group(1)}.{_MRV2_BACK[part]}.{m.group(3)}"] = t
            else:
                out[name] = t  # reported as unexpected by validate_state_dict
        return out


LAYOUTS = {x.name: x for x in (DeepSeekLayout(), MRv2Layout())}


def layout_of(arch):
    return LAYOUTS[arch.layout]
