"""Text plumbing of prompt compression (no torch): the `<context>` markup of a prompt
string, splitting a context into units (paragraphs, sentences, words) as character
spans, counting tokens per unit, choosing units under a token budget, and rendering
the kept units back into clean text.

Invariant: units never cut inside a word, and a rendered context is made only of
verbatim unit text joined by whitespace, so kept words are re-detokenized exactly.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from kvmesh.errors import InvalidRequestError

OPEN, CLOSE = "<context>", "</context>"
_TAG = re.compile(r"</?context>")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n\s*")
# A sentence ends at . ! ? (plus closing quotes/brackets) followed by whitespace, or at a newline.
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n\s*")
_WORD = re.compile(r"\S+")

Span = tuple[int, int]  # [start, end) character offsets


@dataclass(frozen=True)
class MarkedPrompt:
    """A prompt string cut at its context spans: fixed[0] contexts[0] fixed[1] ... fixed[n].

    `fixed` pieces (instruction, question, anything else outside the tags) are kept
    byte for byte; the tags themselves are dropped from a compressed prompt.
    """

    fixed: list[str]
    contexts: list[str]


def parse_marked_prompt(prompt: str) -> MarkedPrompt:
    """Split a prompt at `<context>...</context>` spans (several allowed, not nested)."""
    fixed, contexts, pos, inside = [], [], 0, False
    for m in _TAG.finditer(prompt):
        is_open = m.group() == OPEN
        if is_open == inside:
            where = f"at character {m.start()}"
            raise InvalidRequestError(
                "prompt", f"unbalanced {m.group()} {where}: context spans are <context>...</context>, "
                          "closed before the next one opens (no nesting)")
        (contexts if inside else fixed).append(prompt[pos:m.start()])
        pos, inside = m.end(), not inside
    if inside:
        raise InvalidRequestError("prompt", f"{OPEN} is never closed: add {CLOSE} after the context")
    fixed.append(prompt[pos:])
    if not contexts:
        raise InvalidRequestError(
            "compression", f"the prompt marks no compressible context: wrap the retrieved documents in "
                           f"{OPEN}...{CLOSE} (text outside the tags is never compressed)")
    return MarkedPrompt(fixed, contexts)


def default_question(marked: MarkedPrompt) -> str:
    """The text after the last context span, else the text before the first one."""
    return marked.fixed[-1].strip() or marked.fixed[0].strip()


def _pieces(text: str, breaks: re.Pattern, start: int = 0, end: int | None = None) -> list[Span]:
    """Non-blank stripped spans of text[start:end] between matches of `breaks`."""
    end = len(text) if end is None else end
    out, pos = [], start
    for m in breaks.finditer(text, start, end):
        out.append((pos, m.start()))
        pos = m.end()
    out.append((pos, end))
    spans = []
    for s, e in out:
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if s < e:
            spans.append((s, e))
    return spans


def paragraph_spans(text: str) -> list[Span]:
    return _pieces(text, _PARAGRAPH_BREAK)


def sentence_spans(text: str) -> list[Span]:
    return [s for p in paragraph_spans(text) for s in _pieces(text, _SENTENCE_BREAK, *p)]


def word_spans(text: str) -> list[Span]:
    return [m.span() for m in _WORD.finditer(text)]


def render(text: str, spans: list[Span]) -> str:
    """Kept spans (sorted, disjoint) of `text` as clean text.

    Neighbouring kept units keep the whitespace between them; across dropped text the
    separator is a blank line, a newline or a space, whichever the dropped gap held.
    """
    out: list[str] = []
    prev = None
    for s, e in spans:
        if prev is not None:
            gap = text[prev:s]
            if gap.isspace() or not gap:
                out.append(gap)
            else:
                out.append("\n\n" if "\n\n" in gap else "\n" if "\n" in gap else " ")
        out.append(text[s:e])
        prev = e
    return "".join(out)


class TokenCounter:
    """Counts tokens of text under one tokenizer (the served model's, so a ratio means
    what the model will see). Special tokens are not counted."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def count_spans(self, text: str, spans: list[Span]) -> list[int]:
        """Tokens per span when the whole text is tokenized once (fast tokenizers: a
        token belongs to the span holding its last character); per-span encode otherwise."""
        if not spans:
            return []
        if len(spans) < 16 or not getattr(self.tokenizer, "is_fast", False):
            return [self.count(text[s:e]) for s, e in spans]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = [s for s, _ in spans]
        counts = [0] * len(spans)
        for ts, te in enc["offset_mapping"]:
            if te <= ts:
                continue
            i = bisect.bisect_right(starts, te - 1) - 1
            if i >= 0 and te - 1 < spans[i][1]:
                counts[i] += 1
        return counts


def select_under_budget(scores: list[float], costs: list[int], budget: float, min_keep: int = 0) -> list[int]:
    """Indices to keep, ascending: greedily the highest scores whose costs fit `budget`
    (a unit that does not fit is skipped, smaller ones may still fit); the best
    `min_keep` units are kept even when they overflow it."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    kept, used = [], 0
    for rank, i in enumerate(order):
        if used + costs[i] <= budget or rank < min_keep:
            kept.append(i)
            used += costs[i]
    return sorted(kept)
