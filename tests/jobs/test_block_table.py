"""`draftbench.block_table` (issue 51 item 5): every arm composes on the one contract (same
block, steps, data and target; only its option differs), and the table reads its cells."""

from __future__ import annotations

from draftbench.block_table import ARMS, BLOCK, STEPS, markdown
from tests.support.presets import compose_preset


def test_every_arm_composes_on_one_contract():
    seen = {}
    for arm, (preset, extra) in ARMS.items():
        cfg = compose_preset(preset, [f"drafter.block_size={BLOCK}", *extra])
        d = cfg.drafter
        assert cfg.trainer.max_steps == STEPS and d.block_size == BLOCK, arm
        assert (d.num_layers, d.num_anchors, d.gamma) == (2, 32, 4.0), arm
        assert cfg.target.name_or_path == "zoo:llama-tiny"
        seen[arm] = (cfg.data.path, d.dflash2, d.dspark, d.lilicorr, d.lilicorr_conv)
    assert len({v[0] for v in seen.values()}) == 1  # the same data
    assert seen["dflash"][1:] == (False, False, False, False)
    assert seen["dflash2"][1:] == (True, False, False, False)
    assert seen["dspark"][1:] == (False, True, False, False)
    assert seen["lilicorr"][1:] == (False, False, True, False)
    assert seen["lilicorr_conv"][1:] == (False, False, True, True)
    assert compose_preset("dspark", ARMS["dspark"][1]).export.verify_extra_k == [BLOCK]


def test_table_means_per_arm():
    cells = [
        {"arm": "dflash", "seed": s, "steps": 2, "al": {"3": a}, "lossless": True, "wall_s": 10}
        for s, a in ((0, 1.5), (1, 2.0))
    ] + [
        {"arm": "dspark", "seed": 0, "steps": 2, "al": {"3": 1.8, "4": 1.9}, "lossless": True,
         "wall_s": 12}
    ]  # fmt: skip
    rows = markdown(cells).splitlines()
    assert rows[2] == "| dflash | 2 | 0,1 | 1.500 / 2.000 | **1.750** | - | true | 10 s |"
    assert rows[3] == "| dspark | 2 | 0 | 1.800 | **1.800** | 1.900 | true | 12 s |"
