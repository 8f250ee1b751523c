"""`draftbench.mtp_compare` (issue 48, item 4): its table and verdict from given runs, and the
training configs it composes (the same steps, target and K for every drafter, the seed)."""

from __future__ import annotations

from draftbench.mtp_compare import DRAFTERS, config, parse_args, table


def _run(name, seed, al):
    return {
        "drafter": name,
        "seed": seed,
        "acceptance_length": al,
        "per_position_acceptance": [al - 1.0, 0.0, 0.0],
        "lossless": True,
    }


def test_verdict_needs_every_seed_above_the_released_layer():
    runs = [_run("native", None, 2.0), _run("mtp", 0, 2.3), _run("mtp", 1, 1.9)]
    md, verdict = table(runs, [0, 1])
    assert verdict["mtp_beats_native_beyond_spread"] is False
    assert verdict["mtp_spread"] == 2.3 - 1.9 and verdict["mtp_min_al"] == 1.9
    assert "| native | 2.000 | 2.000 |" in md and "| mtp | 2.300 | 1.900 | 2.100 |" in md
    runs[2] = _run("mtp", 1, 2.1)
    assert table(runs, [0, 1])[1]["mtp_beats_native_beyond_spread"] is True


def test_every_drafter_trains_the_same_steps_on_the_same_target():
    a = parse_args(["--out", "x.json", "--steps", "17", "--k", "3"])
    cfgs = {name: config(name, 5, a) for name in DRAFTERS}
    assert {c.drafter.kind for c in cfgs.values()} == {"mtp", "eagle3", "dflash"}
    for c in cfgs.values():
        assert c.trainer.max_steps == 17 and c.seed == 5 and c.export.verify_k == 3
        assert c.target.name_or_path == "zoo:deepseek-tiny" and c.export.verify
    assert cfgs["mtp"].drafter.n_predict == 3 and cfgs["mtp"].drafter.init == "native"
    verify = {
        (c.export.verify_prompts, c.export.verify_max_new_tokens, c.data.path)
        for c in cfgs.values()
    }
    assert len(verify) == 1  # the same held-out prompts for every drafter


def test_glm_comparison_uses_its_own_target_and_presets():
    """`--family glm4_moe`: every drafter on `zoo:glm-tiny`, (b) the `mtp_glm4_moe` preset, the
    EAGLE-3 sized as eagle3_deepseek; its own work directory."""
    from draftbench.mtp_compare import COMPARISONS

    a = parse_args(["--family", "glm4_moe", "--out", "x.json", "--steps", "9"])
    assert str(a.work) == COMPARISONS["glm4_moe"].work != COMPARISONS["deepseek_v3"].work
    cfgs = {name: config(name, 1, a) for name in COMPARISONS["glm4_moe"].drafters}
    assert {c.target.name_or_path for c in cfgs.values()} == {"zoo:glm-tiny"}
    assert cfgs["mtp"].preset == "mtp_glm4_moe" and cfgs["mtp"].drafter.init == "native"
    assert cfgs["eagle3"].drafter.intermediate_size == 512
    assert cfgs["eagle3"].trainer.warmup_steps == 20
    assert {c.trainer.max_steps for c in cfgs.values()} == {9}
    assert len({(c.export.verify_prompts, c.data.path) for c in cfgs.values()}) == 1


def test_glm_dflash_masks_with_the_reserved_mask_token():
    """glm-tiny pads with its EOS: the DFlash drafter's mask id is its `[MASK]`, a token the
    chat never holds."""
    from transformers import AutoTokenizer

    from draftinfer.files.paths import resolve_path
    from drafttrain.zoo.glm_target import MASK

    cfg = config("dflash", 0, parse_args(["--family", "glm4_moe", "--out", "x.json"]))
    tok = AutoTokenizer.from_pretrained(resolve_path(cfg.target.name_or_path))
    assert cfg.drafter.mask_token_id == tok.convert_tokens_to_ids(MASK)
    assert tok.pad_token_id == tok.eos_token_id
