"""The compression library call: `compress(instruction, contexts, question, options)`
and `compress_prompt(prompt, options)` for a prompt string that marks its context with
`<context>...</context>`.

Compressors (the LM of the token method, MiniLM of the passage method) load lazily,
once per process, on first use, and are shared by every thread afterwards.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.checkpoint.files import load_tokenizer, resolve_model_path
from kvmesh.compress.options import CompressionOptions, parse_options
from kvmesh.compress.text import (
    MarkedPrompt,
    Span,
    TokenCounter,
    default_question,
    parse_marked_prompt,
    render,
    select_under_budget,
)
from kvmesh.errors import InvalidRequestError


class Compressor(Protocol):
    """A compression method: cuts contexts into units and scores them (higher = keep)."""

    name: str
    min_keep: int

    def units(self, contexts: list[str], options: CompressionOptions) -> list[list[Span]]: ...

    def score(self, contexts: list[str], units: list[list[Span]], question: str) -> list[list[float]]: ...


# method name -> "module:Class" of its compressor; a new method registers here (and in
# options.Method). Compressors load a model (torch, sentence-transformers) when built, so
# they are plugins imported by name on first use: importing kvmesh.compress (the router
# does) loads neither.
COMPRESSORS: dict[str, str] = {"token": "kvmesh.compress.token:TokenCompressor",
                               "passage": "kvmesh.compress.passage:PassageCompressor"}
_loaded: dict[str, Compressor] = {}
# Kept context may exceed original/target_ratio by this factor before the budget is re-fit.
_BUDGET_SLACK, _BUDGET_ROUNDS = 1.02, 4
_lock = threading.Lock()
_default_tokenizer: Any = None


def get_compressor(method: str) -> Compressor:
    """The process-wide compressor for `method`, built on first use."""
    if method not in COMPRESSORS:
        raise InvalidRequestError("compression.method", f"unknown method {method!r}; use one of {sorted(COMPRESSORS)}")
    with _lock:
        if method not in _loaded:
            module, name = COMPRESSORS[method].split(":")
            _loaded[method] = getattr(importlib.import_module(module), name)()
        return _loaded[method]


def default_tokenizer():
    """The embedded model's tokenizer: what counts tokens when the caller gives none."""
    global _default_tokenizer
    with _lock:
        if _default_tokenizer is None:
            _default_tokenizer = load_tokenizer(resolve_model_path(None, progress=False))
        return _default_tokenizer


@dataclass(frozen=True)
class KeptSpan:
    """A kept piece of context number `context`: characters [start, end) of its original text."""

    context: int
    start: int
    end: int


@dataclass
class CompressedPrompt:
    """The result of one compression.

    Token counts are under the tokenizer given to the call (the served model's), without
    special tokens. `original_tokens` / `kept_tokens` cover the whole prompt,
    `*_context_tokens` the compressible context only (what target_ratio is about).
    """

    text: str
    contexts: list[str]
    kept_spans: list[KeptSpan]
    original_tokens: int
    kept_tokens: int
    original_context_tokens: int
    kept_context_tokens: int
    method: str
    seconds: float = 0.0
    scores: list[list[float]] = field(default_factory=list, repr=False)

    @property
    def context_ratio(self) -> float:
        """Achieved original / kept context tokens (inf when nothing was kept)."""
        return self.original_context_tokens / self.kept_context_tokens if self.kept_context_tokens else float("inf")


def _compress_contexts(contexts: list[str], question: str, options: CompressionOptions,
                       counter: TokenCounter) -> tuple[list[str], list[KeptSpan], list[list[float]], int]:
    """Compressed contexts, kept spans, unit scores and the original context token count."""
    original = sum(counter.count(c) for c in contexts)
    if options.target_ratio == 1.0 or original == 0:
        spans = [KeptSpan(i, 0, len(c)) for i, c in enumerate(contexts) if c]
        return list(contexts), spans, [], original
    if options.method == "passage" and not question.strip():
        raise InvalidRequestError("compression.question", "the passage method ranks passages against a question: "
                                                          "set compression.question or put the question after "
                                                          "the last context span")
    comp = get_compressor(options.method)
    units = comp.units(contexts, options)
    scores = comp.score(contexts, units, question)
    flat = [(ci, span) for ci, spans in enumerate(units) for span in spans]
    flat_scores = [s for row in scores for s in row]
    costs = [n for c, spans in zip(contexts, units) for n in counter.count_spans(c, spans)]
    target = budget = original / options.target_ratio
    for _ in range(_BUDGET_ROUNDS):
        per_context: list[list[Span]] = [[] for _ in contexts]
        for i in select_under_budget(flat_scores, costs, budget, comp.min_keep):
            ci, span = flat[i]
            per_context[ci].append(span)
        kept = [render(c, spans) for c, spans in zip(contexts, per_context)]
        # Rendered text re-tokenizes a little differently from the sum of its units
        # (separators, merges across dropped words): shrink the budget to compensate.
        used = sum(counter.count(c) for c in kept)
        if used <= target * _BUDGET_SLACK:
            break
        budget *= target / used
    kept_spans = [KeptSpan(ci, s, e) for ci, spans in enumerate(per_context) for s, e in spans]
    return kept, kept_spans, scores, original


def _check_contexts(contexts: list[str]) -> None:
    if not isinstance(contexts, list) or not all(isinstance(c, str) for c in contexts):
        raise InvalidRequestError("contexts", "must be a list of strings")


def compress(instruction: str, contexts: list[str], question: str,
             options: CompressionOptions | dict | None = None, *, tokenizer=None) -> CompressedPrompt:
    """Compress retrieved `contexts` for a prompt `instruction + contexts + question`.

    The result's text is the instruction, the kept contexts and the question joined by
    blank lines (empty parts left out); instruction and question are never changed.
    `tokenizer` counts tokens (default: the embedded model's).
    """
    _check_contexts(contexts)
    opts = parse_options(options) or CompressionOptions()
    counter = TokenCounter(tokenizer or default_tokenizer())
    t0 = time.perf_counter()
    kept, spans, scores, orig_ctx = _compress_contexts(contexts, opts.question or question, opts, counter)

    def assemble(ctx: list[str]) -> str:
        body = "\n\n".join(c for c in ctx if c)
        return "\n\n".join(p for p in (instruction, body, question) if p)

    text = assemble(kept)
    return CompressedPrompt(text, kept, spans, counter.count(assemble(contexts)), counter.count(text), orig_ctx,
                            sum(counter.count(c) for c in kept), opts.method, time.perf_counter() - t0, scores)


def compress_prompt(prompt: str, options: CompressionOptions | dict | None = None, *,
                    tokenizer=None) -> CompressedPrompt:
    """Compress the `<context>...</context>` spans of a prompt string.

    Text outside the spans is kept byte for byte and the tags are dropped; a prompt
    without any span is an error (InvalidRequestError on `compression`).
    """
    if not isinstance(prompt, str):
        raise InvalidRequestError("compression", "needs a text prompt (with <context>...</context> spans), "
                                                 "not token ids")
    opts = parse_options(options) or CompressionOptions()
    marked: MarkedPrompt = parse_marked_prompt(prompt)
    counter = TokenCounter(tokenizer or default_tokenizer())
    t0 = time.perf_counter()
    question = opts.question or default_question(marked)
    kept, spans, scores, orig_ctx = _compress_contexts(marked.contexts, question, opts, counter)
    pieces = [marked.fixed[0]]
    for ctx, fixed in zip(kept, marked.fixed[1:]):
        pieces += [ctx, fixed]
    text = "".join(pieces)
    return CompressedPrompt(text, kept, spans, counter.count(prompt), counter.count(text), orig_ctx,
                            sum(counter.count(c) for c in kept), opts.method, time.perf_counter() - t0, scores)
