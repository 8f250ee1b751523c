"""The `mtp` kind on the GLM families (issue 48, item 2; DESIGN conventions 10 and 15):
`glm4_moe` (GLM-4.5/4.6/4.7: GQA with partial rotary, the q/k norm, q/k/v biases, routed
experts) and `glm4_moe_lite` (GLM-4.7-Flash: DeepSeek-V3's MLA layer). Each module's block is
the family's own native layer at index L + k, and the checkpoint's own MTP layers
(`model.layers.{L+k}.*`, `num_nextn_predict_layers`) are served as released (`drafter=native`).

Oracles: vLLM's GLM MTP forward around transformers' own decoder layer of the family
(`tests/support/glm_mtp.py`; transformers does not model GLM-4.7-Flash's MTP layer), plain
greedy decoding of the native target, a fresh prefill of each module's cache, and vLLM's
loading rules (`tests/support/vllm_mtp_loader.py`) applied to the target's own files."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.proposer import causal_attn, greedy_chooser
from draftinfer.files.checkpoint import load_released_drafter, write_drafter
from draftinfer.files.loading import load_native_target
from draftinfer.models.decoder import CachedAttention
from draftinfer.models.mla import LatentAttention
from draftinfer.models.moe import MoEBlock
from tests.support.glm_mtp import save_glm_with_mtp
from tests.support.moe_models import glm4_moe_config, glm4_moe_lite_config
from tests.support.mtp_rounds import (
    MTPSequence,
    assert_compiled_round_equals_eager,
    assert_kv_equal,
)
from tests.support.vllm_mtp_loader import load_mtp

pytestmark = pytest.mark.usefixtures("one_thread")

YARN = {
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
CONFIGS = {
    # Half of each 8-wide head rotates; q/k norm and q/k/v biases on; two KV heads of four.
    "glm4_moe": lambda: glm4_moe_config(layers=3, hidden=32, heads=4, kv_heads=2, head_dim=8),
    # MLA with a q LoRA and YaRN (the softmax scale's mscale), one dense layer listed.
    "glm4_moe_lite": lambda: glm4_moe_lite_config(layers=3, hidden=32, heads=2, yarn=YARN),
}
ATTENTION = {"glm4_moe": (CachedAttention, "gqa"), "glm4_moe_lite": (LatentAttention, "mla")}
L = 3


@functools.lru_cache(maxsize=4)
def released_target(family: str, n_mtp: int):
    """(path, oracle): the family's tiny target shipping `n_mtp` MTP layers."""
    root = Path(tempfile.mkdtemp(prefix=f"{family}_mtp{n_mtp}_"))
    return save_glm_with_mtp(CONFIGS[family](), root / "target", n_mtp=n_mtp, seed=n_mtp)


def _main(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), attn_implementation="eager", dtype=torch.float32
    ).eval()


def _shared(model) -> dict[str, torch.Tensor]:
    return {
        "input_embeddings": model.get_input_embeddings().weight,
        "output_embeddings": model.lm_head.weight,
    }


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("n_mtp", [1, 2])
def test_released_layers_equal_the_oracle(family, n_mtp):
    """`drafter=native` reads the target's own MTP layers into modules whose block is the
    family's native layer; module k's logits equal vLLM's GLM MTP forward around transformers'
    layer, chained as vLLM chains (module k+1 consumes module k's pre-norm output), module k's
    rows at position pos + k, the embedding at position 0 zeroed."""
    path, oracle = released_target(family, n_mtp)
    main = _main(path)
    ours, meta = load_released_drafter(path, _shared(main))
    assert meta["released"] and ours.config.n_predict == n_mtp and ours.config.own_layer
    attn_cls, _ = ATTENTION[family]
    for layer in ours.layers:
        assert isinstance(layer.block.self_attn, attn_cls) and isinstance(layer.block.mlp, MoEBlock)
    torch.manual_seed(1)
    B, T = 2, 12
    ids = torch.randint(3, 500, (B, T + n_mtp))
    pos = torch.arange(T)[None].expand(B, -1)
    embed = main.get_input_embeddings()
    with torch.no_grad():
        h = main(ids[:, :T], output_hidden_states=True).hidden_states[-1]  # post final norm
        h_ours = h_theirs = h
        for k in range(n_mtp):
            tok = ids[:, 1 + k : 1 + k + T]
            k_pos = pos + k
            emb = torch.where((k_pos == 0)[..., None], 0.0, embed(tok))
            pre = oracle.pre_norm(k, emb, h_theirs, k_pos)
            want = main.lm_head(oracle.layers[k].post_norm(pre))
            normed, pre_ours = ours(k, tok, h_ours, k_pos, causal_attn)
            diff = (ours.logits(normed) - want).abs().max().item()
            assert diff <= 1e-5 * want.abs().max().item() + 1e-6, (k, diff)
            h_ours, h_theirs = ours.carry(normed, pre_ours), pre


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_caches_after_forced_rejections_equal_a_fresh_prefill(family):
    """Rounds of K = N = 2 drafts with r = 0, 1, 2 rejected (convention 10): every module's
    cache (GQA K/V with partial rotary; MLA's latent) at the committed rows equals a fresh
    prefill of the committed prefix with target features, and the cached drafts equal the
    no-cache reference's."""
    path, _ = released_target(family, 2)
    d, _ = load_released_drafter(path, _shared(_main(path)))
    seq = MTPSequence(d, M=40, seed=2)
    prop = seq.proposer()
    P = 9
    prop.propose(prop.admit(seq.rows(0, P)), torch.tensor([0]), 2)
    a, b = P, P + 1
    for accept in (2, 0, 1, 2, 1, 0, 0):
        end = seq.round(prop, a, b, 2, accept)
        assert_kv_equal(prop.kv_snapshot(0, b), seq.fresh_kv(b), f"accept {accept} at {b}")
        a, b = b, end
    fresh = seq.proposer()
    got, _ = fresh.propose(fresh.admit(seq.rows(0, 20)), torch.tensor([4]), 4)
    want, _ = type(prop).reference_drafts(
        d, seq.tok[1:21], seq.feat[:20], seq.pos[:20], 4, greedy_chooser
    )
    assert got[0].tolist() == want


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_served_as_released_is_lossless_and_reuses_modules(family):
    """The native target drafted for by its own released MTP layers through the engine:
    greedy output equals plain greedy at K = N = 2 and at K = 4 (modules reused, step % N),
    batch 1 and 3 with mixed prompt lengths. The layers are random: their drafts are accepted
    about never; the acceptance paths are forced in the cache test above."""
    path, _ = released_target(family, 2)
    target = load_native_target(path, "cpu", torch.float32, 4, 128)
    d, _ = load_released_drafter(path, target.shared_weights())
    lengths = (7, 21, 3)
    prompts = [[5 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate(lengths)]
    plain = greedy_generate(target, prompts, 20, [2])
    for k in (2, 4):
        for batch in (1, 3):
            dec = SpecDecoder(target, d, k, max_batch=batch, max_model_len=128)
            reqs = [Request(p, max_tokens=20, stop_token_ids=(2,)) for p in prompts]
            outs, _ = dec.generate(reqs)
            assert [o.token_ids for o in outs] == plain, (k, batch)
            assert sum(len(o.accepted) for o in outs) > 0  # rounds were drafted


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_released_layers_exported_load_in_vllm_as_the_originals(family, tmp_path):
    """The released layers read by `drafter=native` and exported again in the `deepseek`
    layout load into vLLM's GLM MTP model (by its loading rules) exactly as the target's own
    files do: the same parameters, every tensor of the export read, experts per expert."""
    path, _ = released_target(family, 2)
    d, _ = load_released_drafter(path, _shared(_main(path)))
    write_drafter(tmp_path / "export", d, {"target": str(path), "serving_k": 2}, torch.float32)
    _, attention = ATTENTION[family]
    original = load_mtp(
        json.loads((path / "config.json").read_text()),
        load_file(str(path / "model.safetensors")),
        attention,
    )
    exported = load_mtp(
        json.loads((tmp_path / "export" / "config.json").read_text()),
        load_file(str(tmp_path / "export" / "model.safetensors")),
        attention,
    )
    assert exported.ignored == []
    assert sorted(exported.params) == sorted(original.params)
    for name, t in original.params.items():
        assert torch.equal(exported.params[name], t), name


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_training_init_native_starts_from_the_released_layer(family, tmp_path):
    """`drafter.init=native_all` on a GLM target: module k starts as released layer k % N
    (3 modules, 2 released layers), every tensor equal to what `drafter=native` serves (itself
    checked against the oracle above), the block the family's own layer."""
    from drafttrain.registry import InitContext, train_spec
    from tests.support.kind_factories import frozen_target

    path, _ = released_target(family, 2)
    released, _ = load_released_drafter(path, _shared(_main(path)))
    served = released.trainable_state_dict()
    spec = train_spec("mtp")
    d = spec.init_drafter(
        spec.config_class(n_predict=3, init="native_all"),
        InitContext(frozen_target(str(path)), None, None, tmp_path),
    )
    assert d.config.own_layer and d.config.block == "native"
    own = d.trainable_state_dict()
    assert len(own) == 3 * len(served) // 2
    for name, t in own.items():
        _, k, rest = name.split(".", 2)
        want = served[f"layers.{int(k) % 2}.{rest}"]
        assert torch.equal(t, want.to(t.dtype)), name


def test_glm4_moe_released_layers_equal_transformers_mtp_model():
    """GLM-4.5's MTP layer as transformers 5.24 models it (`Glm4MoeConfig.num_mtp_layers`,
    `MtpModel.from_pretrained` reading the target's files by its own conversion, experts per
    expert): module k's logits equal ours, chained with the pre-norm carry as vLLM serves it.
    (GLM-4.7-Flash has no such model in transformers: the oracle above only.)"""
    from tests.support.deepseek_mtp import assert_chained_modules_equal, mtp_oracle

    path, _ = released_target("glm4_moe", 2)
    main, theirs = mtp_oracle(path)
    ours, _ = load_released_drafter(path, _shared(main))
    torch.manual_seed(3)
    B, T = 2, 10
    ids = torch.randint(3, 500, (B, T + 2))
    assert_chained_modules_equal(main, theirs, ours, ids, T, 2)


@pytest.mark.slow  # traces every module under dynamic shapes
def test_compiled_round_equals_the_eager_one():
    """GLM-4.5's block (GQA with partial rotary, the q/k norm, routed experts) in the round the
    engine compiles: equal to the eager proposer (`mtp_rounds.assert_compiled_round_equals_eager`;
    GLM-4.7-Flash's MLA block is DeepSeek-V3's layer, compiled in `test_deepseek_v3_mtp`)."""
    path, _ = released_target("glm4_moe", 2)
    d, _ = load_released_drafter(path, _shared(_main(path)))
    assert_compiled_round_equals_eager(d, N=2)
