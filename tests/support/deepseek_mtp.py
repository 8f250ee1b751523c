"""Tiny DeepSeek-V3 targets that ship their own MTP layers, as the released checkpoints do
(REFERENCES part D, C4): `model.layers.{L+k}.{enorm, hnorm, eh_proj, shared_head.{norm, head},
embed_tokens}` plus a whole decoder block (MLA, routed experts stored per expert) under the same
prefix, `num_nextn_predict_layers = n` in config.json.

The MTP layers are transformers' own (`transformers.modeling_layers.MtpModel` built on the
target, its random init with the routers redrawn wide), renamed by the inverse of transformers'
MTP conversion (`layers.{k}.mtp_block.` -> `model.layers.{L+k}.`, `post_norm` ->
`shared_head.norm`, stacked experts -> per expert), so `MtpModel.from_pretrained` reads them back
(`mtp_oracle`): the oracle the runner's native MTP block is checked against.
"""

from __future__ import annotations

from pathlib import Path

import torch

from drafttrain.zoo.mtp_joint import released_names
from tests.support.moe_checkpoints import save_moe_target


def save_deepseek_with_mtp(config, path: Path, n_mtp: int = 1, seed: int = 0) -> Path:
    """`config` (a `DeepseekV3Config`) saved at `path` as a random target (`save_moe_target`)
    that ships `n_mtp` MTP layers in its own `model.safetensors` (module docstring)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    config.num_nextn_predict_layers = n_mtp
    save_moe_target(config, path, seed)
    main = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager")
    torch.manual_seed(seed + 7)
    mtp = MtpModel(main, n_mtp)
    g = torch.Generator().manual_seed(seed + 8)
    state = {}
    # Every tensor drawn here (transformers leaves some of an `MtpModel`'s uninitialised):
    # routers wide (decisive routes), the correction bias of order the scores, norms near 1.
    for name, t in mtp.state_dict().items():
        if name.endswith("mlp.gate.weight"):
            t = torch.randn(t.shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            t = 0.3 * torch.randn(t.shape, generator=g)
        elif t.dim() == 1:
            t = 1.0 + 0.3 * torch.rand(t.shape, generator=g)
        else:
            t = 0.15 * torch.randn(t.shape, generator=g)
        state[name] = t
    L = config.num_hidden_layers
    released = released_names(state, L)
    for k in range(n_mtp):
        released[f"model.layers.{L + k}.shared_head.head.weight"] = main.lm_head.weight.detach()
        released[f"model.layers.{L + k}.embed_tokens.weight"] = (
            main.get_input_embeddings().weight.detach()
        )
    file = path / "model.safetensors"
    everything = {**load_file(str(file)), **{k: v.clone() for k, v in released.items()}}
    save_file(everything, str(file), metadata={"format": "pt"})
    return path


def mtp_oracle(path: Path):
    """(transformers' main model, its `MtpModel` loaded from the target's own files by
    `MtpModel.from_pretrained`), eager attention, fp32. transformers finds a checkpoint's MTP
    layers by the main model's `_keys_to_ignore_on_load_unexpected` (DeepSeek-V3: the real
    checkpoint's `model.layers.61`); a tiny target's index L is named the same way."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    main = AutoModelForCausalLM.from_pretrained(
        str(path), attn_implementation="eager", dtype=torch.float32
    ).eval()
    L = main.config.num_hidden_layers
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L + k}.*" for k in range(4)]
    return main, MtpModel.from_pretrained(main).eval()


@torch.no_grad()
def assert_chained_modules_equal(main, theirs, ours, ids: torch.Tensor, T: int, n: int):
    """Module k's logits of our released drafter `ours` equal transformers' `MtpModel`
    `theirs`, chained as vLLM serves DeepSeek-style MTP: module k's rows at pos_i + k, the
    embedding at position 0 zeroed, module k+1 fed module k's pre-norm output. -> the target's
    post-final-norm hidden states `[B, T, H]` module 0 read."""
    from draftinfer.decoding.proposer import causal_attn

    pos = torch.arange(T)[None].expand(ids.shape[0], -1)
    embed = main.get_input_embeddings()
    h = main(ids[:, :T], output_hidden_states=True).hidden_states[-1]  # post final norm
    h_ours = h_theirs = h
    for k in range(n):
        tok = ids[:, 1 + k : 1 + k + T]
        k_pos = pos + k
        emb = torch.where((k_pos == 0)[..., None], 0.0, embed(tok))
        layer = theirs.layers[k]
        pre = layer.mtp_block(
            layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h_theirs)], -1)),
            attention_mask=torch.full((T, T), float("-inf")).triu(1)[None, None],
            position_embeddings=theirs.rotary_emb(emb, k_pos),
            position_ids=k_pos,
        )
        want = theirs._project_to_logits(layer.post_norm(pre))
        normed, pre_ours = ours(k, tok, h_ours, k_pos, causal_attn)
        diff = (ours.logits(normed) - want).abs().max().item()
        assert diff <= 1e-5 * want.abs().max().item() + 1e-6, (k, diff)
        h_ours, h_theirs = ours.carry(normed, pre_ours), pre
    return h
