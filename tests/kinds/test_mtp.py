"""Multi-layer MTP specifics. T1, S1, S2 (= S7 after rejections), S8 and S9 per module run
for every kind in `tests/test_kinds.py`; here: the carried features (S3), re-prefill after a
continued chunked prefill (S7), N=1 at K=1, the one-line errors, stitching, and the
third-party check against transformers' own DeepSeek-V3 `MtpModel`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.proposer import FirstPass
from draftinfer.files.checkpoint import load_drafter, read_drafter_config, write_drafter
from draftinfer.files.errors import CheckpointError
from draftinfer.registry import drafter_spec
from tests.support.kind_factories import small_drafter, small_embeddings
from tests.support.prompts import zoo_prompts

REPO = Path(__file__).resolve().parents[2]


# ---- S3: what each module carries ---------------------------------------------------------
@pytest.mark.parametrize(
    "chain, carry", [(True, "pre_norm"), (True, "post_norm"), (False, "pre_norm")]
)
def test_s3_modules_carry_what_the_config_says(chain, carry, monkeypatch):
    d = small_drafter("mtp", n_predict=3, mtp_chain=chain, mtp_carry=carry)
    calls = []
    orig = type(d).forward

    def spy(self, k, ids, h_in, rope_pos, attn_fn, mm=None):
        normed, pre = orig(self, k, ids, h_in, rope_pos, attn_fn, mm)
        calls.append((k, h_in.clone(), normed.clone(), pre.clone()))
        return normed, pre

    monkeypatch.setattr(type(d), "forward", spy)
    prop = drafter_spec("mtp").proposer_class(d, 1, 64, torch.device("cpu"), torch.float32)
    T = 9
    feats = torch.randn(1, T, 32)
    fp = FirstPass(
        torch.tensor([0]),
        torch.randint(0, 97, (1, T)),
        feats,
        torch.arange(T)[None],
        torch.arange(T)[None],
    )
    pending = prop.admit(fp)
    calls.clear()
    prop.propose(pending, torch.tensor([3]), 3)
    (k0, h0, n0, p0), (k1, h1, n1, p1), (k2, h2, _, _) = calls
    assert (k0, k1, k2) == (0, 1, 2)
    window_feats = torch.cat([feats[:, T - 3 : T - 1], feats[:, T - 1 :]], 1)  # hist + pending
    torch.testing.assert_close(h0[:, :3], window_feats, rtol=0, atol=0)  # module 0: f_i
    if chain:
        want1, want2 = (p0, None) if carry == "pre_norm" else (n0, None)
        torch.testing.assert_close(h1, want1, rtol=0, atol=0)
        torch.testing.assert_close(h2, p1 if carry == "pre_norm" else n1, rtol=0, atol=0)
    else:
        torch.testing.assert_close(h1, h0, rtol=0, atol=0)
        torch.testing.assert_close(h2, h0, rtol=0, atol=0)


# ---- S7: re-prefill after a continued chunked prefill -------------------------------------
@pytest.mark.parametrize("split", [1, 4, 9])
def test_s7_continued_chunked_prefill_equals_one_prefill(split):
    """A prompt whose first pass arrives in two chunks (the second as a round's first pass
    with no drafts) leaves every module's KV at committed rows equal to one prefill."""
    d = small_drafter("mtp", n_predict=3)
    spec = drafter_spec("mtp")
    T = 14
    torch.manual_seed(3)
    ids, feats = torch.randint(0, 97, (1, T)), torch.randn(1, T, 32)
    pos = torch.arange(T)[None]
    whole = FirstPass(torch.tensor([0]), ids, feats, pos, pos)
    a = spec.proposer_class(d, 1, 64, torch.device("cpu"), torch.float32)
    a.propose(a.admit(whole), torch.tensor([0]), 3)
    b = spec.proposer_class(d, 1, 64, torch.device("cpu"), torch.float32)
    pending = b.admit(whole.take(0, split))  # chunk 1: rows 0..split-1
    assert torch.equal(pending.ids, whole.ids[:, split - 1 : split])
    # Chunk 2 continues the prefill: chunk 1's pending row, then its own rows, no drafts.
    b.propose(whole.take(split - 1), torch.tensor([0]), 3)
    for x, y in zip(a.kv_snapshot(0, T), b.kv_snapshot(0, T)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


# ---- N = 1 at K = 1, and module reuse ------------------------------------------------------
@pytest.fixture(scope="module")
def mtp1(tmp_path_factory, zoo_target):
    from drafttrain.jobs.job import run_job
    from tests.conftest import ZOO_RECIPE
    from tests.support.presets import compose_preset

    out = tmp_path_factory.mktemp("mtp1")
    s = run_job(
        compose_preset(
            "mtp3", [f"output_dir={out}", *ZOO_RECIPE, "drafter.n_predict=1", "export.verify=false"]
        )
    )
    return load_drafter(s["export_dir"], zoo_target.shared_weights())[0]


@pytest.mark.slow  # its fixture trains a one-module zoo drafter (the quick loop never trains)
@pytest.mark.parametrize("k, batch", [(1, 1), (1, 4), (1, 16), (3, 4)])
def test_t1_single_module_and_reuse(mtp1, zoo_target, k, batch):
    ps = zoo_prompts(batch, seed=k * 10 + batch)
    plain = greedy_generate(zoo_target, ps, 16)
    outs = SpecDecoder(zoo_target, mtp1, k, max_batch=8, max_model_len=384).generate(
        [Request(p, max_tokens=16) for p in ps]
    )[0]
    assert [o.token_ids for o in outs] == plain
    assert sum(a for o in outs for a in o.accepted) > 0


# ---- one-line errors -------------------------------------------------------------------------
def _export(tmp_path, **kw):
    d = small_drafter("mtp", **kw)
    write_drafter(tmp_path, d, {"target": "t", "serving_k": d.config.n_predict}, torch.float32)
    return d


def _one_line(e) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_n_predict_must_equal_the_modules_in_the_weights(tmp_path):
    d = _export(tmp_path, n_predict=3)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = cfg["drafttrain"]["n_predict"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="n_predict is 2 but the weights hold 3") as e:
        load_drafter(tmp_path, small_embeddings(d))
    _one_line(e)
    cfg["num_nextn_predict_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match="num_nextn_predict_layers 3 != drafttrain.n_predict 2"
    ):
        load_drafter(tmp_path, small_embeddings(d))


def test_k_must_be_a_multiple_of_n(kind_env):
    env = kind_env("mtp")
    for k in (1, 2, 4, 5):
        with pytest.raises(CheckpointError, match=f"k={k} is not a multiple of the 3 MTP modules"):
            SpecDecoder(env["target"], env["drafter"], k, max_batch=1, max_model_len=64)


def test_family_and_hidden_size_must_match_the_target(kind_env, tiny_qwen3_dir, tiny_llama3_dir):
    from draftinfer.files.loading import load_native_target

    spec, arch, _ = read_drafter_config(kind_env("mtp")["export"])
    for path, needle in (
        (tiny_qwen3_dir, "architecture Qwen3ForCausalLM"),
        (tiny_llama3_dir, "hidden size 64"),
    ):
        with pytest.raises(CheckpointError, match=needle) as e:
            spec.check_fit(arch, load_native_target(path).info)
        assert _one_line(e).startswith("MTP checkpoint does not match the target")


# ---- stitching into a copy of the target -------------------------------------------------------
def test_stitch_round_trip_and_missing_layer(kind_env, zoo_target, tmp_path):
    from safetensors.torch import load_file, save_file

    from draftinfer.files.loading import load_native_target
    from draftinfer.files.paths import resolve_path

    export = kind_env("mtp")["export"]
    out = tmp_path / "stitched"
    r = subprocess.run(
        [sys.executable, "-m", "drafttrain.stitch", export, "zoo:llama-tiny", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-1000:]
    cfg = json.loads((out / "config.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 3 and cfg["drafttrain"]["drafter_kind"] == "mtp"
    assert {index["weight_map"][f"model.layers.{8 + k}.eh_proj.weight"] for k in range(3)} == {
        "model-mtp.safetensors"
    }
    assert not (out / "model.safetensors").exists()  # loaders must take the index
    # The stitched target still loads as the target (MTP layers ignored), unchanged ...
    t = load_native_target(out, max_batch=1, max_seq_len=64)
    ids = torch.tensor([zoo_prompts(1, seed=4)[0][:20]])
    from draftinfer.conventions.slots import Slots

    s = Slots(torch.tensor([0]), torch.arange(ids.shape[1])[None])
    ref = load_native_target(resolve_path("zoo:llama-tiny"), max_batch=1, max_seq_len=64)
    assert torch.equal(t(ids, s).logits, ref(ids, s).logits)
    # ... and the drafter loads from it, equal to the export.
    a, _ = load_drafter(out, t.shared_weights())
    b, _ = load_drafter(export, t.shared_weights())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # Stitching into a target that already has them, or into a non-empty directory, is refused.
    again = subprocess.run(
        [sys.executable, "-m", "drafttrain.stitch", export, str(out), str(tmp_path / "x")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert again.returncode == 2 and "already holds MTP layers" in again.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()
    # --replace: the modules take the place of those the target holds, each tensor in one
    # shard only (vLLM reads every tensor of the shards the index names).
    replaced = subprocess.run(
        [sys.executable, "-m", "drafttrain.stitch", export, str(out), str(tmp_path / "y")]
        + ["--replace"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert replaced.returncode == 0, replaced.stderr[-1000:]
    names = [k for f in sorted((tmp_path / "y").glob("*.safetensors")) for k in load_file(str(f))]
    assert len(names) == len(set(names)) and f"model.layers.{8 + 2}.eh_proj.weight" in names
    c, _ = load_drafter(tmp_path / "y", t.shared_weights())
    assert all(torch.equal(x, y) for x, y in zip(c.state_dict().values(), b.state_dict().values()))
    # A stitched target missing an MTP layer: one line naming the layer.
    shard = out / "model-mtp.safetensors"
    sd = {k: v for k, v in load_file(str(shard)).items() if not k.startswith("model.layers.9.")}
    save_file(sd, str(shard))
    with pytest.raises(CheckpointError, match=r"hold 2 MTP module\(s\) \(missing model.layers.9\)"):
        load_drafter(out, t.shared_weights())


# ---- third-party check: transformers' own DeepSeek-V3 MTP -------------------------------------
@pytest.mark.slow
def test_transformers_deepseek_v3_mtp_loads_our_stitched_modules(tmp_path):
    """A tiny DeepSeek-V3 target (61 layers: transformers maps its MTP layer by the pattern
    `model.layers.61.*`), MTP trained through the same code path (`block: native`, the
    family's own native layer with MLA and MoE), exported, stitched, loaded by transformers'
    `MtpModel.from_pretrained`: its module logits equal ours, and so does our runner's first
    draft."""
    transformers = pytest.importorskip("transformers")
    mtp_model = getattr(pytest.importorskip("transformers.modeling_layers"), "MtpModel", None)
    if mtp_model is None:
        pytest.skip(f"transformers {transformers.__version__} has no MtpModel")
    from drafttrain.jobs.job import run_job
    from tests.support.presets import compose_preset
    from tests.support.tiny_models import write_counting_chat
    from tests.support.tiny_tokenizers import make_llama3_tokenizer

    tok = make_llama3_tokenizer(tmp_path / "tok")
    cfg = transformers.DeepseekV3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=61,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=8,
        qk_nope_head_dim=8,
        n_group=1,
        topk_group=1,
        max_position_embeddings=256,
        num_nextn_predict_layers=1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(tmp_path / "target"))
    tok.save_pretrained(str(tmp_path / "target"))
    summary = run_job(
        compose_preset(
            "mtp3",
            [
                "drafter.n_predict=1",
                "drafter.mask_pos0_embedding=false",
                # Not mtp3's random init: from the target's last layer 3 steps reliably lower
                # the loss (the sanity check below); from random ones they did not (6.29607 vs
                # 6.29571).
                "drafter.init=target_last_layer",
                f"target.name_or_path={tmp_path / 'target'}",
                "target.attn_implementation=eager",
                f"data.path={write_counting_chat(tmp_path / 'chat.jsonl')}",
                f"output_dir={tmp_path / 'run'}",
                "trainer.max_steps=3",
                "trainer.progress=false",
                "trainer.save_every=0",
                "data.batch_size=2",
                "data.eval_split=null",
                "export.verify=false",
            ],
        )
    )
    assert summary["losses"][-1] < summary["losses"][0]
    spec, arch, _ = read_drafter_config(summary["export_dir"])
    # The runner has a block for this family (its own native layer: MLA, routed experts).
    assert arch.block == "native" and arch.own_layer
    assert arch.architecture == "DeepseekV3ForCausalLM"
    out = spec.stitch(summary["export_dir"], arch, tmp_path / "target", tmp_path / "stitched")
    main = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager")
    theirs_model = mtp_model.from_pretrained(main).eval()
    ours, _ = load_drafter(
        out,
        {
            "input_embeddings": main.get_input_embeddings().weight,
            "output_embeddings": main.lm_head.weight,
        },
    )
    torch.manual_seed(1)
    ids = torch.randint(3, len(tok), (2, 12))
    pos = torch.arange(12)[None].expand(2, -1)
    from draftinfer.decoding.proposer import causal_attn

    with torch.no_grad():
        h = main(ids, output_hidden_states=True).hidden_states[-1]  # post-norm (feature tap)
        theirs = theirs_model._project_to_logits(
            theirs_model.forward_layer(0, h, pos, None, input_ids=ids)
        )
        normed, _ = ours(0, ids, h, pos, causal_attn)
        diff = (ours.logits(normed) - theirs).abs().max().item()
    # The same weights and operations: equal to fp32 rounding (exactly 0 on the machines of
    # earlier runs, 2.4e-7 on 2026-11-26's; a wrong weight or layout is off by O(1)).
    assert diff <= 1e-5, diff
    # Our runner serves these modules: its cached first draft equals transformers'.
    prop = drafter_spec("mtp").proposer_class(ours, 2, 16, torch.device("cpu"), torch.float32)
    first = FirstPass(torch.arange(2), ids[:, 1:], h[:, :-1], pos[:, :-1], pos[:, :-1])
    drafts, _ = prop.propose(prop.admit(first), torch.tensor([1, 1]), 1)
    with torch.no_grad():  # row i consumes (t_{i+1}, f_i): transformers' layer on those rows
        shifted = theirs_model.forward_layer(0, h[:, :-1], pos[:, :-1], None, input_ids=ids[:, 1:])
        want = theirs_model._project_to_logits(shifted)[:, -1].argmax(-1)
    assert drafts[:, 0].tolist() == want.tolist()
    shutil.rmtree(out)
