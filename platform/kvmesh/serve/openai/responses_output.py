"""A reply's parsed deltas (chat.py `parsed_deltas`) -> Responses output items and stream events.

`OutputBuilder` is the one renderer of both shapes: `step` takes a delta and returns the
stream events it causes (`response.output_item.added`, `response.output_text.delta`, ...,
without sequence numbers), while `items` is the output as it stands. The non-streaming
route feeds it the same deltas and keeps only `items`, so a stream always reassembles to
the response the same request gets whole.

Items are opened in the order the reply writes them: a `reasoning` item for
`reasoning_content`, a `message` item for text, a `function_call` item per tool call. A
different kind of delta closes the open item (its `.done` events). Whitespace-only text
is held back until text follows it: the blank lines a model writes around its calls are
not an answer (chat sets `content` to None for them too); a reply with no item at all
still gets a message, so `output_text` is the reply's text.
"""

from __future__ import annotations

import uuid
from typing import Any


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self):
        self.items: list[dict[str, Any]] = []
        self._open: int | None = None  # output index of the item still receiving deltas
        self._calls: dict[int, int] = {}  # tool-call index -> output index
        self._held = ""  # whitespace-only text not yet shown
        self._held_logprobs: list[dict[str, Any]] = []

    def step(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The events of one parsed delta; `logprobs` are the Responses logprobs of the
        tokens it came from (shown with the text they produced)."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"], [])
        if delta.get("content"):
            events += self._content(delta["content"], logprobs or [])
        elif logprobs:
            self._held_logprobs += logprobs
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Close the output (`incomplete`: the reply was cut at max_output_tokens, which
        leaves its last item incomplete)."""
        events: list[dict[str, Any]] = []
        if not self.items:
            events += self._open_item("message")
            if self._held:
                events += self._delta(self._held, self._held_logprobs)
        events += self._close("incomplete" if incomplete else "completed")
        return events

    # -- items --------------------------------------------------------------------------------

    def _content(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        open_kind = self.items[self._open]["type"] if self._open is not None else None
        if open_kind != "message" and not text.strip():
            self._held += text
            self._held_logprobs += logprobs
            return []
        text, self._held = self._held + text, ""
        logprobs, self._held_logprobs = self._held_logprobs + logprobs, []
        return self._text("message", text, logprobs)

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self.items[self._open]["type"] != kind:
            events += self._open_item(kind)
        return events + self._delta(text, logprobs)

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        events = self._close("completed")
        if kind == "message":
            item: dict[str, Any] = {"id": item_id("msg"), "type": "message", "status": "in_progress",
                                    "role": "assistant", "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open = index = len(self.items) - 1
        events.append({"type": "response.output_item.added", "output_index": index, "item": _copy(item)})
        item["content"].append(part)
        events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "part": _copy(part)})
        return events

    def _delta(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        item = self.items[self._open]
        part = item["content"][0]
        part["text"] += text
        event: dict[str, Any] = {"item_id": item["id"], "output_index": self._open, "content_index": 0,
                                 "delta": text}
        if item["type"] == "message":
            part["logprobs"] += logprobs
            return [{"type": "response.output_text.delta", **event, "logprobs": logprobs}]
        return [{"type": "response.reasoning_text.delta", **event}]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call fragment: the first of an index opens its item (it carries id and
        name), the rest add to its arguments."""
        fn = call.get("function") or {}
        index = self._calls.get(call["index"])
        events: list[dict[str, Any]] = []
        if index is None:
            events += self._close("completed")
            self._held, self._held_logprobs = "", []  # the blank line before a call
            item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call.get("id") or item_id("call"), "name": fn.get("name", ""), "arguments": ""}
            self.items.append(item)
            self._open = index = self._calls[call["index"]] = len(self.items) - 1
            events.append({"type": "response.output_item.added", "output_index": index, "item": _copy(item)})
        self._held_logprobs = []  # the call's tokens: logprobs are only shown for text
        if fn.get("arguments"):
            item = self.items[index]
            item["arguments"] += fn["arguments"]
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": index, "delta": fn["arguments"]})
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.items[index]
        head = {"item_id": item["id"], "output_index": index}
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", **head, "name": item["name"],
                           "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append({"type": "response.output_text.done", **head, "content_index": 0, "text": part["text"],
                               "logprobs": part["logprobs"]})
            else:
                events.append({"type": "response.reasoning_text.done", **head, "content_index": 0,
                               "text": part["text"]})
            events.append({"type": "response.content_part.done", **head, "content_index": 0, "part": _copy(part)})
        if "status" in item:
            item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})
        return events


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item or part for an event: the builder keeps changing them after
    (the same step's later events included), before the event is serialised."""
    return {k: ([_copy(x) if isinstance(x, dict) else x for x in v] if isinstance(v, list) else
                _copy(v) if isinstance(v, dict) else v) for k, v in obj.items()}
