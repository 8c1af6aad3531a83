"""Reasoning parsers: split `<think>...</think>` off a reply into `reasoning_content`.

As vLLM's `--reasoning-parser` (and llama.cpp's reasoning format): the thought goes to
`reasoning_content`, the rest to `content`, in whole replies and streamed deltas alike.
Two behaviours, by name:

- `deepseek_r1`: the reply starts inside the thought (DeepSeek-R1's template opens
  `<think>` in the prompt); an opening `<think>` in the reply is optional. A reply
  without `</think>` is all reasoning (the thought was cut short).
- `qwen3`: reasoning only when the reply opens with `<think>`, or when the prompt itself
  ended with `<think>` (Qwen3 "thinking" templates that open the block for the model);
  otherwise the whole reply is content.

One state machine (`ReasoningStream`) serves both uses, so a streamed reply splits
exactly as the whole text does. Tags split across deltas are held back, never leaked.
"""

from __future__ import annotations

from typing import ClassVar

from kvmesh.chat.tool_parsers import partial_tag_len

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str]
    starts_inside: ClassVar[bool]

    def stream(self, prompt_opens_think: bool = False) -> ReasoningStream:
        return ReasoningStream(self.starts_inside or prompt_opens_think)

    def extract(self, text: str, prompt_opens_think: bool = False) -> tuple[str | None, str]:
        """(reasoning_content or None, content) of a whole reply."""
        s = self.stream(prompt_opens_think)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return (r1 + r2 if s.reasoned else None), c1 + c2


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    starts_inside = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}") from None


class ReasoningStream:
    """`feed(delta) -> (reasoning, content)`; `finish()` flushes what was held back."""

    def __init__(self, starts_inside: bool):
        self.starts_inside = starts_inside
        self.state = "start"  # start -> reasoning -> content (or start -> content)
        self.buf = ""
        self.reasoned = False  # whether the reply had a thought (reasoning_content not None)

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(OPEN):
                self.buf = head[len(OPEN):]
                self.state = "reasoning"
            elif OPEN.startswith(head) and not final:
                return "", ""  # may still become <think>
            else:
                self.state = "reasoning" if self.starts_inside else "content"
            self.reasoned = self.state == "reasoning"
        if self.state == "reasoning":
            i = self.buf.find(CLOSE)
            if i < 0:
                keep = 0 if final else partial_tag_len(self.buf, 0, CLOSE)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf = self.buf[:i], self.buf[i + len(CLOSE):]
            self.state = "after"
        if self.state == "after":  # the blank lines between </think> and the answer are dropped
            self.buf = self.buf.lstrip()
            if not self.buf and not final:
                return reasoning, ""
            self.state = "content"
        content, self.buf = self.buf, ""
        return reasoning, content
