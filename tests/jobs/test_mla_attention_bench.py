"""`draftbench.mla_attention` runs on the CPU (`--tiny`) and its baseline, the SDPA call the
absorbed attention replaced, agrees with `LatentAttention.attend_absorbed`."""

from draftbench.mla_attention import main


def test_the_bench_runs_and_the_two_computations_agree():
    rows = main(["--device", "cpu", "--tiny"])
    assert len(rows) == 4
    assert all(r["max_abs_diff"] < 1e-5 for r in rows)
