"""Offline English text for calibration, distillation and held-out evaluation.

Every source ships with the Python interpreter itself (CPython's standard library,
also Debian's ``libpython3.x-stdlib``), so nothing is fetched at run time and the
text is identical on every machine with the same Python version:

* ``pydoc_data.topics`` — the Python Language Reference / Library Reference topics
  that ``help()`` shows (79 topics, ~465 KB of prose and examples in 3.11).
* Docstrings of the top-level standard-library modules (``<stdlib>/*.py``: module,
  top-level class / function and method docstrings of at least 200 characters),
  read with ``ast`` without importing anything.
* CPython's ``LICENSE.txt`` (the history of Python and the PSF license) — the text
  ``kvmesh.quant.quality`` already measures perplexity on.

Splits (deterministic, no overlap):

* ``eval``: LICENSE.txt, plus the pydoc topics whose name hashes to bucket 1 of 10.
* ``calibration``: pydoc topics and stdlib modules' docstrings in bucket 0.
* ``train``: the other pydoc topics and stdlib docstrings.

Pydoc topics repeat each other (``compound`` contains ``if``, ``while``, ...), so
splitting by topic alone would leak: every paragraph is normalised and kept only in
the first split that claims it, in the order eval, calibration, train.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SPLITS = ("calibration", "train", "eval")
_BUCKETS = 10
_CALIBRATION_BUCKET, _EVAL_BUCKET = 0, 1
_MIN_DOCSTRING_CHARS = 200


@dataclass(frozen=True)
class Document:
    """One text of a split; `source` says where it came from (for reports)."""

    source: str
    text: str


def _bucket(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % _BUCKETS


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _norm(paragraph: str) -> str:
    return " ".join(paragraph.split()).lower()


def license_document() -> Document:
    """CPython's LICENSE.txt (same file as kvmesh.quant.quality.license_text)."""
    path = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
    return Document(f"CPython {path.name}", path.read_text(encoding="utf-8"))


def pydoc_topic_documents() -> list[Document]:
    """The `help()` topics of pydoc_data, sorted by topic name."""
    from pydoc_data.topics import topics

    return [Document(f"pydoc_data.topics[{name!r}]", topics[name]) for name in sorted(topics)]


def _defs(body: list[ast.stmt]) -> list[ast.AST]:
    """Top-level functions and classes, and the methods of top-level classes (no full ast.walk: 3x faster)."""
    out: list[ast.AST] = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(node)
        elif isinstance(node, ast.ClassDef):
            out.append(node)
            out += [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return out


def stdlib_docstring_documents() -> list[Document]:
    """One document per top-level stdlib module: its long docstrings, joined by blank lines."""
    docs = []
    for file in sorted(Path(sysconfig.get_path("stdlib")).glob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        nodes = [tree, *_defs(tree.body)]
        texts = [d for d in (ast.get_docstring(n) for n in nodes) if d and len(d) >= _MIN_DOCSTRING_CHARS]
        if texts:
            docs.append(Document(f"stdlib {file.name} docstrings", "\n\n".join(texts)))
    return docs


@lru_cache(maxsize=1)
def load_splits() -> dict[str, tuple[Document, ...]]:
    """{"calibration" | "train" | "eval": documents}; no paragraph appears in two splits."""
    claimed: dict[str, list[Document]] = {"eval": [license_document()], "calibration": [], "train": []}
    for doc in pydoc_topic_documents():
        b = _bucket(doc.source)
        split = "eval" if b == _EVAL_BUCKET else "calibration" if b == _CALIBRATION_BUCKET else "train"
        claimed[split].append(doc)
    for doc in stdlib_docstring_documents():
        claimed["calibration" if _bucket(doc.source) == _CALIBRATION_BUCKET else "train"].append(doc)
    seen: set[str] = set()
    out: dict[str, tuple[Document, ...]] = {}
    for split in ("eval", "calibration", "train"):  # priority order for shared paragraphs
        kept = []
        for doc in claimed[split]:
            paras = [p for p in _paragraphs(doc.text) if _norm(p) not in seen]
            seen.update(_norm(p) for p in paras)
            if paras:
                kept.append(Document(doc.source, "\n\n".join(paras)))
        out[split] = tuple(kept)
    return out


def split_documents(split: str) -> tuple[Document, ...]:
    """The documents of one split; ValueError naming the valid splits otherwise."""
    if split not in SPLITS:
        raise ValueError(f"corpus split: {split!r} is not one of {list(SPLITS)}")
    return load_splits()[split]


def token_stream(tokenizer, split: str, max_tokens: int | None = None) -> list[int]:
    """The split's documents tokenized and concatenated, each followed by EOS (if any)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in split_documents(split):
        # verbose=False: documents may exceed the model's context; they are cut into windows later.
        ids += tokenizer(doc.text, add_special_tokens=False, verbose=False)["input_ids"]
        if eos is not None:
            ids.append(eos)
        if max_tokens is not None and len(ids) >= max_tokens:
            return ids[:max_tokens]
    return ids


def token_windows(tokenizer, split: str, seq_len: int, max_windows: int | None = None,
                  spread: bool = True) -> list[list[int]]:
    """Non-overlapping `seq_len`-token windows of the split's token stream (BOS first if any).

    Each window starts with BOS (when the tokenizer has one) followed by seq_len - 1
    corpus tokens, so every window looks like the start of a document to the model.
    With `max_windows` below the split's window count, `spread` picks windows evenly
    across the whole split (every topic and module contributes); otherwise the first
    ones (a few neighbouring documents, cheaper to tokenize).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len: {seq_len} is too short; use at least 2 tokens")
    bos = tokenizer.bos_token_id
    body = seq_len - (1 if bos is not None else 0)
    limit = None if max_windows is None or spread else max_windows * body
    return pack_windows(token_stream(tokenizer, split, limit), seq_len, bos, max_windows, split)


def pack_windows(ids: list[int], seq_len: int, bos: int | None, max_windows: int | None = None,
                 what: str = "the token stream") -> list[list[int]]:
    """Cut `ids` into seq_len windows (BOS + seq_len - 1 tokens when `bos`); at most
    `max_windows`, evenly spaced over the stream."""
    body = seq_len - (1 if bos is not None else 0)
    windows = [ids[i:i + body] for i in range(0, len(ids) - body + 1, body)]
    if bos is not None:
        windows = [[bos, *w] for w in windows]
    if not windows:
        raise ValueError(f"corpus split {what!r} has fewer than {seq_len} tokens; lower seq_len")
    if max_windows is not None and max_windows < len(windows):
        windows = [windows[i * len(windows) // max_windows] for i in range(max_windows)]
    return windows


# Instructions for teacher-generated chat data (optimize/generate.py), filled with a
# paragraph of the split: the replies are the teacher's own assistant-style text.
CHAT_TEMPLATES = (
    "Explain the following in simple terms:\n\n{p}",
    "Summarize this in one or two sentences:\n\n{p}",
    "What is the main point of this text?\n\n{p}",
    "Rewrite this paragraph so that a beginner can follow it:\n\n{p}",
    "Give a short example that illustrates this:\n\n{p}",
    "List the key facts in this passage:\n\n{p}",
)


def _is_prose(paragraph: str) -> bool:
    text = " ".join(paragraph.split())
    letters = sum(c.isalpha() or c == " " for c in text)
    return 120 <= len(text) <= 600 and letters >= 0.85 * len(text) and not paragraph.lstrip().startswith(">>>")


def chat_prompts(split: str, n: int) -> list[str]:
    """`n` deterministic user instructions about prose paragraphs of `split`, evenly spread
    over its documents, cycling through CHAT_TEMPLATES."""
    paras = [" ".join(p.split()) for d in split_documents(split) for p in _paragraphs(d.text) if _is_prose(p)]
    if not paras:
        raise ValueError(f"corpus split {split!r} has no prose paragraphs for chat prompts")
    picked = [paras[i * len(paras) // n] for i in range(n)] if n <= len(paras) else [paras[i % len(paras)]
                                                                                   for i in range(n)]
    return [CHAT_TEMPLATES[i % len(CHAT_TEMPLATES)].format(p=p) for i, p in enumerate(picked)]


def describe_sources() -> str:
    """One line per split: how many documents and characters, from which sources."""
    lines = []
    for split in SPLITS:
        docs = split_documents(split)
        kinds = sorted({d.source.split("[")[0].split(" docstrings")[0].rsplit(" ", 1)[0] for d in docs})
        lines.append(f"{split}: {len(docs)} documents, {sum(len(d.text) for d in docs):,} chars from {kinds}")
    return "\n".join(lines)
