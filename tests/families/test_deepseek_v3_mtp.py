"""The `mtp` kind on DeepSeek-V3 targets (issue 48, item 2; DESIGN conventions 10 and 15):
each module's block is the family's own native layer (MLA with its own latent cache, the
routed MLP of its index), and the checkpoint's own MTP layers are served as released
(`drafter=native`).

Oracles: transformers' own `MtpModel` loaded by `MtpModel.from_pretrained` from the target's
files (the released layout, experts per expert), the file's tensors, plain greedy decoding of
the native target, and a fresh prefill of each module's latent cache."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftinfer.conventions.metrics import acceptance_length
from draftinfer.decoding.baseline import greedy_generate
from draftinfer.decoding.engine import Request, SpecDecoder
from draftinfer.decoding.proposer import causal_attn, greedy_chooser
from draftinfer.files.checkpoint import load_released_drafter, released_drafter_config
from draftinfer.files.errors import ConfigError
from draftinfer.files.loading import load_native_target
from draftinfer.models.mla import LatentAttention
from draftinfer.models.moe import MoEBlock
from draftinfer.registry import drafter_spec
from tests.support.deepseek_mtp import (
    assert_chained_modules_equal,
    mtp_oracle,
    save_deepseek_with_mtp,
)
from tests.support.moe_models import MLA_YARN_SHORT, deepseek_v3_config
from tests.support.mtp_rounds import (
    MTPSequence,
    assert_compiled_round_equals_eager,
    assert_kv_equal,
)

pytestmark = pytest.mark.usefixtures("one_thread")

YARN = MLA_YARN_SHORT


@functools.lru_cache(maxsize=2)
def released_target(n_mtp: int) -> Path:
    """A tiny DeepSeek-V3 (3 layers, the first dense; MLA with a q LoRA, YaRN; 8 experts in 4
    groups) shipping `n_mtp` MTP layers of transformers' own making in its files."""
    cfg = deepseek_v3_config(layers=3, hidden=32, heads=2, first_k_dense_replace=1, yarn=YARN)
    root = Path(tempfile.mkdtemp(prefix=f"dsv3_mtp{n_mtp}_"))
    return save_deepseek_with_mtp(cfg, root / "target", n_mtp=n_mtp, seed=n_mtp)


def _shared(model) -> dict[str, torch.Tensor]:
    return {
        "input_embeddings": model.get_input_embeddings().weight,
        "output_embeddings": model.lm_head.weight,
    }


@pytest.mark.parametrize("n_mtp", [1, 2])
def test_released_layers_equal_transformers_mtp_model(n_mtp):
    """`drafter=native` reads the target's own MTP layers into modules whose block is the
    family's native layer; module k's logits equal transformers' `MtpModel` (loaded from the
    same files by its own conversion) chained as ours: module k+1 consumes module k's
    pre-norm output (vLLM's DeepSeek MTP carry), the embedding at position 0 zeroed."""
    path = released_target(n_mtp)
    main, theirs = mtp_oracle(path)
    ours, meta = load_released_drafter(path, _shared(main))
    assert meta["released"] and ours.config.n_predict == n_mtp and ours.config.own_layer
    for layer in ours.layers:
        assert isinstance(layer.block.self_attn, LatentAttention)
        assert isinstance(layer.block.mlp, MoEBlock)  # index L + k >= first_k_dense_replace
    torch.manual_seed(1)
    B, T = 2, 12
    ids = torch.randint(3, 500, (B, T + n_mtp))
    h = assert_chained_modules_equal(main, theirs, ours, ids, T, n_mtp)
    pos = torch.arange(T)[None].expand(B, -1)
    embed = main.get_input_embeddings()
    # transformers' own chained forward (post-norm carry) agrees on module 0 as well.
    with torch.no_grad():
        emb0 = torch.where((pos == 0)[..., None], 0.0, embed(ids[:, 1 : 1 + T]))
        want0 = theirs._project_to_logits(theirs.forward_layer(0, h, pos, None, inputs_embeds=emb0))
        normed, _ = ours(0, ids[:, 1 : 1 + T], h, pos, causal_attn)
    torch.testing.assert_close(ours.logits(normed), want0, rtol=1e-5, atol=1e-6)


def test_released_weights_are_the_files_tensors():
    """Every module tensor equals the file's: names renamed by the DeepSeek layout, per-expert
    `experts.{e}.{gate,up,down}_proj.weight` stacked into `gate_up_proj [E, 2I, H]` (gate
    rows first) and `down_proj [E, H, I]`."""
    path = released_target(2)
    files = load_file(str(path / "model.safetensors"))
    main, _ = mtp_oracle(path)
    ours, _ = load_released_drafter(path, _shared(main))
    own = ours.trainable_state_dict()
    L = 3
    for k in range(2):
        p = f"model.layers.{L + k}."
        assert torch.equal(own[f"layers.{k}.eh_proj.weight"], files[p + "eh_proj.weight"])
        assert torch.equal(own[f"layers.{k}.norm.weight"], files[p + "shared_head.norm.weight"])
        q = files[p + "self_attn.kv_a_proj_with_mqa.weight"]
        assert torch.equal(own[f"layers.{k}.block.self_attn.kv_a_proj_with_mqa.weight"], q)
        gate_up = own[f"layers.{k}.block.mlp.experts.gate_up_proj"]
        down = own[f"layers.{k}.block.mlp.experts.down_proj"]
        inter = down.shape[-1]
        for e in range(gate_up.shape[0]):
            g = files[f"{p}mlp.experts.{e}.gate_proj.weight"]
            u = files[f"{p}mlp.experts.{e}.up_proj.weight"]
            assert torch.equal(gate_up[e, :inter], g) and torch.equal(gate_up[e, inter:], u)
            assert torch.equal(down[e], files[f"{p}mlp.experts.{e}.down_proj.weight"])
        bias = files[p + "mlp.gate.e_score_correction_bias"]
        assert torch.equal(own[f"layers.{k}.block.mlp.gate.e_score_correction_bias"], bias)


def test_latent_caches_after_forced_rejections_equal_a_fresh_prefill():
    """Rounds of K = N = 2 drafts with r = 0, 1, 2 rejected (convention 10): every module's
    latent cache at the committed rows equals a fresh prefill of the committed prefix with
    target features, and the cached drafts equal the no-cache reference's."""
    path = released_target(2)
    main, _ = mtp_oracle(path)
    d, _ = load_released_drafter(path, _shared(main))
    seq = MTPSequence(d, M=40, seed=2)
    prop = seq.proposer()
    # The own-layer blocks keep the latent, kv_lora_rank + qk_rope_head_dim values per row.
    assert all(t.shape[-1] == 16 + 8 for t in prop.kv_snapshot(0, 4))
    P = 9
    prop.propose(prop.admit(seq.rows(0, P)), torch.tensor([0]), 2)
    a, b = P, P + 1  # the bonus of the prefill round
    for accept in (2, 0, 1, 2, 1, 0, 0):
        end = seq.round(prop, a, b, 2, accept)  # the engine commits accept + 1 tokens
        assert_kv_equal(prop.kv_snapshot(0, b), seq.fresh_kv(b), f"accept {accept} at {b}")
        a, b = b, end
    # Cached drafts equal the reference loop's (no cache, every module over all rows).
    fresh = seq.proposer()
    got, _ = fresh.propose(fresh.admit(seq.rows(0, 20)), torch.tensor([4]), 4)
    want, _ = type(prop).reference_drafts(
        d, seq.tok[1:21], seq.feat[:20], seq.pos[:20], 4, greedy_chooser
    )
    assert got[0].tolist() == want


@pytest.mark.parametrize("n_mtp, ks", [(1, (1, 3)), (2, (2, 4))])
def test_served_as_released_is_lossless_and_reuses_modules(n_mtp, ks):
    """The native target drafted for by its own released MTP layers through the engine:
    greedy output equals plain greedy at K = N and at K > N (modules reused, step % N, as
    DeepSeek-V3's one layer is served at K = 3), batch 1 and 4 with mixed prompt lengths, the
    prompts of a batch longer than the ABSORB threshold (the latent prefill expands, rounds
    absorb). The layers are random (transformers' init, redrawn): their drafts are accepted
    about never; the acceptance paths (every draft accepted, r = 1..N rejected, the latent
    caches after each) are forced in `test_latent_caches_after_forced_rejections_...`."""
    path = released_target(n_mtp)
    target = load_native_target(path, "cpu", torch.float32, 4, 128)
    d, _ = load_released_drafter(path, target.shared_weights())
    lengths = (7, 21, 3, 9)
    prompts = [[5 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate(lengths)]
    plain = greedy_generate(target, prompts, 24, [2])
    for k in ks:
        for batch in (1, 4):
            dec = SpecDecoder(target, d, k, max_batch=batch, max_model_len=128)
            reqs = [Request(p, max_tokens=24, stop_token_ids=(2,)) for p in prompts]
            outs, _ = dec.generate(reqs)
            assert [o.token_ids for o in outs] == plain, (k, batch)
            assert sum(len(o.accepted) for o in outs) > 0  # rounds were drafted


def test_target_without_mtp_layers_is_a_one_line_error(tmp_path):
    """`drafter=native` on a target that ships no MTP layers (num_nextn_predict_layers 0, or
    a family that has none) names the target and the field."""
    from tests.support.moe_checkpoints import save_moe_target

    cfg = deepseek_v3_config(layers=2, hidden=32, heads=2, num_nextn_predict_layers=0)
    path = save_moe_target(cfg, tmp_path / "t")
    with pytest.raises(ConfigError) as e:
        released_drafter_config(path)
    msg = str(e.value)
    assert "\n" not in msg and "num_nextn_predict_layers = 0" in msg and "deepseek_v3" in msg


def test_runner_builds_the_block_the_family_provides():
    """The pair fits by declared capabilities: the family provides a drafter block (its own
    layer), not a dense one; `block: hf` needs none."""
    from draftinfer.registry import check_pair, family_spec

    fam = family_spec("deepseek_v3")
    assert "drafter_block" in fam.provides and "dense_decoder_layer" not in fam.provides
    check_pair(drafter_spec("mtp"), fam)


def _file_tensor(files: dict[str, torch.Tensor], L: int, src: int, ours: str) -> torch.Tensor:
    """The released file's value of our module tensor `layers.{k}.<rest>` for released layer
    `src`, written out here from the DeepSeek layout (REFERENCES part D, C4), not read from the
    layout code: `model.layers.{L+src}.` + the block's names, `shared_head.norm` for the final
    norm, experts stacked from per-expert tensors (gate rows, then up rows)."""
    rest = ours.split(".", 2)[2]
    p = f"model.layers.{L + src}."
    if rest.startswith("norm."):
        return files[p + "shared_head." + rest]
    if rest.startswith("block."):
        rest = rest[len("block.") :]
    if rest.endswith("experts.gate_up_proj"):
        base = p + rest[: -len("gate_up_proj")]
        E = sum(1 for n in files if n.startswith(base) and n.endswith("gate_proj.weight"))
        return torch.stack(
            [
                torch.cat(
                    [files[f"{base}{e}.gate_proj.weight"], files[f"{base}{e}.up_proj.weight"]]
                )
                for e in range(E)
            ]
        )
    if rest.endswith("experts.down_proj"):
        base = p + rest[: -len("down_proj")]
        E = sum(1 for n in files if n.startswith(base) and n.endswith("down_proj.weight"))
        return torch.stack([files[f"{base}{e}.down_proj.weight"] for e in range(E)])
    return files[p + rest]


@pytest.mark.parametrize("init", ["native", "native_all"])
def test_training_init_native_starts_from_the_released_layers(init, tmp_path):
    """`drafter.init=native`: module 0's every tensor equals the target file's released layer
    0; modules 1.. start as `target_last_layer` (the target's last layer as block, eh_proj
    [noise | identity]). `native_all`: module k equals released layer k % 2 (3 modules, 2
    released layers)."""
    from drafttrain.registry import InitContext, train_spec
    from tests.support.kind_factories import frozen_target

    path = released_target(2)
    files = load_file(str(path / "model.safetensors"))
    target = frozen_target(str(path))
    spec = train_spec("mtp")
    cfg = spec.config_class(n_predict=3, init=init)
    d = spec.init_drafter(cfg, InitContext(target, None, None, tmp_path))
    assert d.config.own_layer and d.config.block == "native"
    own = d.trainable_state_dict()
    copied = range(3) if init == "native_all" else range(1)
    for name, t in own.items():
        k = int(name.split(".")[1])
        if k in copied:
            want = _file_tensor(files, 3, k % 2, name)
            assert torch.equal(t, want.to(t.dtype)), name
    if init == "native":  # module 1: the target's last layer, not a released one
        last = {n: v for n, v in target.layers[-1].state_dict().items()}
        for n, v in last.items():
            assert torch.equal(own[f"layers.1.block.{n}"], v.float()), n
        H = d.config.hidden_size
        assert torch.equal(own["layers.1.eh_proj.weight"][:, H:], torch.eye(H))


def test_training_init_native_needs_released_layers(tmp_path):
    """A target without MTP layers of its own: `drafter.init=native` is a one-line error."""
    from drafttrain.registry import InitContext, train_spec
    from tests.support.kind_factories import frozen_target
    from tests.support.moe_checkpoints import save_moe_target

    cfg = deepseek_v3_config(layers=2, hidden=32, heads=2, num_nextn_predict_layers=0)
    path = save_moe_target(cfg, tmp_path / "t")
    spec = train_spec("mtp")
    with pytest.raises(ConfigError) as e:
        spec.init_drafter(
            spec.config_class(n_predict=1, init="native"),
            InitContext(frozen_target(str(path)), None, None, tmp_path),
        )
    assert "\n" not in str(e.value) and "ships no drafter layers" in str(e.value)


def _target_with_tokenizer(tmp_path: Path) -> Path:
    """A tiny DeepSeek-V3 with one released MTP layer and a chat tokenizer beside it."""
    from tests.support.tiny_tokenizers import make_llama3_tokenizer

    tok = make_llama3_tokenizer(tmp_path / "tok")
    cfg = deepseek_v3_config(
        vocab_size=len(tok), layers=2, hidden=32, heads=2, first_k_dense_replace=1
    )
    cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    path = save_deepseek_with_mtp(cfg, tmp_path / "target", n_mtp=1)
    tok.save_pretrained(str(path))
    return path


def test_runner_cli_serves_the_released_layers(tmp_path):
    """`run_eval` (what `python -m draftinfer drafter=native target=DIR` runs) on a target with
    a tokenizer: the report names the drafter `native`, is lossless, and carries the AL and
    per-position acceptance of the released layers; without `target=` it is a one-line
    error."""
    from draftinfer.evaluation.config import InferConfig
    from draftinfer.evaluation.run import run_eval
    from tests.support.moe_targets import write_chat

    path = _target_with_tokenizer(tmp_path)
    common = dict(
        drafter="native", prompts=str(write_chat(tmp_path / "chat.jsonl", n=6)), num_prompts=3,
        max_new_tokens=10, batch_size=2, max_model_len=256, k=3, progress=False, plot="none",
        device="cpu",
    )  # fmt: skip
    report = run_eval(InferConfig(target=str(path), **common))
    assert report.lossless and report.drafter == "native" and report.k == 3
    assert report.acceptance_length >= 1.0 and len(report.per_position_acceptance) == 3
    with pytest.raises(ConfigError, match="drafter=native serves the target's own"):
        run_eval(InferConfig(**common))


@pytest.mark.slow  # an acceptance suite run (~12 s)
def test_acceptance_suites_serve_the_released_layers(tmp_path):
    """An acceptance suite over `drafter=native`: results go where eval.out_dir says (there is
    no export directory: without it, a one-line error), identified by the target's own files;
    lossless."""
    from draftinfer.evaluation.config import EvalConfig, InferConfig
    from draftinfer.evaluation.suite_run import run_suites
    from tests.support.suite_data import TEXT_SUITES, write_suite_copies

    path = _target_with_tokenizer(tmp_path)
    copies = write_suite_copies(tmp_path / "copies", n=2)
    suite = dict(suites=[TEXT_SUITES[0]], path=str(copies), max_new_tokens=8)
    suites_cfg = dict(
        drafter="native", target=str(path), k=3, batch_size=2, max_model_len=256,
        temperatures=[0.0], progress=False, device="cpu",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="drafter=native: give eval.out_dir"):
        run_suites(InferConfig(**suites_cfg, eval=EvalConfig(**suite)))
    out = tmp_path / "suites"
    result = run_suites(InferConfig(**suites_cfg, eval=EvalConfig(**suite, out_dir=str(out))))
    assert result.lossless and (out / "suites.json").is_file()
    assert not (Path("native") / "suites").exists()


@pytest.mark.slow  # trains a tiny target with its MTP layer (~12 s on one core)
def test_a_jointly_trained_released_layer_is_served_losslessly_and_accepted(tmp_path):
    """A tiny DeepSeek-V3 trained with its own MTP layer as DeepSeek trains it (the main
    next-token loss plus 0.3 x the MTP layer's loss, gradients into the main model;
    `drafttrain.zoo.mtp_joint`) on patterned chat (counting), saved with the layer at
    `model.layers.{L}.*` experts per expert, then served as released (`drafter=native`):
    greedy output equals plain greedy at K = 1 and at K = 3 (the one layer reused three times,
    as DeepSeek-V3's is served), and the drafts are accepted."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    from drafttrain.zoo import text_data, text_train
    from drafttrain.zoo.build_moe import encode
    from drafttrain.zoo.mtp_joint import NextTokenWithMTP, save_released_mtp
    from drafttrain.zoo.target_train import TokenBudgetBatches, decay_groups, train_target
    from tests.support.tiny_models import write_counting_chat
    from tests.support.tiny_tokenizers import make_llama3_tokenizer

    tok = make_llama3_tokenizer(tmp_path / "tok")
    cfg = deepseek_v3_config(
        vocab_size=len(tok), layers=2, hidden=64, heads=2, first_k_dense_replace=1
    )
    cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    mtp = MtpModel(model, 1)
    mtp.apply(model._init_weights)  # transformers leaves some MtpModel tensors uninitialised
    rows = text_data.read_jsonl(write_counting_chat(tmp_path / "chat.jsonl", n=200))
    ex = encode(tok, rows)
    train_ex, test_ex = ex[:150], ex[150:]
    args = text_train.TrainArgs(steps=150, tokens_per_batch=1024, lr=3e-3, warmup=10)
    batches = TokenBudgetBatches(
        train_ex, 1024, 0, lambda idx: text_train.collate(train_ex, idx, tok.pad_token_id)
    )
    objective = NextTokenWithMTP(model, mtp, 0.3)
    groups = decay_groups(list(objective.named_parameters()), 0.1)
    log, _ = train_target(
        model, batches, args, groups, torch.device("cpu"), progress=False, objective=objective
    )
    assert log[-1]["mtp_loss"] < 0.25 * log[0]["mtp_loss"], log  # the layer learned
    model.save_pretrained(str(tmp_path / "target"))
    save_released_mtp(mtp, model, tmp_path / "target")

    target = load_native_target(tmp_path / "target", "cpu", torch.float32, 4, 256)
    d, _ = load_released_drafter(tmp_path / "target", target.shared_weights())
    prompts = [x[: m.index(1)] for x, m in test_ex[:8]]  # up to the first answer token
    eos = [tok.eos_token_id]
    plain = greedy_generate(target, prompts, 24, eos)
    assert all(len(p) > 4 for p in plain)  # the target answers (counts), not just stops
    for k in (1, 3):
        dec = SpecDecoder(target, d, k, max_batch=4, max_model_len=256)
        outs, _ = dec.generate(
            [Request(p, max_tokens=24, stop_token_ids=tuple(eos)) for p in prompts]
        )
        assert [o.token_ids for o in outs] == plain, k
        al = acceptance_length([a for o in outs for a in o.accepted])
        print(f"served as released, K={k}: AL {al:.3f}")
        assert al > 1 + 0.5 * k, (k, al)  # most drafts accepted


@pytest.mark.slow  # traces every module under dynamic shapes (3.6 min on 2 shared cores)
def test_compiled_round_equals_the_eager_one():
    """The whole round compiled as the engine compiles it (`mtp_rounds.
    assert_compiled_round_equals_eager`), the modules' blocks the family's own layers reading
    the proposer's latent caches."""
    path = released_target(2)
    main, _ = mtp_oracle(path)
    d, _ = load_released_drafter(path, _shared(main))
    assert_compiled_round_equals_eager(d, N=2)
