"""The `dflash` export against the facts engines load by (REFERENCES A3): the z-lab layout that
vLLM (`method: dflash` / `dspark`) and SGLang (`DFLASH`) read as-is, and the speculators
`dflash` / `dflash2` / `dspark` layout, field by field and tensor by tensor; the load back;
one-line refusals of configs this code cannot serve exactly; and vLLM's drafter rebuilt from
the exported files alone by an independent reader (`engine_readers.BlockDrafterFiles`),
whose logits (DSpark: Markov bias and confidence too) equal our runner's."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from draftinfer.files.checkpoint import (
    SPECULATORS_DIR,
    load_drafter,
    write_drafter,
    write_speculators,
)
from draftinfer.files.errors import CheckpointError
from tests.support.dflash import VARIANTS, variant_drafter
from tests.support.kind_factories import small_embeddings

# z-lab / vLLM tensor names (REFERENCES A3), no `model.` prefix.
LAYER = re.compile(
    r"^layers\.\d+\.("
    r"self_attn\.(q|k|v|o)_proj\.weight|self_attn\.(q|k)_norm\.weight|"
    r"(input|post_attention)_layernorm\.weight|mlp\.(gate|up|down)_proj\.weight)$"
)
DFLASH2_LAYER = re.compile(
    r"^layers\.\d+\.(attention|mlp)_conv\.(base_kernel|kernel_projection\.weight)$"
)
TOP = {"fc.weight", "hidden_norm.weight", "norm.weight"}
SELECTOR = {
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
    "candidate_selector.hidden_projection.weight",
}
QWEN3_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "tie_word_embeddings",
    "attention_bias",
)


def _shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_z_lab_layout_fields_and_tensors(variant, tmp_path):
    d = variant_drafter(variant)
    c = d.config
    write_drafter(tmp_path, d, {"target": "t"}, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    dflash2 = variant == "dflash2"
    lilicorr = variant.startswith("lilicorr")
    arch = (
        "LiLiCorrDraftModel" if lilicorr else "DFlash2DraftModel" if dflash2 else "DFlashDraftModel"
    )
    assert cfg["architectures"] == [arch]
    assert cfg["model_type"] == "qwen3" and cfg["hidden_act"] == "silu"
    for key in QWEN3_FIELDS:
        assert key in cfg, key
    H, V, L, N = c.hidden_size, c.vocab_size, c.num_target_layers, c.num_hidden_layers
    assert cfg["hidden_size"] == H and cfg["vocab_size"] == V and cfg["num_hidden_layers"] == N
    assert cfg["tie_word_embeddings"] is False and cfg["num_target_layers"] == L
    dc = cfg["dflash_config"]
    assert cfg["block_size"] == dc["block_size"] == c.block_size
    assert dc["mask_token_id"] == c.mask_token_id and 0 <= dc["mask_token_id"] < V
    # DFlash semantics: "output of layer t" = our tap (layer input) - 1; vLLM's slots = t + 1.
    assert dc["target_layer_ids"] == [j - 1 for j in c.tap_layer_ids]
    assert all(0 <= t <= L - 2 for t in dc["target_layer_ids"])
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [t + 1 for t in dc["target_layer_ids"]]
    assert ("causal" in dc) == (variant == "causal") and dc.get("causal", True) is True
    assert "is_causal" not in cfg  # vLLM's precedence would override the sliding layers
    if variant == "sliding":
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
        assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == 6
    else:
        assert cfg["layer_types"] == ["full_attention"] * N and cfg["sliding_window"] is None
    if dflash2:
        assert (dc["conv_kernel_size"], dc["conv_group_size"]) == (2, 8)
        assert (dc["selector_top_k"], dc["selector_rank"]) == (6, 5)
    elif variant == "lilicorr_conv":
        assert (dc["conv_kernel_size"], dc["conv_group_size"]) == (2, 8)
        assert "selector_top_k" not in dc
    else:
        assert not {"conv_kernel_size", "selector_top_k"} & set(dc)
    if lilicorr:  # ModelOpt's `projector_type` plus our geometry (REFERENCES E5)
        assert dc["projector_type"] == "lilicorr"
        assert (dc["lilicorr_top_k"], dc["lilicorr_rank"], dc["lilicorr_layers"]) == (6, 8, 2)
        assert dc["lilicorr_heads"] == 2
    else:
        assert "projector_type" not in dc

    shapes = _shapes(tmp_path / "model.safetensors")
    names = set(shapes)
    assert not any(n.startswith("model.") for n in names)
    assert "mask_hidden" not in names  # vLLM asserts there is none
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)  # the target's
    extra = names - TOP - {n for n in names if LAYER.match(n)}
    if dflash2:
        assert extra == SELECTOR | {n for n in names if DFLASH2_LAYER.match(n)}
        r, k, g = 5, 2, H // 8
        assert shapes["candidate_selector.predecessor_codebook"] == (V, r)
        assert shapes["candidate_selector.successor_codebook"] == (V, r)
        assert shapes["candidate_selector.hidden_projection.weight"] == (r, H)
        assert shapes["layers.0.attention_conv.base_kernel"] == (2, k, H)
        assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (2 * k * g, H)
    elif lilicorr:
        lattice = {n for n in names if n.startswith("lattice_correlator.")}
        conv = {n for n in names if DFLASH2_LAYER.match(n)}
        assert extra == lattice | conv and bool(conv) == (variant == "lilicorr_conv")
        assert shapes["lattice_correlator.slot_projection.weight"] == (8, H)
        assert shapes["lattice_correlator.token_projection.weight"] == (8, H)
        assert shapes["lattice_correlator.successor.weight"] == (8, 8)
        assert shapes["lattice_correlator.slot_embedding"] == (c.block_size, 8)
        assert sum(n.startswith("lattice_correlator.layers.") for n in lattice) == 2 * 6
    elif variant == "dspark":  # the references' names and shapes (REFERENCES A1 "DSpark")
        assert dc["sample_from_anchor"] is True
        assert cfg["markov_rank"] == 5 and cfg["markov_head_type"] == "vanilla"
        assert shapes["markov_head.markov_w1.weight"] == (V, 5)
        assert shapes["markov_head.markov_w2.weight"] == (V, 5)
        assert shapes["confidence_head.proj.weight"] == (1, H)
        assert shapes["confidence_head.proj.bias"] == (1,)
        assert extra == {n for n in names if n.startswith(("markov_head.", "confidence_head."))}
        assert len(extra) == 4
    else:
        assert extra == set()
        assert "sample_from_anchor" not in dc and "markov_rank" not in cfg
    assert shapes["fc.weight"] == (H, len(c.tap_layer_ids) * H)
    assert shapes["hidden_norm.weight"] == shapes["norm.weight"] == (H,)
    D = c.head_dim
    assert shapes["layers.0.self_attn.q_norm.weight"] == (D,)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (c.num_key_value_heads * D, H)
    assert sum(1 for n in names if LAYER.match(n)) == 11 * N

    # transformers reads it as a Qwen3 config; our loader reads it back exactly.
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(tmp_path))
    assert hf.model_type == "qwen3" and hf.num_hidden_layers == N and hf.head_dim == D
    back, meta = load_drafter(tmp_path, small_embeddings(d))
    assert back.config == c and meta["drafter_kind"] == "dflash"
    for name, t in d.trainable_state_dict().items():
        assert torch.equal(back.trainable_state_dict()[name], t), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speculators_layout(variant, tmp_path):
    d = variant_drafter(variant)
    c = d.config
    emb = small_embeddings(d)
    sub = write_speculators(
        tmp_path,
        d,
        "org/target",
        ["LlamaForCausalLM"],
        c.block_size - 1,
        lambda: emb["input_embeddings"],
        torch.float32,
        lambda: emb["output_embeddings"],
    )
    # speculators has no causal full-attention block, and reads a sliding window otherwise
    # than we train and vLLM serves it (`draftinfer.kinds.dflash.speculators`); it has no
    # LiLiCorr algorithm at all.
    if variant in ("causal", "sliding", "lilicorr", "lilicorr_conv"):
        assert sub is None and not (tmp_path / SPECULATORS_DIR).exists()
        return
    cfg = json.loads((sub / "config.json").read_text())
    dflash2, dspark = variant == "dflash2", variant == "dspark"
    algo = "dflash2" if dflash2 else "dspark" if dspark else "dflash"
    assert cfg["speculators_model_type"] == algo
    archs = {"dflash2": "DFlash2DraftModel", "dspark": "DSparkSpeculator"}
    assert cfg["architectures"] == [archs.get(algo, "DFlashSpeculator")]
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == c.num_hidden_layers
    assert layer["vocab_size"] == cfg["draft_vocab_size"] == c.vocab_size  # full vocabulary
    assert cfg["block_size"] == c.block_size and cfg["target_hidden_size"] == c.hidden_size
    # Slot numbering (vLLM capture before layer k) = DFlash t + 1 = our taps.
    assert cfg["aux_hidden_state_layer_ids"] == c.tap_layer_ids
    assert cfg["mask_token_id"] == c.mask_token_id
    assert cfg["sliding_window_non_causal"] is False and cfg["sample_from_anchor"] is dspark
    if dspark:  # every DSpark flag explicit: speculators' defaults are all "on"
        assert cfg["markov_rank"] == 5 and cfg["markov_head_type"] == "vanilla"
        assert cfg["enable_confidence_head"] is True
        assert cfg["confidence_head_with_markov"] is False
    else:
        assert not {"markov_rank", "enable_confidence_head"} & set(cfg)
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == algo and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}
    ]
    assert sc["verifier"] == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
    shapes = _shapes(sub / "model.safetensors")
    V, H = c.vocab_size, c.hidden_size
    assert shapes["embed_tokens.weight"] == shapes["lm_head.weight"] == (V, H)
    assert not {"d2t", "t2d", "mask_hidden"} & set(shapes)
    own = {n if not n.endswith("_codebook") else n + ".weight" for n in d.trainable_state_dict()}
    assert set(shapes) == own | {"embed_tokens.weight", "lm_head.weight"}
    if dflash2:
        assert cfg["conv_kernel_size"] == 2 and cfg["selector_top_k"] == 6
        assert shapes["candidate_selector.predecessor_codebook.weight"] == (V, 5)


def _edited(tmp_path, edit):
    d = variant_drafter("dflash")
    write_drafter(tmp_path, d, {"target": "t"}, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[9]), "target_layer_ids + 1"),
        (lambda c: c["dflash_config"].update(block_size=4), "block_size"),
        (lambda c: c["dflash_config"].update(output_multiplier=0.2), "output_multiplier"),
        (lambda c: c.update(markov_rank=4, markov_head_type="gated"), "markov_head_type"),
        (lambda c: c.update(is_neox_style=False), "is_neox_style"),
        (lambda c: c["dflash_config"].pop("target_layer_ids"), "target_layer_ids"),
        (
            lambda c: (
                c["dflash_config"].update(target_layer_ids=[4]),
                c.update(eagle_aux_hidden_state_layer_ids=[5]),
            ),
            "never tapped",
        ),
    ],
)
def test_configs_this_code_cannot_serve_exactly_are_refused(tmp_path, edit, needle):
    d = _edited(tmp_path, edit)
    with pytest.raises(CheckpointError, match=re.escape(needle)) as e:
        load_drafter(tmp_path, small_embeddings(d))
    assert "\n" not in str(e.value)


def test_engine_written_is_causal_is_read(tmp_path):
    """An engine-written checkpoint says causal at the top level (vLLM reads it first)."""
    d = _edited(tmp_path, lambda c: c.update(is_causal=True))
    from draftinfer.files.checkpoint import read_drafter_config

    _, arch, _ = read_drafter_config(tmp_path)
    assert arch.causal_block is True and d.config.causal_block is False


@pytest.mark.parametrize("variant", ["dflash", "causal", "sliding", "dspark"])
def test_vllm_reader_rebuilds_the_runners_logits(variant, tmp_path):
    """vLLM's `dflash` / `dspark` drafter rebuilt from the exported files alone
    (`engine_readers.BlockDrafterFiles`: plain torch over the stored tensors, the per-layer
    attention vLLM resolves from the config, the Markov bias applied sequentially from the
    anchor, the confidence head) gives our runner's draft logits and confidences, draft by
    draft, with the same tokens chosen. The chosen tokens are not the argmax, so a Markov bias
    keyed on the wrong predecessor would show."""
    from tests.support.dflash import runner_logits
    from tests.support.engine_readers import BlockDrafterFiles

    d = variant_drafter(variant)
    c = d.config
    write_drafter(tmp_path, d, {"target": "t"}, dtype=torch.float32)
    files = BlockDrafterFiles.read(tmp_path)
    g = torch.Generator().manual_seed(3)
    T, anchor, k = 16, 9, c.max_drafts
    ids = torch.randint(0, c.vocab_size, (1, T), generator=g)
    feats = 2 * torch.randn(1, T, c.features.width(c.hidden_size), generator=g)
    chosen = torch.randint(0, c.vocab_size, (k,), generator=g)
    props: list = []
    with torch.no_grad():
        ours = runner_logits(d, ids, feats, torch.arange(T)[None], anchor, k, chosen, props)
        theirs = files.draft(
            d.embed_tokens.weight,
            d.lm_head.weight,
            feats[0, : anchor + 1],
            int(ids[0, anchor + 1]),
            k,
            lambda j, _logits: int(chosen[j]),
        )
    assert ours.shape == theirs["logits"].shape == (k, c.vocab_size)
    torch.testing.assert_close(ours, theirs["logits"], rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs["logits"].argmax(-1))
    if variant == "dspark":
        assert files.cfg["markov_rank"] == 5 and k == c.block_size  # the anchor slot drafts
        torch.testing.assert_close(
            props[0].confidence[0], theirs["confidence"], rtol=1e-4, atol=1e-5
        )
        # Keying draft 2's bias on another predecessor (the argmax instead of the chosen
        # token) would move its logits by more than the tolerance.
        w1 = files.tensors["markov_head.markov_w1.weight"]
        w2 = files.tensors["markov_head.markov_w2.weight"]
        other = int(ours[0].argmax())
        assert other != int(chosen[0])
        assert float((w2 @ w1[chosen[0]] - w2 @ w1[other]).abs().max()) > 1.0
    else:
        assert theirs["confidence"] is None and props[0].confidence is None
