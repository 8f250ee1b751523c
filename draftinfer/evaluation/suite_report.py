"""The acceptance-suite report: one typed record per (suite, temperature), and everything
written from it (one definition each): the JSON (`suites.json`), the table printed last, the
plot (AL by suite, acceptance by draft position) and the model card's "Acceptance by
benchmark" section (`card_section`, which `drafttrain.export.card` places in the card it builds and
`splice_card_section` puts into an existing card).

AL, two averages (`draftinfer.conventions.metrics`): *micro* = mean over every round of every request
(the engines' global counters: NeMo Automodel, speculators, SpecForge), *macro* = mean over
requests of each request's AL (vLLM's acceptance tests, z-lab). Both include the bonus token.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from draftinfer.files.checkpoint import atomic_write_text

# The default folder of a suite run inside the drafter directory, and its files.
SUITES_DIR = "suites"
REPORT_NAME = "suites.json"
PLOT_NAME = "suites.png"
CARD_HEADING = "## Acceptance by benchmark"


@dataclass
class SuiteResult:
    """One suite at one temperature."""

    suite: str
    temperature: float
    protocol: str
    source: str  # what was read: the hub id / URL, or the local copy
    rows: int  # dataset rows used
    requests: int  # decoded requests (rows x turns; too-long prompts not counted)
    skipped: int  # prompts that do not fit max_model_len (not decoded)
    capped: int  # requests stopped by max_model_len before max_new_tokens or EOS
    rounds: int
    al_micro: float  # mean over all rounds of (accepted + 1)
    al_macro: float  # mean over requests of each request's AL
    per_position: list[float]  # [K] P(drafts 1..j all accepted) over rounds drafting >= j
    lossless: bool | None  # None: not checked
    lossless_check: str  # "plain_greedy" | "reference_loop" | "none"
    verification: str  # "greedy" or "rejection sampling (q onehot|full)"
    mismatches: list[str] = field(default_factory=list)  # ids of requests that differ
    tokens_plain: int = 0
    tokens_spec: int = 0
    seconds_plain: float = 0.0
    seconds_spec: float = 0.0
    resumed: int = 0  # requests read back from an earlier run of the same settings

    @property
    def tokens_per_s_plain(self) -> float:
        return self.tokens_plain / self.seconds_plain if self.seconds_plain else math.nan

    @property
    def tokens_per_s_spec(self) -> float:
        return self.tokens_spec / self.seconds_spec if self.seconds_spec else math.nan

    @property
    def speedup(self) -> float:
        return self.tokens_per_s_spec / self.tokens_per_s_plain


@dataclass
class SuitesReport:
    """A `python -m draftinfer eval=...` run: the setup, then one `SuiteResult` per suite and
    temperature (suite-major, temperatures in the order asked)."""

    drafter: str
    drafter_kind: str
    target: str
    device: str
    dtype: str
    mode: str
    k: int
    verify: str
    top_k: int
    top_p: float
    batch_size: int
    max_model_len: int
    results: list[SuiteResult] = field(default_factory=list)

    @property
    def lossless(self) -> bool:
        """No checked result failed (unchecked ones do not count either way)."""
        return all(r.lossless is not False for r in self.results)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        for r, obj in zip(d["results"], self.results):
            r.update(
                tokens_per_s_plain=obj.tokens_per_s_plain,
                tokens_per_s_spec=obj.tokens_per_s_spec,
                speedup=obj.speedup,
            )
        return json.dumps(d, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> SuitesReport:
        d = json.loads(text)
        names = {f.name for f in dataclasses.fields(SuiteResult)}
        results = [SuiteResult(**{k: v for k, v in r.items() if k in names}) for r in d["results"]]
        return cls(**{**d, "results": results})

    def write(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / REPORT_NAME, self.to_json())
        return out_dir / REPORT_NAME


def read_suites_report(out_dir: Path) -> SuitesReport | None:
    path = Path(out_dir) / REPORT_NAME
    return SuitesReport.from_json(path.read_text()) if path.is_file() else None


def _lossless_text(r: SuiteResult) -> str:
    if r.lossless is None:
        return "unchecked"
    return f"{r.lossless} ({r.lossless_check})"


def _t(x: float) -> str:
    return f"{x:g}"


def format_suites_table(rep: SuitesReport) -> str:
    """The table `python -m draftinfer eval=...` prints last."""
    head = [
        f"drafter  {rep.drafter_kind} {rep.drafter}",
        f"target   {rep.target} ({rep.device}, {rep.dtype}); k={rep.k}, verify={rep.verify}, "
        f"batch {rep.batch_size}, max_model_len {rep.max_model_len}",
        "AL micro = mean over rounds, macro = mean over requests; pos j = P(drafts 1..j accepted)",
    ]
    cols = ["suite", "T", "requests", "rounds", "AL macro", "AL micro", "per-position"]
    cols += ["lossless", "tok/s plain | spec", "speedup"]
    rows = []
    for r in rep.results:
        rows.append(
            [
                r.suite,
                _t(r.temperature),
                f"{r.requests}" + (f" (+{r.skipped} too long)" if r.skipped else ""),
                str(r.rounds),
                f"{r.al_macro:.3f}",
                f"{r.al_micro:.3f}",
                " ".join(f"{v:.2f}" for v in r.per_position),
                _lossless_text(r),
                f"{r.tokens_per_s_plain:.1f} | {r.tokens_per_s_spec:.1f}",
                f"{r.speedup:.2f}x",
            ]
        )
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    notes = [
        f"note: {r.suite} T={_t(r.temperature)}: {r.capped} of {r.requests} requests stopped at "
        f"max_model_len={rep.max_model_len} before max_new_tokens"
        for r in rep.results
        if r.capped
    ]
    return "\n".join(
        [*head, "", line(cols), line(["-" * w for w in widths])]
        + [line(row) for row in rows]
        + notes
    )


def save_suites_plot(rep: SuitesReport, path: Path) -> Path:
    """One PNG: AL (micro bars, macro marks) by suite and temperature, and per-position
    acceptance by suite (one line per suite, a line style per temperature)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(dict.fromkeys(r.suite for r in rep.results))
    temps = list(dict.fromkeys(r.temperature for r in rep.results))
    by = {(r.suite, r.temperature): r for r in rep.results}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(temps)
    for j, t in enumerate(temps):
        xs = [i + (j - (len(temps) - 1) / 2) * width for i in range(len(suites))]
        micro = [by[s, t].al_micro if (s, t) in by else math.nan for s in suites]
        macro = [by[s, t].al_macro if (s, t) in by else math.nan for s in suites]
        bars = a.bar(xs, micro, width * 0.9, label=f"T={_t(t)} micro")
        a.scatter(xs, macro, marker="_", s=200, color="black", zorder=3)
        for x, v in zip(xs, micro):
            if not math.isnan(v):
                a.text(x, v + 0.03, f"{v:.2f}", ha="center", fontsize=7)
        bars.set_label(f"T={_t(t)}")
    a.scatter([], [], marker="_", color="black", label="macro AL")
    a.set_xticks(range(len(suites)))
    a.set_xticklabels(suites, rotation=20, fontsize=8)
    a.set_ylabel("acceptance length (micro bars)")
    a.set_ylim(1, max([r.al_micro for r in rep.results] + [1.5]) * 1.12)
    a.legend(fontsize=7)
    styles = ["-", "--", ":", "-."]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(suites):
        for j, t in enumerate(temps):
            if (s, t) in by:
                pos = by[s, t].per_position
                b.plot(
                    range(1, len(pos) + 1),
                    pos,
                    styles[j % len(styles)],
                    marker="o",
                    color=colors[i % len(colors)],
                    label=f"{s} T={_t(t)}",
                )
    b.set_xlabel("draft position j")
    b.set_ylabel("P(drafts 1..j all accepted)")
    b.set_ylim(0, 1.05)
    b.set_xticks(range(1, rep.k + 1))
    b.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{rep.drafter_kind} k={rep.k} on {Path(rep.target).name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def card_section(rep: SuitesReport, plot: str | None = None) -> list[str]:
    """The model card's "Acceptance by benchmark" section (markdown lines); `plot` is the
    plot's path relative to the card."""
    lines = [
        CARD_HEADING,
        "",
        f"`python -m draftinfer` loaded this drafter from disk and decoded each suite against "
        f"`{rep.target}` ({rep.device}, {rep.dtype}, k={rep.k}, verify `{rep.verify}`), with "
        "the chat template and the prompt each suite's anchors use (thinking off). AL includes "
        "the bonus token; *macro* = mean over requests (vLLM acceptance tests, z-lab), *micro* "
        "= mean over rounds (engine counters); pos j = P(drafts 1..j all accepted).",
        "",
        "| suite | T | requests | AL macro | AL micro | "
        + " | ".join(f"pos {j + 1}" for j in range(rep.k))
        + " | lossless | speedup |",
        "|---|---|---|---|---|" + "---|" * rep.k + "---|---|",
    ]
    for r in rep.results:
        pos = [f"{v:.3f}" for v in r.per_position] + [""] * (rep.k - len(r.per_position))
        lines.append(
            f"| {r.suite} | {_t(r.temperature)} | {r.requests} | {r.al_macro:.3f} | "
            f"{r.al_micro:.3f} | " + " | ".join(pos) + f" | {_lossless_text(r)} | "
            f"{r.speedup:.2f}x |"
        )
    lines += [
        "",
        "Protocols: "
        + "; ".join(
            f"{s} - {p}" for s, p in dict((r.suite, r.protocol) for r in rep.results).items()
        )
        + ".",
    ]
    if plot:
        lines += ["", f"![acceptance by benchmark]({plot})"]
    return lines


def splice_card_section(card: Path, section: list[str], before: str = "## Training config") -> None:
    """Put `section` into the markdown file `card`: in place of an earlier copy (from its
    heading to the next `## ` heading), else before the `before` heading, else at the end."""
    text = card.read_text()
    lines = text.split("\n")
    block = [*section, ""]
    if CARD_HEADING in lines:
        start = lines.index(CARD_HEADING)
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        lines[start:end] = block
    elif before in lines:
        i = lines.index(before)
        lines[i:i] = block
    else:
        lines += ["", *block]
    atomic_write_text(card, "\n".join(lines))
