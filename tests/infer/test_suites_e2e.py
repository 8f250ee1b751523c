"""Acceptance suites end to end: the zoo EAGLE-3 export (trained, so it accepts drafts) on
every text suite (local copies in each hub schema) at temperatures 0 and 1, through
`run_suites` and the command line: lossless at T=0 on every suite, the T=1 rows ran sampled
verification (checked against the reference loop), AL floors, the JSON / table / plot / card
section, and resume (nothing decoded twice; a lost batch is decoded again; other settings are
refused)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftinfer.evaluation.config import EvalConfig, InferConfig
from draftinfer.evaluation.suite_report import (
    CARD_HEADING,
    PLOT_NAME,
    REPORT_NAME,
    SuitesReport,
    format_suites_table,
)
from draftinfer.evaluation.suite_run import run_suites
from draftinfer.files.errors import ConfigError
from tests.support.suite_data import TEXT_SUITES, write_suite_copies

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
N = 4


@pytest.fixture(scope="module")
def suite_run(zoo_run, tmp_path_factory):
    export = Path(zoo_run("eagle3")["export_dir"])
    copies = write_suite_copies(tmp_path_factory.mktemp("copies"), n=N)
    cfg = _cfg(export, copies)
    return export, copies, cfg, run_suites(cfg)


def _cfg(export: Path, copies: Path, **kw) -> InferConfig:
    cfg = InferConfig(
        drafter=str(export),
        k=3,
        batch_size=4,
        max_model_len=384,
        temperatures=[0.0, 1.0],
        progress=False,
        eval=EvalConfig(suites=list(TEXT_SUITES), path=str(copies), max_new_tokens=24),
    )
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_every_suite_is_lossless_and_accepts(suite_run):
    export, _, _, rep = suite_run
    assert [(r.suite, r.temperature) for r in rep.results] == [
        (s, t) for s in TEXT_SUITES for t in (0.0, 1.0)
    ]
    for r in rep.results:
        turns = 2 * N - N // 2 if r.suite == "spec_bench" else N  # its mt_bench rows: 2 turns
        assert (r.rows, r.requests, r.skipped, r.resumed) == (N, turns, 0, 0), r
        assert r.lossless is True and not r.mismatches, r
        assert r.rounds > r.requests and len(r.per_position) == 3
        assert r.tokens_plain > 0 and r.tokens_spec > 0 and r.seconds_spec > 0
        if r.temperature == 0.0:
            assert (r.lossless_check, r.verification) == ("plain_greedy", "greedy")
            assert r.tokens_spec == r.tokens_plain
        else:
            assert r.lossless_check == "reference_loop"
            assert r.verification == "rejection sampling (q onehot)"
    assert rep.lossless
    # The drafter accepts drafts on every suite (an untrained one stays at 1.0).
    als = {(r.suite, r.temperature): round(r.al_micro, 3) for r in rep.results}
    assert all(al > (1.15 if t == 0.0 else 1.05) for (_, t), al in als.items()), als


def _texts(folder: Path) -> dict[str, str]:
    """Request id -> the speculative output's text, from a store's batch files."""
    out = {}
    for f in folder.glob("r*.json"):
        out.update({r["id"]: r["text"] for r in json.loads(f.read_text())["requests"]})
    return out


def test_t1_rows_sampled(suite_run):
    """The T=1 requests were sampled: in every suite some outputs are not the greedy ones."""
    export, _, _, _ = suite_run
    root = export / "suites" / "requests"
    for s in TEXT_SUITES:
        t0, t1 = _texts(root / s / "t0"), _texts(root / s / "t1")
        assert t0 and t0.keys() == t1.keys()
        assert any(t0[k] != t1[k] for k in t0), s


def test_json_table_plot_and_card_section(suite_run):
    export, _, _, rep = suite_run
    out = export / "suites"
    assert SuitesReport.from_json((out / REPORT_NAME).read_text()) == rep
    assert (out / PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_suites_table(rep)
    for r in rep.results:
        assert f"{r.al_macro:.3f}" in table and f"{r.al_micro:.3f}" in table
    card = (export / "README.md").read_text()
    assert card.count(CARD_HEADING) == 1
    assert card.index(CARD_HEADING) < card.index("## Training config")
    for r in rep.results:
        t = f"{r.temperature:g}"
        assert f"| {r.suite} | {t} | {r.requests} | {r.al_macro:.3f} | {r.al_micro:.3f} |" in card
    assert f"![acceptance by benchmark](suites/{PLOT_NAME})" in card


def test_rerun_on_the_command_line_resumes_everything(suite_run):
    export, copies, _, rep = suite_run
    args = [
        sys.executable,
        "-m",
        "draftinfer",
        f"drafter={export}",
        f"eval.suites=[{','.join(TEXT_SUITES)}]",
        f"eval.path={copies}",
        "eval.max_new_tokens=24",
        "temperatures=[0,1]",
        "batch_size=4",
        "max_model_len=384",
        "progress=false",
    ]
    r = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    again = SuitesReport.from_json((export / "suites" / REPORT_NAME).read_text())
    for a, b in zip(again.results, rep.results):
        assert a.resumed == a.requests == b.requests
        assert (a.al_micro, a.al_macro, a.per_position) == (b.al_micro, b.al_macro, b.per_position)
    assert r.stdout.rstrip().endswith(format_suites_table(again).splitlines()[-1])
    assert (export / "README.md").read_text().count(CARD_HEADING) == 1  # replaced, not added


def test_a_lost_batch_is_decoded_again_and_other_settings_are_refused(suite_run, tmp_path):
    export, copies, _, rep = suite_run
    cfg = _cfg(
        export,
        copies,
        eval=EvalConfig(
            suites=["gsm8k"],
            path=str(copies / "gsm8k.parquet"),
            max_new_tokens=24,
            out_dir=str(tmp_path),
            card=False,
        ),
        batch_size=2,
    )
    first = run_suites(cfg)
    lost = sorted((tmp_path / "requests" / "gsm8k" / "t0").glob("r*.json"))[-1]
    lost.unlink()
    second = run_suites(cfg)
    r0, r1 = first.results[0], second.results[0]
    assert (r1.resumed, r1.requests) == (N - 2, N)  # one batch of 2 decoded again
    assert (r1.al_micro, r1.per_position, r1.lossless) == (r0.al_micro, r0.per_position, True)
    # The same as the standard run with batches of 4 (outputs do not depend on the batch).
    std = next(r for r in rep.results if r.suite == "gsm8k" and r.temperature == 0.0)
    assert r1.al_micro == std.al_micro
    cfg.k = 2
    with pytest.raises(ConfigError) as e:
        run_suites(cfg)
    assert "eval.resume=false" in str(e.value) and "'k'" not in str(e.value)
    assert "k: 3 there, 2 now" in str(e.value) and "\n" not in str(e.value)
    cfg.eval.resume = False
    assert run_suites(cfg).results[0].resumed == 0


def test_mmstar_image_prompts_on_a_vl_target(tmp_path):
    """MMStar (an Image column in parquet) on a Qwen3-VL target with a processor: the image
    goes through the processor into every request, the output is lossless at T=0 and T=1, and
    a drafter trained on the target's continuations of these prompts accepts drafts."""
    import torch

    from draftinfer.decoding.baseline import greedy_generate
    from draftinfer.evaluation.suite_decode import PromptRenderer
    from draftinfer.evaluation.suites import load_suite, suite_rows
    from draftinfer.files.checkpoint import write_drafter
    from draftinfer.files.loading import load_native_target
    from draftinfer.registry import family_of
    from tests.support.suite_data import write_mmstar, zoo_questions
    from tests.support.vl_data_fixtures import make_vl_target
    from tests.support.vl_drafters import build_drafter, train

    tdir = make_vl_target(tmp_path / "target")
    copy = write_mmstar(tmp_path / "mmstar.parquet", zoo_questions(4), size=(24, 16))
    rows = suite_rows(load_suite("mmstar"), str(copy))
    renderer = PromptRenderer(family_of(tdir), str(tdir), 256)
    prompts = [renderer.render(r.conversation([]), "x", {"enable_thinking": False}) for r in rows]
    target = load_native_target(tdir, "cpu", torch.float32, 4, 256)
    mm = [p.mm_inputs for p in prompts]
    assert all(m is not None for m in mm)
    cont = greedy_generate(
        target, [p.ids for p in prompts], 16, target.config.eos_token_ids, mm_inputs=mm
    )
    spec, tcfg, d = build_drafter("eagle3", target, tmp_path / "vocab")
    train(spec, tcfg, d, target, [p.ids + c for p, c in zip(prompts, cont)], mm)
    write_drafter(tmp_path / "export", d, {"target": str(tdir)}, dtype=torch.float32)
    cfg = InferConfig(
        drafter=str(tmp_path / "export"),
        batch_size=4,
        max_model_len=256,
        temperatures=[0.0, 1.0],
        progress=False,
        eval=EvalConfig(suites=["mmstar"], path=str(copy), max_new_tokens=16),
    )
    r0, r1 = run_suites(cfg).results
    for r in (r0, r1):
        assert (r.suite, r.requests, r.skipped, r.lossless) == ("mmstar", 4, 0, True)
    assert r0.tokens_spec == r0.tokens_plain and r0.al_micro > 1.3, r0.al_micro
    text = _cfg(tmp_path / "export", tmp_path, target="zoo:llama-tiny")
    text.eval = EvalConfig(suites=["mmstar"], path=str(copy))
    with pytest.raises(ConfigError, match="suite 'mmstar' has image prompts"):
        run_suites(text)
