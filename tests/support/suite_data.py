"""Local copies of every acceptance suite in its hub dataset's own schema (columns, nesting,
file format), for tests: the suites load them through `datasets.load_dataset` exactly as they
load the hub data. The text of each prompt is a held-out zoo question (`zoo:chat` test split),
so the zoo target answers in its own domain and a zoo drafter accepts drafts.

Schemas (the hub datasets' columns):
- mt_bench (HuggingFaceH4/mt_bench_prompts, jsonl): prompt_id, prompt [2 turns], category,
  reference [str]
- gsm8k (openai/gsm8k main, parquet): question, answer
- humaneval (openai/openai_humaneval, parquet): task_id, prompt, canonical_solution, test,
  entry_point
- math500 (HuggingFaceH4/MATH-500, jsonl): problem, solution, answer, subject, level, unique_id
- alpaca (tatsu-lab/alpaca, parquet): instruction, input (often ""), output, text
- speed_bench (nvidia/SPEED-Bench qualitative, a directory with test.jsonl): question_id,
  category, sub_category, turns [str], source, src_id
- spec_bench (Spec-Bench question.jsonl): question_id, category, turns [1 or 2 str]
- mmstar (Lin-Chen/MMStar val, parquet with an Image feature): index, question, image,
  answer, category, l2_category, meta_info
- chat (zoo chat data, jsonl): messages
"""

from __future__ import annotations

import json
from pathlib import Path

from draftinfer.files.paths import resolve_path

TEXT_SUITES = (
    "mt_bench",
    "gsm8k",
    "humaneval",
    "math500",
    "alpaca",
    "speed_bench",
    "spec_bench",
    "chat",
)


def zoo_questions(n: int) -> list[str]:
    """The first user turns of the zoo's held-out conversations."""
    out = []
    for line in Path(resolve_path("zoo:chat"), "test.jsonl").read_text().splitlines():
        msgs = json.loads(line)["messages"]
        out.append(next(m["content"] for m in msgs if m["role"] == "user"))
        if len(out) == n:
            return out
    return out


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict], features=None) -> Path:
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    datasets.Dataset.from_dict(cols, features=features).to_parquet(str(path))
    return path


def write_suite_copies(root: Path, n: int = 4, image: bool = False) -> Path:
    """`root/<suite>.{jsonl,parquet}` (or `root/<suite>/`) for every text suite, plus mmstar
    with `image=True`; `n` rows each. Returns `root`."""
    q = zoo_questions(2 * n + 1)
    root = Path(root)
    _jsonl(
        root / "mt_bench.jsonl",
        [
            {
                "prompt_id": 81 + i,
                "prompt": [q[i], q[i + n]],
                "category": "writing",
                "reference": [],
            }
            for i in range(n)
        ],
    )
    _parquet(
        root / "gsm8k.parquet",
        [{"question": q[i], "answer": "#### 42"} for i in range(n)],
    )
    _parquet(
        root / "humaneval.parquet",
        [
            {
                "task_id": f"HumanEval/{i}",
                "prompt": f'def f{i}(x):\n    """{q[i]}"""\n',
                "canonical_solution": "    return x\n",
                "test": "def check(f):\n    assert f(1) == 1\n",
                "entry_point": f"f{i}",
            }
            for i in range(n)
        ],
    )
    _jsonl(
        root / "math500.jsonl",
        [
            {
                "problem": q[i],
                "solution": "It is $2$.",
                "answer": "2",
                "subject": "Algebra",
                "level": 1,
                "unique_id": f"test/algebra/{i}.json",
            }
            for i in range(n)
        ],
    )
    # Alpaca: every other row has an input (the template adds it only then).
    _parquet(
        root / "alpaca.parquet",
        [
            {
                "instruction": q[i],
                "input": "" if i % 2 == 0 else q[i + n],
                "output": "ok",
                "text": "",
            }
            for i in range(n)
        ],
    )
    _jsonl(
        root / "speed_bench" / "test.jsonl",
        [
            {
                "question_id": f"q{i}",
                "category": "qa",
                "sub_category": "",
                "turns": [q[i]],
                "source": "zoo",
                "src_id": str(i),
            }
            for i in range(n)
        ],
    )
    # Spec-Bench: its mt_bench task has two turns, the other tasks one.
    _jsonl(
        root / "spec_bench.jsonl",
        [
            {
                "question_id": i + 1,
                "category": "mt_bench" if i < n // 2 else "qa",
                "turns": [q[i], q[i + n]] if i < n // 2 else [q[i]],
            }
            for i in range(n)
        ],
    )
    lines = Path(resolve_path("zoo:chat"), "test.jsonl").read_text().splitlines()[:n]
    (root / "chat.jsonl").write_text("".join(ln + "\n" for ln in lines))
    if image:
        write_mmstar(root / "mmstar.parquet", q[:n])
    return root


def write_mmstar(path: Path, questions: list[str], size: tuple[int, int] = (64, 96)) -> Path:
    """MMStar's schema with small real images of `size` (width, height): an `Image` feature,
    stored as parquet bytes as on the hub."""
    import datasets
    from PIL import Image

    features = datasets.Features(
        {
            "index": datasets.Value("int64"),
            "question": datasets.Value("string"),
            "image": datasets.Image(),
            "answer": datasets.Value("string"),
            "category": datasets.Value("string"),
            "l2_category": datasets.Value("string"),
            "meta_info": {"source": datasets.Value("string")},
        }
    )
    colors = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]
    rows = [
        {
            "index": i,
            "question": f"{text}\nOptions: A: yes, B: no",
            "image": Image.new("RGB", size, colors[i % len(colors)]),
            "answer": "A",
            "category": "coarse perception",
            "l2_category": "image scene and topic",
            "meta_info": {"source": "zoo"},
        }
        for i, text in enumerate(questions)
    ]
    return _parquet(path, rows, features)
