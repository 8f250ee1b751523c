"""Independent readers of exported drafters: each reads one export layout the way its engine's
documented rule reads it (`../shared/REFERENCES.md`; docs/training.md names the engine files
checked), with plain `json` and `safetensors`, never through `draftinfer.files.checkpoint`, and
checks every engine-facing field and tensor against what training recorded in the run
directory (`RunRecord`: the latest checkpoint's `state.json` and `drafter.safetensors`, the
draft-vocabulary cache, the target's own `config.json` and weights). A writer and a loader of
ours that agreed on a wrong convention would pass our round-trip tests; they fail here.

A reader returns the `EngineView` it read: the values the engine acts on in our own terms
(draft vocabulary as target ids, layer-tap slots, mask token, ...), which the tests compare
across the layouts of one export and with an HF oracle (`tests/contracts/test_engine_readers.py`).

`BlockDrafterFiles` goes one step further for block drafters: it rebuilds vLLM's `dflash` /
`dspark` drafter from the exported files with plain torch (the layers, the per-layer attention
vLLM resolves, the Markov bias and confidence head), so tests compare its logits with our
runner's and each layer's output with what our layers computed
(`tests/kinds/test_dflash_export.py`, `tests/kinds/test_dflash_layer_attention.py`).

`LAYOUTS` lists the layouts of every registered kind; a new kind adds its readers there (the
test fails for a registered kind without an entry). `speculators_kinds()` is the kinds whose
spec writes a speculators folder (`DrafterSpec.speculators_layout`).
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

# ---- plain file access ---------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder: `model.safetensors`, or the shards an index maps
    (the engine's rule: the index's `weight_map` says which file holds each name)."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return read_tensors(folder / "model.safetensors")
    weight_map = read_json(index)["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors = read_tensors(folder / shard)
        out.update({k: v for k, v in tensors.items() if weight_map.get(k) == shard})
    assert set(out) == set(weight_map), "index names tensors its shards do not hold"
    return out


def ids_of_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """The engines' rule for `d2t` (vLLM `llama_eagle3.py`, SGLang `hot_token_id`): an offset
    per draft id, target id = `i + d2t[i]`."""
    return torch.arange(d2t.numel()) + d2t.long()


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's fields of a target `config.json` (nested for Qwen3-VL)."""
    return config.get("text_config", config)


# ---- what training recorded ------------------------------------------------------------------


@dataclass
class RunRecord:
    """A training run's own record: the latest checkpoint's `state.json` and drafter tensors
    (module names), the draft vocabulary training chose (target ids, from the run's
    draft-vocabulary cache; None for a kind without one), the resolved target folder, its
    `config.json` and its weights."""

    run_dir: Path
    state: dict[str, Any]
    drafter: dict[str, torch.Tensor]
    draft_vocab: torch.Tensor | None
    target_dir: Path
    target_config: dict[str, Any]
    target_weights: dict[str, torch.Tensor] = field(repr=False)

    @property
    def arch(self) -> dict[str, Any]:
        return self.state["drafter_config"]

    @property
    def num_layers(self) -> int:
        return int(text_config(self.target_config)["num_hidden_layers"])

    def target_head(self) -> torch.Tensor:
        """The target's output embedding: `lm_head.weight`, or the input embedding a tied
        target shares (what HF, vLLM and speculators read when no head is stored)."""
        if any(k.endswith("lm_head.weight") for k in self.target_weights):
            return self.target_tensor("lm_head.weight")
        assert text_config(self.target_config).get("tie_word_embeddings", True)
        return self.target_tensor("embed_tokens.weight")

    def target_tensor(self, suffix: str) -> torch.Tensor:
        """The target's tensor whose name ends in `suffix` (shortest match, like speculators'
        `load_model_layers`)."""
        names = sorted((k for k in self.target_weights if k.endswith(suffix)), key=len)
        assert names, f"target has no tensor *{suffix}"
        return self.target_weights[names[0]]


def run_record(run_dir: str | Path) -> RunRecord:
    import yaml

    from draftinfer.files.paths import resolve_path

    run = Path(run_dir)
    ckpts = run / "checkpoints"
    latest = ckpts / (ckpts / "latest").read_text().strip()
    state = read_json(latest / "state.json")
    caches = sorted((run / "cache" / "draft_vocab").glob("draft_vocab_*.safetensors"))
    vocab = None
    if caches:
        assert len(caches) == 1, caches
        cache = read_tensors(caches[0])
        vocab = ids_of_offsets(cache["d2t"])
        # The cache's two maps describe one set: its bool mask marks exactly those ids.
        assert torch.equal(torch.nonzero(cache["t2d"]).flatten(), vocab)
    args = yaml.safe_load((run / "training_args.yaml").read_text())
    target_dir = Path(resolve_path(args["target"]["name_or_path"]))
    return RunRecord(
        run,
        state,
        read_tensors(latest / "drafter.safetensors"),
        vocab,
        target_dir,
        read_json(target_dir / "config.json"),
        read_weights(target_dir),
    )


# ---- what an engine reads --------------------------------------------------------------------


@dataclass
class EngineView:
    """What one engine reads from one layout, in our terms."""

    layout: str
    draft_vocab: torch.Tensor | None = None  # target ids the drafter's head rows stand for
    layer_taps: list[int] | None = None  # HF `hidden_states` indices the engine feeds
    final_hidden: str | None = None  # which target final hidden the engine feeds
    mask_token_id: int | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)


def _close(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    """A tensor as written (export dtype) against training's fp32 value cast the same way."""
    assert a.shape == b.shape, (name, a.shape, b.shape)
    assert torch.equal(a, b.to(a.dtype)), name


def _check_rope(cfg: dict[str, Any], rec: RunRecord, rope_parameters: bool) -> None:
    """RoPE as the engines build it from the drafter's config: the target's theta and scaling;
    for an M-RoPE target `mrope_section` with `mrope_interleaved: true` under `rope_scaling`
    and `rope_parameters` (vLLM `uses_mrope` / `get_rope`, docs/training.md)."""
    tc = text_config(rec.target_config)
    want = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    theta = want.pop("rope_theta", tc.get("rope_theta"))
    assert cfg["rope_theta"] == theta
    got = dict(cfg["rope_scaling"] or {})
    for key, value in want.items():
        if key != "rope_type" or value != "default":
            assert got.get(key) == value, (key, got.get(key), value)
    if "mrope_section" in want:
        assert got["mrope_interleaved"] is True
        if rope_parameters:  # vLLM reads M-RoPE from `rope_parameters` first
            assert cfg["rope_parameters"] == {"rope_theta": theta, **got}
        assert sum(got["mrope_section"]) == cfg["head_dim"] // 2


def _eagle3_tensor_names(cfg: dict[str, Any], prefix0: str) -> dict[str, tuple[int, ...]]:
    """The tensors vLLM's `llama_eagle3.py` / SGLang's `llama_eagle3.py` load, with shapes:
    `fc` (3 taps -> H), layer 0 attending over `[embedding, feature]` (2H wide q/k/v, plus
    `hidden_norm`), layers >= 1 plain, `norm`, `lm_head` over the draft vocabulary, `d2t`,
    `t2d` (vLLM skips it; SGLang reads it)."""
    H, tH, ffn = cfg["hidden_size"], cfg["target_hidden_size"], cfg["intermediate_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    Dd, V = cfg["draft_vocab_size"], cfg["vocab_size"]
    n_aux = len(cfg["eagle_aux_hidden_state_layer_ids"])
    names = {
        "fc.weight": (H, n_aux * tH),
        "norm.weight": (H,),
        "lm_head.weight": (Dd, H),
        "d2t": (Dd,),
        "t2d": (V,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = prefix0 if i == 0 else f"layers.{i}."
        width = 2 * H if i == 0 else H
        names.update(
            {
                p + "self_attn.q_proj.weight": (nq * hd, width),
                p + "self_attn.k_proj.weight": (nkv * hd, width),
                p + "self_attn.v_proj.weight": (nkv * hd, width),
                p + "self_attn.o_proj.weight": (H, nq * hd),
                p + "mlp.gate_proj.weight": (ffn, H),
                p + "mlp.up_proj.weight": (ffn, H),
                p + "mlp.down_proj.weight": (H, ffn),
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
            }
        )
        if i == 0:
            names[p + "hidden_norm.weight"] = (H,)
    return names


def _vllm_to_module(name: str) -> str:
    """vLLM's rename of a single-layer EAGLE-3 checkpoint: `midlayer.` is layer 0."""
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def _eagle3_common(
    cfg, tensors, rec: RunRecord, layout: str, prefix0: str, rope_parameters: bool = True
) -> EngineView:
    a, tc, L = rec.arch, text_config(rec.target_config), rec.num_layers
    # Sizes the engine builds the model from, against the target and the trained drafter.
    assert cfg["vocab_size"] == tc["vocab_size"] and cfg["target_hidden_size"] == tc["hidden_size"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim"):
        assert cfg[key] == a[key], key
    assert cfg["num_key_value_heads"] == a["num_key_value_heads"]
    assert cfg["num_hidden_layers"] == a["num_hidden_layers"]
    assert cfg["draft_vocab_size"] == a["draft_vocab_size"] < cfg["vocab_size"]
    assert cfg["max_position_embeddings"] >= tc["max_position_embeddings"]
    _check_rope(cfg, rec, rope_parameters)
    # Names and shapes as the engine loads them; every one present, nothing else.
    want = _eagle3_tensor_names(cfg, prefix0)
    want.update({k: tuple(v.shape) for k, v in tensors.items() if k == "mask_hidden"})
    got = {k: tuple(v.shape) for k, v in tensors.items() if k != "embed_tokens.weight"}
    assert got == want, sorted(set(got) ^ set(want))
    # Values: the trained drafter's, under the engine's names.
    for name, t in tensors.items():
        if name != "embed_tokens.weight":
            _close(t, rec.drafter[_vllm_to_module(name)], name)
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    ids = ids_of_offsets(d2t)
    assert int(ids.min()) >= 0 and int(ids.max()) < cfg["vocab_size"]
    assert torch.equal(torch.nonzero(t2d).flatten(), ids)  # t2d is the mask of the same set
    aux = cfg["eagle_aux_hidden_state_layer_ids"]
    assert all(0 <= j < L for j in aux) and len(set(aux)) == len(aux)
    return EngineView(layout, draft_vocab=ids, layer_taps=list(aux), tensors=tensors)


def vllm_eagle3(export: Path, rec: RunRecord) -> EngineView:
    """vLLM / SGLang EAGLE-3 (`LlamaForCausalLMEagle3`): `config.json` + `model.safetensors`
    at the export's root. Aux taps: vLLM `get_eagle3_aux_layers_from_config` reads
    `eagle_aux_hidden_state_layer_ids` as is, SGLang `eagle_config.eagle_aux_hidden_state_layer_ids`;
    slot k is captured before layer k runs (= HF `hidden_states[k]`)."""
    cfg = read_json(export / "config.json")
    tensors = read_tensors(export / "model.safetensors")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (
        cfg["eagle_aux_hidden_state_layer_ids"]
        == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert cfg["norm_before_residual"] == rec.arch["norm_before_residual"]
    assert cfg["tie_word_embeddings"] is False and cfg["hidden_act"] == "silu"
    assert cfg["torch_dtype"] == str(next(iter(_floats(tensors))).dtype).removeprefix("torch.")
    if "mrope_section" in (text_config(rec.target_config).get("rope_parameters") or {}):
        assert cfg["target_model_type"] == rec.target_config["model_type"]
    prefix0 = "midlayer." if cfg["num_hidden_layers"] == 1 else "layers.0."
    return _eagle3_common(cfg, tensors, rec, "vllm-eagle3", prefix0)


def _floats(tensors: dict[str, torch.Tensor]):
    return (t for t in tensors.values() if t.is_floating_point())


def vllm_ptd(export: Path, rec: RunRecord) -> EngineView:
    """vLLM parallel drafting on the EAGLE-3 layout: `parallel_drafting: true`, the mask token
    under `ptd_token_id` / `pard_token` (older) and `mask_token_id` (newer), `mask_hidden`
    `[1, 1, 3H]` at the pre-`fc` aux width, and the K trained."""
    view = vllm_eagle3(export, rec)
    cfg = read_json(export / "config.json")
    assert cfg["parallel_drafting"] is True
    tok = cfg["ptd_token_id"]
    assert tok == cfg["pard_token"] == cfg["mask_token_id"] == rec.arch["mask_token_id"]
    assert 0 <= tok < cfg["vocab_size"]
    assert tuple(view.tensors["mask_hidden"].shape) == (1, 1, 3 * cfg["target_hidden_size"])
    assert cfg["parallel_k"] == rec.arch["parallel_k"] == rec.state["objective"]["serving_k"]
    view.layout, view.mask_token_id = "vllm-ptd", tok
    return view


def _verifier_dir(name: str) -> Path | None:
    """speculators' rule (`utils/loading.py::_resolve_file`): a local directory if one exists at
    `name` (a relative name from the working directory), else a hub id. The export writes an
    absolute path for a target with no hub id, so it resolves from any working directory."""
    local = Path(name)
    return local if local.is_absolute() and local.is_dir() else None


def _check_verifier(folder: Path, cfg: dict[str, Any], rec: RunRecord) -> None:
    """speculators' verifier: a hub id, or the target's own directory by its absolute path;
    never anything inside the folder (no copy of, or link to, the target's files)."""
    from drafttrain.frozen.target import is_hub_id

    assert not (folder / "verifier").exists(), "the export holds a copy of the target"
    verifier = cfg["speculators_config"]["verifier"]
    assert verifier["architectures"] == rec.target_config["architectures"]
    name = verifier["name_or_path"]
    vdir = _verifier_dir(name)
    if vdir is None:  # a hub id; `export.hub_base_model` or the target's own name
        assert is_hub_id(name), f"verifier {name!r} is neither an absolute directory nor a hub id"
        return
    vcfg = read_json(vdir / "config.json")
    assert vcfg["architectures"] == verifier["architectures"]
    assert {k: v for k, v in vcfg.items() if k != "_name_or_path"} == {
        k: v for k, v in rec.target_config.items() if k != "_name_or_path"
    }
    for k, v in read_weights(vdir).items():
        assert torch.equal(v, rec.target_weights[k]), k


def speculators_eagle3(export: Path, rec: RunRecord, stype: str = "eagle3") -> EngineView:
    """vllm-project/speculators 0.9.0 `Eagle3DraftModel` (`speculators/config.py`, `model.py`,
    `models/eagle3/{config,core}.py`): `speculators_model_type`, `transformer_layer_config`,
    `speculators_config.verifier{name_or_path, architectures}`, tensors under module names
    (`layers.0.*`, no `midlayer.*`), the target's `embed_tokens`, `d2t`/`t2d` when pruned."""
    folder = export / "speculators"
    cfg = read_json(folder / "config.json")
    tensors = read_tensors(folder / "model.safetensors")
    assert cfg["speculators_model_type"] == stype
    assert cfg["speculators_config"]["algorithm"] == stype
    layer = cfg["transformer_layer_config"]  # a transformers config: model_type picks classes
    assert layer["model_type"] == "llama"
    assert layer["vocab_size"] == text_config(rec.target_config)["vocab_size"]
    assert cfg["norm_before_residual"] == rec.arch["norm_before_residual"]
    keys = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids")
    flat = {**layer, **{k: cfg[k] for k in keys}}
    # speculators requires distinct taps within [0, L] (`resolve_target_layer_ids`).
    aux = cfg["eagle_aux_hidden_state_layer_ids"]
    assert len(set(aux)) == len(aux) and all(0 <= j <= rec.num_layers for j in aux)
    proposal = cfg["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == rec.state["objective"]["serving_k"]
    _check_verifier(folder, cfg, rec)
    # The shared embedding speculators would otherwise fetch from the verifier.
    assert torch.equal(
        tensors["embed_tokens.weight"],
        rec.target_tensor("embed_tokens.weight").to(tensors["embed_tokens.weight"].dtype),
    )
    return _eagle3_common(flat, tensors, rec, f"speculators-{stype}", "layers.0.", False)


def speculators_peagle(export: Path, rec: RunRecord) -> EngineView:
    """speculators' `PEagleDraftModel` (`models/peagle/{config,core}.py`): the EAGLE-3 layout
    plus `mask_hidden` and `mask_token_id` at the top level of its config."""
    view = speculators_eagle3(export, rec, "peagle")
    cfg = read_json(export / "speculators" / "config.json")
    view.mask_token_id = cfg["mask_token_id"]
    assert view.mask_token_id == rec.arch["mask_token_id"]
    return view


# ---- MTP ----------------------------------------------------------------------------------------
_MTP_OWN = ("enorm", "hnorm", "eh_proj")


def _mtp_module_name(L: int, name: str) -> str | None:
    """vLLM `deepseek_mtp.py` `_rewrite_spec_layer_name`, expressed in our module's roles:
    `model.layers.{L+k}.{enorm,hnorm,eh_proj}` kept, `shared_head.norm` the module's final
    norm, `shared_head.head` / `embed_tokens` the target's (shared), the rest the block
    (vLLM inserts `mtp_block.`). None for the shared copies."""
    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
    assert m and int(m.group(1)) >= L, name
    k, rest = int(m.group(1)) - L, m.group(2)
    if rest.startswith(("shared_head.head.", "embed_tokens.")):
        return None
    if rest.startswith("shared_head.norm."):
        return f"layers.{k}.norm.{rest[len('shared_head.norm.') :]}"
    if rest.split(".")[0] in _MTP_OWN:
        return f"layers.{k}.{rest}"
    return f"layers.{k}.block.{rest}"


def _mtp_check(cfg: dict, tensors: dict, rec: RunRecord, layout: str) -> EngineView:
    tc = rec.target_config
    L, N = rec.num_layers, cfg["num_nextn_predict_layers"]
    H, V = text_config(tc)["hidden_size"], text_config(tc)["vocab_size"]
    meta = cfg["drafttrain"]
    assert N == meta["n_predict"] == rec.arch["n_predict"] == rec.state["objective"]["serving_k"]
    assert cfg["architectures"] == (text_config(tc).get("architectures") or tc["architectures"])
    # A stitched multimodal target keeps its decoder's fields nested, as the target had them.
    body = {**cfg, **text_config(cfg)}
    assert body["num_hidden_layers"] == L
    ours = {k: v for k, v in body.items() if k not in ("drafttrain", "num_nextn_predict_layers")}
    theirs = text_config(tc)
    # The target family's own config, field for field (dtype aside): what the engine's
    # `hf_config_override` rewrites into the MTP architecture.
    for key, value in theirs.items():
        if key not in (
            # The export's own N; a target that ships MTP layers (DeepSeek-V3) has its own.
            "num_nextn_predict_layers",
            "torch_dtype",
            "dtype",
            "_name_or_path",
            "architectures",
            "transformers_version",
        ):
            assert ours.get(key) == value, (key, ours.get(key), value)
    for k in range(N):
        p = f"model.layers.{L + k}."
        assert tuple(tensors[p + "eh_proj.weight"].shape) == (H, 2 * H)  # [emb | hidden] -> H
        for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            assert tuple(tensors[p + n].shape) == (H,)
        head = tensors[p + "shared_head.head.weight"]
        _close(head, rec.target_head(), p + "shared_head.head.weight")
        # The block's attention output and MLP (dense, or routed with its experts per expert,
        # DeepSeek-V3's MoE block), whatever the query projection (MLA: q_a_proj / q_b_proj).
        assert p + "self_attn.o_proj.weight" in tensors, p + "self_attn.o_proj.weight"
        assert any(n.startswith(p + "self_attn.q") for n in tensors), p + "self_attn.q*"
        assert any(n.startswith(p + "mlp.") and n.endswith("down_proj.weight") for n in tensors)
    emb = tensors[f"model.layers.{L}.embed_tokens.weight"]  # vLLM lifts it to the shared one
    _close(emb, rec.target_tensor("embed_tokens.weight"), "embed_tokens")
    assert tuple(emb.shape) == (V, H)
    seen = set()
    for name, t in tensors.items():
        module = _mtp_module_name(L, name)
        if module is None:
            continue
        per_expert = re.match(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", module)
        if module not in rec.drafter and per_expert:
            # Routed experts per expert on disk (what vLLM's loader maps), stacked in the module:
            # gate and up concatenated in `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`.
            base, e, which = per_expert.group(1), int(per_expert.group(2)), per_expert.group(3)
            stacked = base + (".down_proj" if which == "down" else ".gate_up_proj")
            ours = rec.drafter[stacked][e]
            if which != "down":
                half = ours.shape[0] // 2
                ours = ours[:half] if which == "gate" else ours[half:]
            _close(t, ours, name)
            seen.add(stacked)
            continue
        _close(t, rec.drafter[module], name)
        seen.add(module)
    assert seen == set(rec.drafter), sorted(set(rec.drafter) ^ seen)
    # What the engine feeds module 0: the tensor the target forward returns, after the final
    # norm in vLLM's models; the run must have trained on that one.
    assert meta["mtp_feature_tap"] == rec.arch["mtp_feature_tap"] == "post_norm"
    return EngineView(layout, final_hidden="post_norm", tensors=tensors)


def mtp_standalone(export: Path, rec: RunRecord) -> EngineView:
    """The standalone draft directory vLLM loads as `speculative_config.model` with
    `method: mtp` (`speculative.py` `hf_config_override`, `deepseek_mtp.py` loader): the
    target family's `config.json` with `num_nextn_predict_layers = N`, the modules'
    tensors `model.layers.{L+k}.*` and nothing of the target's own layers."""
    cfg = read_json(export / "config.json")
    tensors = read_tensors(export / "model.safetensors")
    L = rec.num_layers
    assert all(int(n.split(".")[2]) >= L for n in tensors), "target layers in a draft directory"
    return _mtp_check(cfg, tensors, rec, "vllm-mtp-standalone")


def mtp_stitched(export: Path, rec: RunRecord) -> EngineView:
    """The modules stitched into a copy of the target (`python -m drafttrain.stitch`), read
    through the index as vLLM (no draft model) and transformers' `MtpModel` read a target:
    every target tensor unchanged, the modules' tensors as in the standalone directory."""
    import subprocess
    import sys

    out = Path(tempfile.mkdtemp(prefix="stitched_")) / "target"
    # --replace: a target that ships MTP layers (zoo:deepseek-tiny) gets the modules in their
    # place; for one that ships none it changes nothing.
    argv = ["drafttrain.stitch", str(export), str(rec.target_dir), str(out), "--replace"]
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = read_json(out / "config.json")
    weights = read_weights(out)
    L = rec.num_layers

    def layer(name: str) -> int:
        parts = name.split(".")
        return int(parts[2]) if name.startswith("model.layers.") else -1

    for name, t in rec.target_weights.items():
        if layer(name) < L:  # the target's own layers, unchanged (its MTP layers replaced)
            assert torch.equal(weights[name], t), name
    mtp = {k: v for k, v in weights.items() if layer(k) >= L}
    return _mtp_check(cfg, mtp, rec, "vllm-mtp-stitched")


# ---- block drafters (DFlash) --------------------------------------------------------------------
_DFLASH_ARCHS = (["DFlashDraftModel"], ["DFlash2DraftModel"])


def _dflash_tensor_names(cfg: dict[str, Any], n_taps: int, dflash2: bool) -> dict[str, tuple]:
    """The tensors vLLM's `qwen3_dflash.py` / SGLang's DFlash model load (REFERENCES A3), with
    shapes: `fc` (n taps -> H), `hidden_norm`, `norm`, Qwen3 layers with q/k norms; DFlash2
    adds each layer's `{attention,mlp}_conv` and the `candidate_selector`. No `model.` prefix
    (vLLM prepends it), no `mask_hidden` (vLLM asserts its absence), no embedding or head."""
    H, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    names: dict[str, tuple] = {
        "fc.weight": (H, n_taps * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        names.update(
            {
                p + "self_attn.q_proj.weight": (nq * hd, H),
                p + "self_attn.k_proj.weight": (nkv * hd, H),
                p + "self_attn.v_proj.weight": (nkv * hd, H),
                p + "self_attn.o_proj.weight": (H, nq * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (ffn, H),
                p + "mlp.up_proj.weight": (ffn, H),
                p + "mlp.down_proj.weight": (H, ffn),
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
            }
        )
        if dflash2:
            for conv in ("attention_conv", "mlp_conv"):
                names[p + conv + ".base_kernel"] = None  # shape: the conv's own fields
                names[p + conv + ".kernel_projection.weight"] = None
    if dflash2:
        for t in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight"):
            names["candidate_selector." + t] = None
    # DSpark (vLLM `dspark`, REFERENCES A1/A3): top-level `markov_rank` r > 0 names the
    # Markov head's two `[V, r]` matrices; the confidence head is `Linear(H -> 1)` with a bias.
    # speculators' `dspark` adds the gated head's `gate_proj` (Linear(H + r -> r)) and
    # `confidence_head_with_markov` (the confidence head over `[h, markov_w1[prev]]`, H + r).
    r, V = int(cfg.get("markov_rank") or 0), cfg["vocab_size"]
    if r:
        names["markov_head.markov_w1.weight"] = (V, r)
        names["markov_head.markov_w2.weight"] = (V, r)
        if cfg.get("markov_head_type", "vanilla") == "gated":
            names["markov_head.gate_proj.weight"] = (r, H + r)
            names["markov_head.gate_proj.bias"] = (r,)
    if cfg.get("confidence_head"):
        width = H + (r if cfg.get("confidence_head_with_markov") else 0)
        names["confidence_head.proj.weight"] = (1, width)
        names["confidence_head.proj.bias"] = (1,)
    return names


def _dflash_common(cfg, tensors, rec: RunRecord, slots: list[int], dflash2: bool, layout: str):
    """What both DFlash layouts must agree with the trained drafter on: the Qwen3 sizes, the
    taps (HF `hidden_states` slots: never the last layer's, which no engine captures inside
    its layer loop), every tensor name and shape, and the trained values."""
    a, tc, L = rec.arch, text_config(rec.target_config), rec.num_layers
    assert cfg["model_type"] == "qwen3" and cfg["vocab_size"] == tc["vocab_size"]
    assert cfg["hidden_size"] == tc["hidden_size"]  # the target's embedding and head are shared
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert cfg[key] == a[key], key
    assert cfg["num_hidden_layers"] == a["num_hidden_layers"]
    assert cfg["max_position_embeddings"] >= tc["max_position_embeddings"]
    _check_rope(cfg, rec, rope_parameters=False)
    assert len(set(slots)) == len(slots) and all(1 <= j <= L - 1 for j in slots), slots
    want = _dflash_tensor_names(cfg, len(slots), dflash2)
    assert set(tensors) == set(want), sorted(set(tensors) ^ set(want))
    for name, shape in want.items():
        if shape is not None:
            assert tuple(tensors[name].shape) == shape, (name, tensors[name].shape, shape)
    for name, t in tensors.items():
        own = name.removesuffix(".weight") if name.endswith("_codebook.weight") else name
        _close(t, rec.drafter[own], name)
    return EngineView(layout, layer_taps=slots, tensors=tensors)


def vllm_sglang_dflash(export: Path, rec: RunRecord) -> EngineView:
    """The z-lab layout at the export's root, read by vLLM (`method: dflash`) and SGLang
    (`DFLASH`). Taps (REFERENCES A3): vLLM `get_eagle3_aux_layers_from_config` takes
    `eagle_aux_hidden_state_layer_ids` as is, else `dflash_config.target_layer_ids` + 1;
    SGLang reads only `dflash_config.target_layer_ids` (else top-level), checks `0 <= t < L`
    and adds 1; both capture slot k before layer k runs (HF `hidden_states[k]`). The two
    readings must name the same slots."""
    cfg = read_json(export / "config.json")
    tensors = read_tensors(export / "model.safetensors")
    assert cfg["architectures"] in _DFLASH_ARCHS, cfg["architectures"]
    dc, L = cfg["dflash_config"], rec.num_layers
    assert cfg["num_target_layers"] == L
    ids = dc.get("target_layer_ids", cfg.get("target_layer_ids"))
    assert all(0 <= t < L for t in ids), ids  # SGLang's check
    sglang = [t + 1 for t in ids]
    vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
    vllm = list(vllm) if vllm is not None else sglang
    assert vllm == sglang, (vllm, sglang)
    B = dc.get("block_size", cfg.get("block_size"))
    assert B == cfg.get("block_size", B) == rec.arch["block_size"]
    # vLLM's `dspark` reading: with `dflash_config.sample_from_anchor` the anchor slot drafts
    # too, so a block of B slots gives B drafts (B - 1 otherwise); only the `vanilla` head.
    from_anchor = bool(dc.get("sample_from_anchor", False))
    assert from_anchor == rec.arch["sample_from_anchor"]
    assert rec.state["objective"]["serving_k"] <= (B if from_anchor else B - 1)
    if cfg.get("markov_rank"):
        assert (
            cfg["markov_head_type"] == "vanilla" and cfg["markov_rank"] == rec.arch["markov_rank"]
        )
    mask = dc["mask_token_id"]
    assert mask == rec.arch["mask_token_id"] and 0 <= mask < cfg["vocab_size"]
    assert bool(dc.get("causal", False)) == rec.arch["causal_block"]
    dflash2 = cfg["architectures"] == ["DFlash2DraftModel"]
    if dflash2:
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            assert dc[key] == rec.arch[key], key
    assert cfg["torch_dtype"] == str(next(iter(_floats(tensors))).dtype).removeprefix("torch.")
    view = _dflash_common(cfg, tensors, rec, sglang, dflash2, "vllm-sglang-dflash")
    view.mask_token_id = mask
    return view


def speculators_dflash(export: Path, rec: RunRecord) -> EngineView:
    """speculators `dflash` / `dflash2` (`models/dflash/config.py`; REFERENCES A3) and vLLM's
    `update_dflash` of it: `aux_hidden_state_layer_ids` are capture *slots* (vLLM sets
    `eagle_aux_hidden_state_layer_ids = aux` and `target_layer_ids = aux - 1`), the Qwen3
    sizes under `transformer_layer_config`, the full vocabulary (no `d2t` / `t2d`), the
    target's `embed_tokens` and `lm_head` stored, codebooks as `nn.Embedding` (`.weight`)."""
    folder = export / "speculators"
    cfg = read_json(folder / "config.json")
    tensors = read_tensors(folder / "model.safetensors")
    stype = cfg["speculators_model_type"]
    assert stype in ("dflash", "dflash2", "dspark")
    assert cfg["speculators_config"]["algorithm"] == stype
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3"
    assert cfg["draft_vocab_size"] == layer["vocab_size"]  # not pruned
    assert cfg["target_hidden_size"] == text_config(rec.target_config)["hidden_size"]
    assert cfg["block_size"] == rec.arch["block_size"]
    assert cfg["mask_token_id"] == rec.arch["mask_token_id"]
    # proposals: the B - 1 mask slots, or all B slots with DSpark's `sample_from_anchor`
    assert cfg["sample_from_anchor"] is bool(rec.arch["sample_from_anchor"])
    assert (stype == "dspark") == bool(rec.arch["sample_from_anchor"] or rec.arch["markov_rank"])
    names = dict(layer)
    if stype == "dspark":  # `DSparkSpeculatorConfig`: each flag read, its defaults all "on"
        assert cfg["markov_rank"] == rec.arch["markov_rank"]
        assert cfg["markov_head_type"] == rec.arch["markov_head_type"]
        assert cfg["enable_confidence_head"] is bool(rec.arch["confidence_head"])
        want_with = bool(rec.arch.get("confidence_head_with_markov"))
        assert cfg["confidence_head_with_markov"] is want_with
        names.update(
            markov_rank=cfg["markov_rank"],
            markov_head_type=cfg["markov_head_type"],
            confidence_head=cfg["enable_confidence_head"],
            confidence_head_with_markov=cfg["confidence_head_with_markov"],
        )
    proposal = cfg["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == rec.state["objective"]["serving_k"]
    _check_verifier(folder, cfg, rec)
    slots = list(cfg["aux_hidden_state_layer_ids"])  # slots as is (`update_dflash`)
    for name, want in (("embed_tokens.weight", "embed_tokens.weight"), ("lm_head.weight", None)):
        ref = rec.target_tensor(want) if want else rec.target_head()
        assert torch.equal(tensors.pop(name), ref.to(tensors["fc.weight"].dtype)), name
    assert "d2t" not in tensors and "t2d" not in tensors
    view = _dflash_common(names, tensors, rec, slots, stype == "dflash2", f"speculators-{stype}")
    view.mask_token_id = cfg["mask_token_id"]
    return view


# ---- paths of the training machine ------------------------------------------------------------
REPO = Path(__file__).resolve().parents[2]
# The user's own record (the resolved training config, the human-readable card with local
# launch commands, the runner's reports of where it ran) and pictures; every other exported
# file is read by an engine or a loader.
# The acceptance suites' report and resume records (`suites/*.json`,
# `suites/requests/<suite>/t<T>/*.json`, written into the export by `draftinfer.evaluation.suite_run`)
# name the drafter, data and target they ran on, as the runner's reports do.
OWN_RECORD = (
    "training_args.yaml",
    "README.md",
    "runner_report*.json",
    "*.png",
    "suites/*.json",
    "suites/requests/*/*/*.json",
)


def machine_paths(*extra: str | Path) -> list[str]:
    """Absolute paths of this machine an export must not name."""
    paths = {str(REPO), str(_zoo_dir()), *map(str, extra)}
    return sorted({p for p in paths if p and p != "/"}, key=len)


def shipped(export: Path, dest: Path) -> Path:
    """A copy of `export` as the Hub upload ships it: speculators' verifier named by the
    target's hub id (`drafttrain.export.hub.name_verifier`; locally it may be a local target's
    absolute path, which resolves from any directory of this machine)."""
    import shutil

    from draftinfer.files.checkpoint import SPECULATORS_DIR
    from drafttrain.export.hub import name_verifier

    shutil.copytree(export, dest)
    name_verifier(dest / SPECULATORS_DIR / "config.json", "org/target")
    return dest


def files_naming(folder: Path, paths: list[str]) -> list[str]:
    """`grep -r` for `paths` over every file an engine or loader reads (text and the headers
    and metadata of safetensors files alike: all read as bytes)."""
    hits = []
    for f in sorted(folder.rglob("*")):
        if not f.is_file() or any(f.match(pattern) for pattern in OWN_RECORD):
            continue
        data = f.read_bytes()
        hits += [f"{f.relative_to(folder)}: {p}" for p in paths if p.encode() in data]
    return hits


def _zoo_dir() -> Path:
    from draftinfer.files.paths import ZOO_DIR

    return ZOO_DIR


Reader = Callable[[Path, RunRecord], EngineView]
# Every export layout of every registered kind, read as its engine reads it.
LAYOUTS: dict[str, tuple[Reader, ...]] = {
    "eagle3": (vllm_eagle3, speculators_eagle3),
    "ptd": (vllm_ptd, speculators_peagle),
    "mtp": (mtp_standalone, mtp_stitched),
    "dflash": (vllm_sglang_dflash, speculators_dflash),
}


def _speculators_dflash_applies(rec: RunRecord) -> bool:
    """speculators has no field for a causal block and reads sliding windows otherwise: such a
    block drafter's export has no speculators folder (the spec returns no layout)."""
    a = rec.arch
    return not (a.get("causal_block") or "sliding_attention" in (a.get("layer_types") or []))


speculators_dflash.applies = _speculators_dflash_applies


def readers_for(kind: str, rec: RunRecord) -> list[Reader]:
    """`LAYOUTS[kind]` less the readers of layouts this drafter's options do not have."""
    return [read for read in LAYOUTS[kind] if getattr(read, "applies", lambda r: True)(rec)]


def speculators_kinds() -> list[str]:
    """Registered kinds whose spec writes the speculators layout."""
    from draftinfer.registry import DrafterSpec, drafter_spec, registered_kinds

    return [
        k
        for k in registered_kinds()
        if type(drafter_spec(k)).speculators_layout is not DrafterSpec.speculators_layout
    ]


# ---- a block drafter's logits rebuilt from its files (vLLM `dflash` / `dspark`) ------------------
# Written from the engines' reading rules (REFERENCES A1/A3) with plain torch over the tensors
# as stored, never through `draftinfer.kinds.dflash`: the Qwen3 layer, the context entering
# every layer as keys/values only, the per-layer (causal, window) vLLM resolves, the DSpark
# Markov bias applied sequentially from the anchor and the confidence head. The export tests
# compare its logits with our runner's and its per-layer attention with what our layers did.


def vllm_dflash_layer_attention(cfg: dict[str, Any]) -> list[tuple[bool, int | None]]:
    """Per drafter layer (causal inside the block, sliding window or None), by vLLM's rule
    (`_dflash_layer_causal`, `_resolve_layer_attention`): `dflash_config.use_swa` with
    `swa_window_size` makes every layer a window layer, else `layer_types[i] ==
    "sliding_attention"` with `sliding_window`; causality is the top-level `is_causal` if
    present, else `dflash_config.causal` if present, else "a sliding layer is causal" - so one
    global flag applies to every layer, full ones included (the #47745 trap)."""
    dc = cfg.get("dflash_config") or {}
    n = cfg["num_hidden_layers"]
    if dc.get("use_swa"):
        types, window = ["sliding_attention"] * n, int(dc["swa_window_size"])
    else:
        types = list(cfg.get("layer_types") or ["full_attention"] * n)
        window = cfg.get("sliding_window")
    assert len(types) == n, types
    out = []
    for t in types:
        sliding = t == "sliding_attention"
        if "is_causal" in cfg:
            causal = bool(cfg["is_causal"])
        elif "causal" in dc:
            causal = bool(dc["causal"])
        else:
            causal = sliding
        assert not sliding or (window or 0) > 0, "a sliding layer without sliding_window"
        out.append((causal, int(window) if sliding else None))
    return out


def block_mask_by_positions(
    ctx_pos: torch.Tensor,  # [T] positions of the context rows
    block_pos: torch.Tensor,  # [n] positions of the block slots (anchor first)
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """The bool mask `[n, T + n]` a block slot reads in the engines' KV cache (REFERENCES A1
    "In-block attention", "Sliding window"): a context key strictly before the anchor's
    position; a key of its own block (all of them, or those at or before it when causal); in a
    window layer only keys whose position is within `window` of the query's own
    (`q - k < window`)."""
    anchor = block_pos[0]
    q = block_pos[:, None]
    ctx = (ctx_pos[None] < anchor).expand(len(block_pos), -1)
    blk = torch.ones(len(block_pos), len(block_pos), dtype=torch.bool)
    if causal:
        blk = block_pos[None] <= q
    m = torch.cat([ctx, blk], 1)
    if window is not None:
        m = m & (q - torch.cat([ctx_pos, block_pos])[None] < window)
    return m


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _inv_freq(cfg: dict[str, Any]) -> torch.Tensor:
    """Neox RoPE frequencies from the draft config (vLLM reads RoPE from the draft's config):
    `rope_theta`, and `rope_scaling` `llama3` as transformers / vLLM compute it."""
    D, theta = cfg["head_dim"], float(cfg["rope_theta"])
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "llama3":
        f, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(medium, smoothed, scaled)
    else:
        assert kind == "default", f"reader: rope_type {kind!r}"
    return inv.float()


def _rope(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """x `[N, heads, D]` rotated (neox halves) at positions `[N]`."""
    ang = pos.double()[:, None] * inv.double()[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


@dataclass
class BlockDrafterFiles:
    """A z-lab layout folder as vLLM builds its drafter from it: the config and the tensors
    under their stored names (no `model.` prefix, no `mask_hidden`)."""

    cfg: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(repr=False)

    @classmethod
    def read(cls, folder: Path) -> BlockDrafterFiles:
        cfg = read_json(Path(folder) / "config.json")
        tensors = {
            k: v.float() for k, v in read_tensors(Path(folder) / "model.safetensors").items()
        }
        assert cfg["architectures"] == ["DFlashDraftModel"], "reader: plain DFlash / DSpark only"
        assert "mask_hidden" not in tensors and not any(k.startswith("model.") for k in tensors)
        if cfg.get("markov_rank"):  # vLLM's `dspark` serves the vanilla head only
            assert cfg["markov_head_type"] == "vanilla", cfg["markov_head_type"]
        return cls(cfg, tensors)

    def w(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def eps(self) -> float:
        return float(self.cfg["rms_norm_eps"])

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target taps `[T, n*H]` -> `hidden_norm(fc(.))` `[T, H]`."""
        return _rms(
            features.float() @ self.w("fc.weight").T, self.w("hidden_norm.weight"), self.eps
        )

    def layer(
        self,
        i: int,
        x: torch.Tensor,  # [n, H] the block rows entering layer i
        ctx: torch.Tensor,  # [T, H] the context
        ctx_pos: torch.Tensor,  # [T]
        block_pos: torch.Tensor,  # [n]
        mask: torch.Tensor,  # [n, T + n]
    ) -> torch.Tensor:
        """Qwen3 decoder layer i over the block, the context as extra keys/values: `k =
        k_norm(k_proj(ctx))` RoPE'd at the context's positions, `v = v_proj(ctx)`, no
        `input_layernorm` on the context."""
        c, p = self.cfg, f"layers.{i}."
        nq, nkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        inv = _inv_freq(c)
        h = _rms(x, self.w(p + "input_layernorm.weight"), self.eps)
        qn, kn = self.w(p + "self_attn.q_norm.weight"), self.w(p + "self_attn.k_norm.weight")
        q = _rms((h @ self.w(p + "self_attn.q_proj.weight").T).view(-1, nq, D), qn, self.eps)
        both = torch.cat([ctx, h])
        k = _rms((both @ self.w(p + "self_attn.k_proj.weight").T).view(-1, nkv, D), kn, self.eps)
        v = (both @ self.w(p + "self_attn.v_proj.weight").T).view(-1, nkv, D)
        q = _rope(q, block_pos, inv)
        k = _rope(k, torch.cat([ctx_pos, block_pos]), inv)
        k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
        s = s.masked_fill(~mask[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(len(x), nq * D)
        x = x.float() + o @ self.w(p + "self_attn.o_proj.weight").T
        h = _rms(x, self.w(p + "post_attention_layernorm.weight"), self.eps)
        g, u = h @ self.w(p + "mlp.gate_proj.weight").T, h @ self.w(p + "mlp.up_proj.weight").T
        return x + (torch.nn.functional.silu(g) * u) @ self.w(p + "mlp.down_proj.weight").T

    def draft(
        self,
        embed: torch.Tensor,  # [V, H] the target's input embedding
        head: torch.Tensor,  # [V, H] the target's lm_head
        features: torch.Tensor,  # [T, n*H] context taps of the committed tokens 0..T-1
        anchor_id: int,  # the last committed token, at position T
        k: int,
        choose: Callable[[int, torch.Tensor], int] | None = None,
    ) -> dict[str, Any]:
        """One round of vLLM's block drafting: the block `[anchor, MASK x ...]` at positions
        `T + s`, `k + 1` slots (`k` with `dflash_config.sample_from_anchor`: the anchor slot
        drafts too), one forward; then the drafting slots in order, each scored `head(h)` plus,
        with `markov_rank`, the Markov bias `markov_w2 @ markov_w1[prev]` of the token chosen
        before it (the anchor for draft 1), and with the confidence head
        `sigmoid(proj(h [, markov_w1[prev]]))`. `choose(step, logits) -> id` (default argmax).
        -> {"logits" [k, V], "drafts" [k], "confidence" [k] or None, "layers" [(in, out)]}."""
        c, dc = self.cfg, self.cfg["dflash_config"]
        first = 0 if dc.get("sample_from_anchor") else 1
        n = k + first
        T = features.shape[0]
        ctx_pos, block_pos = torch.arange(T), T + torch.arange(n)
        ctx = self.context(features)
        ids = torch.full((n,), int(dc["mask_token_id"]))
        ids[0] = anchor_id
        x = embed.float()[ids]
        layers = []
        for i, (causal, window) in enumerate(vllm_dflash_layer_attention(c)):
            m = block_mask_by_positions(ctx_pos, block_pos, causal, window)
            y = self.layer(i, x, ctx, ctx_pos, block_pos, m)
            layers.append((x, y))
            x = y
        h = _rms(x, self.w("norm.weight"), self.eps)[first:]  # [k, H] drafting slots
        r = int(c.get("markov_rank") or 0)
        conf_w = self.tensors.get("confidence_head.proj.weight")
        with_markov = bool(c.get("confidence_head_with_markov"))  # input [h, markov_w1[prev]]
        if conf_w is not None:
            assert conf_w.shape == (1, h.shape[1] + (r if with_markov else 0)), conf_w.shape
        prev, logits, drafts, conf = anchor_id, [], [], []
        for j in range(k):
            lj = h[j] @ head.float().T
            if r:
                w1, w2 = (
                    self.w("markov_head.markov_w1.weight"),
                    self.w("markov_head.markov_w2.weight"),
                )
                lj = lj + w2 @ w1[prev]
            if conf_w is not None:
                f = (
                    torch.cat([h[j], self.w("markov_head.markov_w1.weight")[prev]])
                    if with_markov
                    else h[j]
                )
                conf.append(torch.sigmoid(f @ conf_w[0] + self.w("confidence_head.proj.bias")[0]))
            logits.append(lj)
            prev = int(choose(j, lj)) if choose is not None else int(lj.argmax())
            drafts.append(prev)
        return {
            "logits": torch.stack(logits),
            "drafts": torch.tensor(drafts),
            "confidence": torch.stack(conf) if conf else None,
            "layers": layers,
        }
