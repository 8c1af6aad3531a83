"""A reply's text -> the OpenAI assistant message, or its streamed deltas.

`ChatOutput` chains the reasoning split (reasoning.py) and the tool-call parser
(tool_parsers.py): the reply's text deltas go in, OpenAI delta dicts come out
(`reasoning_content`, `content`, `tool_calls` fragments). The non-streaming message is
those same deltas merged (`merge_deltas`), so a streamed reply reassembles to exactly the
message the whole reply gives. The HTTP chat route uses it; a gRPC chat could too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.chat.reasoning import OPEN as THINK_OPEN
from kvmesh.chat.reasoning import ReasoningParser, ReasoningStream
from kvmesh.chat.tool_parsers import ToolCallStream, ToolParser
from kvmesh.chat.tools import ToolSet


@dataclass
class ChatOutputSpec:
    """How one request's reply is read: tool parser (None: tools off) and its call limit,
    reasoning parser, whether the prompt opened a `<think>`, and whether a call ends the
    reply with finish_reason tool_calls (not for a named choice, as OpenAI)."""

    tool_parser: ToolParser | None = None
    max_calls: int | None = None
    reasoning: ReasoningParser | None = None
    prompt_opens_think: bool = False
    calls_finish_reason: bool = True


def prompt_opens_think(prompt_tail: str) -> bool:
    """Whether the rendered prompt ends inside an opened `<think>` (thinking templates)."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


def output_spec(tools: ToolSet | None, tool_parser: ToolParser | None, constrained: bool,
                reasoning: ReasoningParser | None, prompt_tail: str = "") -> ChatOutputSpec:
    parser = None
    if tools is not None and tools.active and tool_parser is not None:
        parser = tools.parser(tool_parser, constrained)
    return ChatOutputSpec(parser, tools.max_calls if tools is not None else None, reasoning,
                          prompt_opens_think(prompt_tail), tools is None or tools.choice != "named")


class ChatOutput:
    def __init__(self, spec: ChatOutputSpec):
        self.spec = spec
        self.tools: ToolCallStream | None = spec.tool_parser.stream(spec.max_calls) if spec.tool_parser else None
        self.reasoning: ReasoningStream | None = (spec.reasoning.stream(spec.prompt_opens_think)
                                                  if spec.reasoning else None)
        self.finished = False

    @property
    def passthrough(self) -> bool:
        return self.tools is None and self.reasoning is None

    def feed(self, text: str) -> dict[str, Any]:
        """The delta of one piece of reply text ({} while everything is held back)."""
        return self._step(text, final=False)

    def finish(self) -> dict[str, Any]:
        """The delta of what was held back (call once, when the reply ends)."""
        self.finished = True
        return self._step("", final=True)

    def has_calls(self) -> bool:
        return self.tools is not None and bool(self.tools.sent)

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.spec.calls_finish_reason and self.has_calls():
            return "tool_calls"
        return reason

    def _step(self, text: str, final: bool) -> dict[str, Any]:
        if self.passthrough:
            return {"content": text} if text else {}
        deltas: list[dict[str, Any]] = []
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish() if final else self.reasoning.feed(text)
            if reasoning:
                deltas.append({"reasoning_content": reasoning})
        if self.tools is None:
            if content:
                deltas.append({"content": content})
        else:
            deltas += self.tools.feed(content) if content else []
            if final:
                deltas += self.tools.finish()
        return merge_deltas(deltas)

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply as an OpenAI assistant message (the merged stream)."""
        delta = merge_deltas([self.feed(text), self.finish()])
        msg: dict[str, Any] = {"role": "assistant", "content": delta.get("content")}
        if self.reasoning is not None:
            msg["reasoning_content"] = delta.get("reasoning_content")
        if delta.get("tool_calls"):
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in delta["tool_calls"]]
            if not (msg["content"] or "").strip():
                msg["content"] = None  # only calls (whitespace between call blocks is not an answer)
        elif msg["content"] is None:
            msg["content"] = ""
        return msg


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI deltas merged into one: text fields concatenated, tool-call fragments
    joined per index (the first fragment of an index carries its id, type and name)."""
    out: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for key in ("reasoning_content", "content"):
            if d.get(key):
                out[key] = out.get(key, "") + d[key]
        for c in d.get("tool_calls") or ():
            have = calls.get(c["index"])
            if have is None:
                calls[c["index"]] = {**c, "function": dict(c["function"])}
            else:
                fn = have["function"]
                fn["arguments"] = fn.get("arguments", "") + c["function"].get("arguments", "")
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out
