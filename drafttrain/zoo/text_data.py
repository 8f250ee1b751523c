"""Building blocks of the target zoo: chat data from the stdlib, a BPE tokenizer, a Llama.

`python -m drafttrain.zoo.build_text` is the CLI over these functions. Everything here is deterministic
for a given Python installation (the corpus is the installed standard library's source,
read with `ast`, never imported) and a given torch thread count.

Vocabulary used below:
- *object*: a public top-level function or class of one module in `MODULES`, or a public
  method of such a class. Its *key* is the split unit: `mod` for module-level questions,
  `mod.name` for a function, `mod.Class` for a class and all its methods.
- *conversation*: `{"messages": [{"role", "content"}, ...]}`, optionally opening with a
  system turn, with one or two user/assistant exchanges about one key.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sysconfig
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Well-known pure-Python stdlib modules (their source is installed on every CPython).
# Only modules whose API is defined in the file itself: `asyncio`, `os.path`, ... re-export.
MODULES: tuple[str, ...] = tuple(
    """
    abc argparse base64 bisect bz2 calendar cmd code codecs collections colorsys
    concurrent.futures.thread configparser contextlib copy csv dataclasses datetime difflib
    dis doctest email.message email.utils enum filecmp fileinput fnmatch fractions ftplib
    functools getopt getpass gettext glob graphlib gzip hashlib heapq hmac html html.parser
    http.client http.cookies http.server imaplib importlib.util inspect ipaddress json
    json.decoder json.encoder keyword linecache locale logging logging.handlers lzma mailbox
    mimetypes netrc numbers operator optparse pathlib pickle pickletools pkgutil platform
    plistlib poplib pprint profile pstats pty py_compile pyclbr queue quopri random reprlib
    rlcompleter runpy sched secrets selectors shelve shlex shutil signal smtplib socket
    socketserver sqlite3.dump statistics string subprocess symtable sysconfig tabnanny
    tarfile tempfile textwrap threading timeit token tokenize trace traceback tracemalloc
    tty types typing unittest.mock urllib.parse urllib.request uuid warnings wave weakref
    webbrowser xml.etree.ElementTree zipapp zipfile zipimport
    """.split()
)

SYSTEM_PROMPT = (
    "You are a concise assistant that answers questions about the Python standard library."
)
MAX_DESC_WORDS = 48  # keeps descriptive answers within ~10-80 tokens
MAX_SIG_CHARS = 150
MAX_LISTED = 12


def stable_hash(text: str) -> int:
    """A 64-bit hash that, unlike `hash()`, does not change between runs or machines."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def pick(options: list[str] | tuple[str, ...], salt: str) -> str:
    return options[stable_hash(salt) % len(options)]


# ---------------------------------------------------------------------------------------
# Parsing the stdlib with ast
# ---------------------------------------------------------------------------------------


@dataclass
class Func:
    name: str
    args: str  # rendered parameter list, annotations stripped: "obj, *, skipkeys=False"
    params: list[tuple[str, str | None]]  # (display name, default source or None)
    required: list[str]  # positional parameters without defaults (self/cls excluded)
    doc: str | None  # cleaned first paragraph of the docstring


@dataclass
class Klass:
    name: str
    bases: list[str]
    doc: str | None
    init: Func | None
    methods: list[Func] = field(default_factory=list)


@dataclass
class Module:
    name: str
    doc: str | None
    funcs: list[Func]
    classes: list[Klass]


def module_file(name: str, stdlib: Path) -> Path:
    base = stdlib.joinpath(*name.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"


_ROLE = re.compile(r":[a-z:]+:`~?([^`]+)`")  # :func:`~json.dumps` -> json.dumps
_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")


def clean_doc(doc: str | None) -> str | None:
    """First paragraph of a docstring as plain ASCII prose, cut to whole sentences."""
    if not doc:
        return None
    paras = [p for p in re.split(r"\n\s*\n", doc.strip()) if p.strip()]
    # C-style docstrings open with a signature line ("dumps(obj) -> str"); skip it.
    while paras and _SIGNATURE_LINE.match(paras[0].strip().splitlines()[0]):
        lines = paras[0].strip().splitlines()[1:]
        paras = (["\n".join(lines)] if lines else []) + paras[1:]
    if not paras or ">>>" in paras[0]:
        return None
    text = unicodedata.normalize("NFKD", paras[0]).encode("ascii", "ignore").decode()
    text = _ROLE.sub(r"`\1`", text).replace("``", "`")
    text = " ".join(text.split())
    words = text.split(" ")
    if len(words) < 3:
        return None
    if len(words) > MAX_DESC_WORDS:
        cut = " ".join(words[:MAX_DESC_WORDS])
        end = max(cut.rfind(". "), cut.rfind(".) "))
        text = cut[: end + 1] if end > 40 else cut.rstrip(",;:") + " ..."
    if not text.endswith((".", "...", ")", ":", "!", "?")):
        text += "."
    return text


def _render_func(node: ast.FunctionDef | ast.AsyncFunctionDef, is_method: bool) -> Func:
    args = node.args
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    rendered = ast.unparse(args)
    positional = [*args.posonlyargs, *args.args]
    pos_defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params: list[tuple[str, str | None]] = []
    required = []
    for i, (a, d) in enumerate(zip(positional, pos_defaults)):
        if is_method and i == 0 and a.arg in ("self", "cls"):
            continue
        params.append((a.arg, None if d is None else ast.unparse(d)))
        if d is None:
            required.append(a.arg)
    if args.vararg:
        params.append(("*" + args.vararg.arg, None))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        params.append((a.arg, None if d is None else ast.unparse(d)))
    if args.kwarg:
        params.append(("**" + args.kwarg.arg, None))
    text = unicodedata.normalize("NFKD", rendered).encode("ascii", "ignore").decode()
    return Func(node.name, text, params, required, clean_doc(ast.get_docstring(node)))


def _static_all(tree: ast.Module) -> set[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


def parse_module(name: str, stdlib: Path) -> Module:
    tree = ast.parse(module_file(name, stdlib).read_text(encoding="utf-8"))
    exported = _static_all(tree)

    def public(n: str) -> bool:
        return not n.startswith("_") and (exported is None or n in exported)

    funcs, classes, seen = [], [], set()
    for node in tree.body:
        if getattr(node, "name", "_").startswith("_") or not public(node.name):
            continue
        if node.name in seen:  # platform-conditional redefinitions: keep the first
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            seen.add(node.name)
            funcs.append(_render_func(node, is_method=False))
        elif isinstance(node, ast.ClassDef):
            seen.add(node.name)
            methods, init, mseen = [], None, set()
            for sub in node.body:
                if not isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if sub.name == "__init__" and init is None:
                    init = _render_func(sub, is_method=True)
                elif not sub.name.startswith("_") and sub.name not in mseen:
                    if any(
                        ast.unparse(d).endswith((".setter", ".deleter")) for d in sub.decorator_list
                    ):
                        continue
                    mseen.add(sub.name)
                    methods.append(_render_func(sub, is_method=True))
            bases = [ast.unparse(b) for b in node.bases]
            doc = clean_doc(ast.get_docstring(node))
            classes.append(Klass(node.name, bases, doc, init, methods))
    return Module(name, clean_doc(ast.get_docstring(tree)), funcs, classes)


# ---------------------------------------------------------------------------------------
# Question/answer templates
# ---------------------------------------------------------------------------------------


def _code_list(names: list[str]) -> str:
    names = [f"`{n}`" for n in names]
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " and " + names[-1]


def _listing(names: list[str]) -> str:
    shown = _code_list(names[:MAX_LISTED])
    if len(names) > MAX_LISTED:
        shown = (
            ", ".join(f"`{n}`" for n in names[:MAX_LISTED]) + f" and {len(names) - MAX_LISTED} more"
        )
    return shown


def _param_answer(q: str, f: Func) -> str:
    if not f.params:
        return f"`{q}` takes no parameters."
    parts = [
        f"`{p}` (default `{d}`)" if d is not None else f"`{p}`" for p, d in f.params[:MAX_LISTED]
    ]
    n = len(f.params)
    tail = "" if n <= MAX_LISTED else f" and {n - MAX_LISTED} more"
    joined = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"`{q}` takes {n} parameter{'s' * (n != 1)}: {joined}{tail}."


def function_qas(mod: str, f: Func, owner: str | None = None) -> list[tuple[str, str, str]]:
    """(kind, question, answer) triples about one function or method."""
    q = f"{mod}.{owner}.{f.name}" if owner else f"{mod}.{f.name}"
    what = "method" if owner else "function"
    out = []
    if f.doc:
        ask = pick(
            [
                f"What does {q} do?",
                f"What does the {what} {q} do?",
                f"Explain {q}.",
                f"Describe the {what} {q}.",
            ],
            q + "/doc",
        )
        out.append(("doc", ask, f.doc))
    sig = f"{q}({f.args})"
    if len(sig) <= MAX_SIG_CHARS:
        ask = pick([f"What is the signature of {q}?", f"Show the signature of {q}."], q + "/sig")
        out.append(("sig", ask, f"The signature is `{sig}`."))
        if len(f.params) > 0 or not owner:
            out.append(("params", f"What parameters does {q} take?", _param_answer(q, f)))
    defaults = [(p, d) for p, d in f.params if d is not None and len(d) <= 40]
    if defaults:
        p, d = defaults[stable_hash(q + "/default") % len(defaults)]
        out.append(
            (
                "default",
                f"What is the default value of the {p} parameter of {q}?",
                f"The default value of `{p}` in `{q}` is `{d}`.",
            )
        )
    if not owner and len(sig) <= MAX_SIG_CHARS:
        call = f"{mod}.{f.name}({', '.join(f.required)})"
        out.append(
            (
                "example",
                pick([f"Show how to call {q}.", f"Give an example call of {q}."], q + "/ex"),
                f"```python\nimport {mod}\n\nresult = {call}\n```",
            )
        )
    return out


def class_qas(mod: str, c: Klass) -> list[tuple[str, str, str]]:
    q = f"{mod}.{c.name}"
    out = []
    if c.doc:
        ask = pick(
            [f"What is the {q} class?", f"What does the class {q} do?", f"Describe the class {q}."],
            q + "/doc",
        )
        out.append(("doc", ask, c.doc))
    bases = [b for b in c.bases if len(b) <= 60 and "=" not in b]
    if bases:
        out.append(
            ("bases", f"What does {q} inherit from?", f"`{q}` inherits from {_code_list(bases)}.")
        )
    elif not c.bases:
        out.append(
            (
                "bases",
                f"What does {q} inherit from?",
                f"`{q}` has no explicit base class, so it inherits from `object`.",
            )
        )
    names = [m.name for m in c.methods]
    if names:
        out.append(
            (
                "methods",
                pick(
                    [f"Which public methods does {q} define?", f"List the methods of {q}."],
                    q + "/methods",
                ),
                f"`{q}` defines {len(names)} public method{'s' * (len(names) != 1)}: {_listing(names)}.",
            )
        )
    else:
        out.append(
            (
                "methods",
                f"Which public methods does {q} define?",
                f"`{q}` defines no public methods of its own.",
            )
        )
    if c.init is not None and len(c.init.args) <= MAX_SIG_CHARS:
        call = f"{mod}.{c.name}({', '.join(c.init.required)})"
        out.append(
            (
                "construct",
                f"How do I create a {q} object?",
                f"```python\nimport {mod}\n\nobj = {call}\n```",
            )
        )
    return out


def module_qas(m: Module) -> list[tuple[str, str, str]]:
    out = []
    if m.doc:
        ask = pick(
            [f"What is the {m.name} module for?", f"Describe the {m.name} module."], m.name + "/doc"
        )
        out.append(("doc", ask, m.doc))
    if m.funcs:
        names = [f.name for f in m.funcs]
        out.append(
            (
                "functions",
                f"List the public functions of the {m.name} module.",
                f"The `{m.name}` module defines {len(names)} public function{'s' * (len(names) != 1)}: {_listing(names)}.",
            )
        )
    if m.classes:
        names = [c.name for c in m.classes]
        out.append(
            (
                "classes",
                f"List the public classes of the {m.name} module.",
                f"The `{m.name}` module defines {len(names)} public class{'es' * (len(names) != 1)}: {_listing(names)}.",
            )
        )
    return out


FOLLOW_UPS = {
    "sig": "What is the signature of {name}?",
    "params": "Which parameters does {name} take?",
    "example": "Show me how to call {name}.",
    "bases": "What is the base class of {name}?",
    "methods": "Which methods does {name} have?",
}


def conversations(modules: list[Module]) -> list[tuple[str, dict]]:
    """(split key, conversation) for every question; deterministic given the modules."""
    # "Which module defines X?" is only well-posed for names defined in exactly one module.
    counts = Counter(
        n for m in modules for n in [f.name for f in m.funcs] + [c.name for c in m.classes]
    )
    rows: list[tuple[str, dict]] = []

    def add(key: str, turns: list[tuple[str, str]]) -> None:
        msgs = []
        if stable_hash(key + turns[0][0] + "/system") % 4 == 0:
            msgs.append({"role": "system", "content": SYSTEM_PROMPT})
        for qu, an in turns:
            msgs += [{"role": "user", "content": qu}, {"role": "assistant", "content": an}]
        rows.append((key, {"messages": msgs}))

    def add_object(key: str, short: str, kind: str, qas: list[tuple[str, str, str]]) -> None:
        by_kind = {}
        for k, qu, an in qas:
            add(key, [(qu, an)])
            by_kind.setdefault(k, (qu, an))
        if counts[short] == 1:
            add(
                key,
                [
                    (
                        f"Which module defines the {kind} {short}?",
                        f"The {kind} `{short}` is defined in the `{key.rsplit('.', 1)[0]}` module.",
                    )
                ],
            )
        # One two-turn conversation per object: its description, then a follow-up.
        if "doc" in by_kind:
            follow = [k for k in FOLLOW_UPS if k in by_kind]
            if follow:
                k = follow[stable_hash(key + "/follow") % len(follow)]
                add(key, [by_kind["doc"], (FOLLOW_UPS[k].format(name=short), by_kind[k][1])])

    for m in modules:
        for _, qu, an in module_qas(m):
            add(m.name, [(qu, an)])
        for f in m.funcs:
            key = f"{m.name}.{f.name}"
            add_object(key, f.name, "function", function_qas(m.name, f))
        for c in m.classes:
            key = f"{m.name}.{c.name}"
            add_object(key, c.name, "class", class_qas(m.name, c))
            for meth in c.methods:
                for _, qu, an in function_qas(m.name, meth, owner=c.name):
                    add(key, [(qu, an)])
    return rows


def is_test_key(key: str, test_permille: int) -> bool:
    return stable_hash("split/" + key) % 1000 < test_permille


def build_chat(
    stdlib: Path | None = None, test_permille: int = 50, max_test: int = 400
) -> tuple[list[dict], list[dict]]:
    """Train/test conversations; the split is by key, so held-out objects never train."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    rows = conversations([parse_module(name, stdlib) for name in MODULES])
    train, test, seen = {}, {}, set()
    for key, conv in rows:
        blob = json.dumps(conv, sort_keys=True)
        if blob in seen:
            continue
        seen.add(blob)
        (test if is_test_key(key, test_permille) else train)[blob] = conv
    train_prompts = {
        m["content"] for c in train.values() for m in c["messages"] if m["role"] == "user"
    }
    test = {
        b: c
        for b, c in test.items()
        if not any(m["role"] == "user" and m["content"] in train_prompts for m in c["messages"])
    }
    # Files sorted by a stable hash: deterministic, and a prefix is a fair sample.
    train_rows = [train[b] for b in sorted(train, key=lambda b: (stable_hash(b), b))]
    test_rows = [test[b] for b in sorted(test, key=lambda b: (stable_hash(b), b))][:max_test]
    return train_rows, test_rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=True) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------

BOS, EOT_TEXT, START_HEADER, END_HEADER, EOT, PAD = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
)
SPECIAL_TOKENS = [BOS, EOT_TEXT, START_HEADER, END_HEADER, EOT, PAD]

# The Llama-3 chat format, written out: bos once, then every message as
# header(role) "\n\n" content|trim <|eot_id|>; the generation prompt is an open assistant header.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Pure-Python twin of `CHAT_TEMPLATE` (the tests compare the two)."""
    out = BOS + "".join(
        f"{START_HEADER}{m['role']}{END_HEADER}\n\n{m['content'].strip()}{EOT}" for m in messages
    )
    return out + (f"{START_HEADER}assistant{END_HEADER}\n\n" if add_generation_prompt else "")


# Llama-3's pre-tokenizer split (tiktoken cl100k-style): "\n\n" stays one piece, digits in 3s.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(
    train_rows: list[dict],
    vocab_size: int = 4096,
    render=None,
    specials: list[str] | None = None,
    bos: str | None = BOS,
    eos: str = EOT,
    pad: str = PAD,
    chat_template: str = CHAT_TEMPLATE,
):
    """Byte-level BPE (GPT-2 / Llama-3 style pre-tokenization) trained on the train split.

    Defaults: the Llama-3 format (`render_chat`, `SPECIAL_TOKENS`, `CHAT_TEMPLATE`); another
    chat format gives `render(messages) -> text`, its specials, bos (None: `tokenizer(text)`
    adds none, as gpt-oss's tokenizer), eos, pad and template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    render = render or render_chat
    specials = list(specials or SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on the pieces between special tokens (specials never take part in merges).
    split = re.compile("|".join(re.escape(s) for s in specials))
    texts = [p for r in train_rows for p in split.split(render(r["messages"])) if p]
    tok.train_from_iterator(texts, trainer=trainer)
    if bos is not None:
        # Like Llama-3: plain `tokenizer(text)` prepends <|begin_of_text|>; chat templates
        # render it themselves and are tokenized with add_special_tokens=False.
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        chat_template=chat_template,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def encode_with_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a 0/1 mask of assistant tokens (content + <|eot_id|>).

    Every message ends in a special token, so the ids of a rendered prefix of the chat are a
    prefix of the ids of the whole chat; the assertions check that instead of assuming it.
    """

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    full = ids(render_chat(messages))
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = ids(render_chat(messages[:i], add_generation_prompt=True))
        end = ids(render_chat(messages[: i + 1]))
        assert full[: len(start)] == start and full[: len(end)] == end, "prefix property broken"
        mask[len(start) : len(end)] = [1] * (len(end) - len(start))
    return full, mask
