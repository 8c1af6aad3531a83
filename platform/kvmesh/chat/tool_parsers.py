"""Tool-call parsers: the model's text -> content plus OpenAI tool calls, whole or streamed.

Each format (`hermes`, `llama3_json`, `mistral`, as vLLM's `--tool-call-parser` names
them) is one `ToolParser.step(text, pos, final)`: it classifies the text from `pos` as
content, as complete calls, or as still undecided (`Pending`, with the calls seen so far).
One driver, `ToolCallStream`, runs the steps for both uses: streaming feeds it text deltas
and gets OpenAI-shaped deltas back; `ToolParser.extract` feeds the whole text at once and
assembles the same deltas. The two therefore agree by construction, whatever the split.

Invariants a step keeps: with `final=False` it decides (Content / Calls) only what no
continuation of the text can change, and a Pending call's name and arguments only grow as
the text does. So the stream never emits content that later turns out to be a tag, and the
argument fragments it emits concatenate to the final arguments. Arguments are the model's
own JSON text of the arguments object (exactly what the fragments add up to), not a
re-serialisation. At the end of the text (`final=True`) a call cut short (max_tokens) whose
name is known stays a call with its truncated arguments, as OpenAI reports one; text that
cannot be a call (bad JSON, unknown keys, no name) stays content: never an error.
A call is announced only once its arguments object has begun, so the one case the
stream cannot undo is a call whose arguments were already streaming and then turn
invalid (or gain a stray key after them): that call's deltas stay as sent, while the
whole-text path makes it content.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvmesh.chat.jsonscan import Incomplete, Invalid, ObjectScan, object_scan, skip_ws, value_end

ARGUMENT_KEYS = ("arguments", "parameters")
_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates require 9 alphanumeric characters."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass
class ToolCall:
    """One parsed call; `arguments` is the JSON text of the arguments object."""

    name: str
    arguments: str
    id: str = field(default_factory=openai_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class PartialCall:
    """A call as far as the text goes: `name` None until it is known."""

    name: str | None
    arguments: str = ""


@dataclass
class Content:
    end: int  # text[pos:end] is content


@dataclass
class Calls:
    end: int  # text[pos:end] is these calls (possibly none: consumed separators)
    calls: list[PartialCall]


@dataclass
class Pending:
    calls: list[PartialCall]  # undecided from pos; these calls are in progress


Step = Content | Calls | Pending


def partial_tag_len(s: str, pos: int, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `s[pos:]` ends with."""
    for k in range(min(len(tag) - 1, len(s) - pos), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


def content_until(s: str, pos: int, final: bool, tag: str) -> Step | None:
    """Content up to the next `tag` (holding back a tail that may begin it); None when
    the tag is at `pos`."""
    i = s.find(tag, pos)
    if i == pos:
        return None
    if i > pos:
        return Content(i)
    end = len(s) if final else len(s) - partial_tag_len(s, pos, tag)
    return Content(end) if end > pos else Pending([])


def decode_call(s: str, scan: ObjectScan) -> PartialCall:
    """The call an object `{"name": ..., "arguments": {...}}` describes, as far as it goes.
    Raises Invalid for anything else (other keys, a non-string name, non-object arguments)."""
    args = [m for m in scan.members if m.key in ARGUMENT_KEYS]
    if len(args) > 1 or any(m.key != "name" and m.key not in ARGUMENT_KEYS for m in scan.members):
        raise Invalid("not a tool call object")
    name = None
    name_m = scan.get("name")
    if name_m is not None and name_m.start is not None:
        if s[name_m.start] != '"':
            raise Invalid("the name is not a string")
        if name_m.end is not None:
            name = json.loads(s[name_m.start:name_m.end])
            if not name:
                raise Invalid("empty name")
    arguments = ""
    if args and args[0].start is not None:
        if s[args[0].start] != "{":
            raise Invalid("the arguments are not an object")
        arguments = s[args[0].start:args[0].end if args[0].end is not None else len(s)]
    elif scan.end is not None:
        arguments = "{}"  # {"name": "now"}: a call without parameters
    if scan.end is not None and name is None:
        raise Invalid("a call without a name")
    if scan.end is None and not arguments:
        name = None  # not announced before its arguments begin: what follows the name may still be wrong
    return PartialCall(name, arguments)


def object_call(s: str, i: int) -> tuple[PartialCall, int | None]:
    """The call object at `s[i] == '{'` and its end (None while it continues)."""
    scan = object_scan(s, i)
    return decode_call(s, scan), scan.end


def array_calls(s: str, i: int) -> tuple[list[PartialCall], int | None]:
    """The calls of a JSON array of call objects at `s[i] == '['`, and its end."""
    calls: list[PartialCall] = []
    k = skip_ws(s, i + 1)
    while True:
        if k >= len(s):
            return calls, None
        if s[k] != "{":
            raise Invalid(f"expected a call object at {k}")
        call, end = object_call(s, k)
        calls.append(call)
        if end is None:
            return calls, None
        k = skip_ws(s, end)
        if k >= len(s):
            return calls, None
        if s[k] == "]":
            return calls, k + 1
        if s[k] != ",":
            raise Invalid(f"expected ',' or ']' at {k}")
        k = skip_ws(s, k + 1)


def cut_short(calls: list[PartialCall], end: int, fallback: Step) -> Step:
    """At the end of the text: the calls whose name is known (truncated), else `fallback`."""
    named = [c for c in calls if c.name is not None]
    return Calls(end, named) if named else fallback


class ToolParser:
    """One tool-call format. Subclasses implement `step`; `extract` and `stream` are shared."""

    name: ClassVar[str]
    # The format's markers are special tokens that detokenizing would drop (skip_special_tokens).
    needs_special_tokens: ClassVar[bool] = False

    def step(self, s: str, pos: int, final: bool) -> Step:
        raise NotImplementedError

    def new_id(self) -> str:
        return openai_call_id()

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        return ToolCallStream(self, max_calls)

    def extract(self, text: str, max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
        """Whole-text parse: (content, calls); the same result as streaming the text."""
        s = self.stream(max_calls)
        s.text = text  # one final pass over the whole text: not the streaming steps
        deltas = s.finish()
        return "".join(d.get("content", "") for d in deltas), s.calls()


class ToolCallStream:
    """Feeds text deltas through a parser's steps and returns OpenAI delta dicts:
    `{"content": ...}` and `{"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments": ""}}]}` when a call's name is known, then `{"tool_calls": [{"index",
    "function": {"arguments": fragment}}]}` as its arguments arrive. `max_calls` drops
    calls past that many (parallel_tool_calls false)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.pos = 0
        self.done: list[PartialCall] = []
        self.sent: list[ToolCall] = []  # what the deltas carried, per index

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._advance(final=True)

    def calls(self) -> list[ToolCall]:
        return [ToolCall(c.name, c.arguments, c.id) for c in self.sent]

    def _advance(self, final: bool) -> list[dict[str, Any]]:
        content: list[str] = []
        pending: list[PartialCall] = []
        while self.pos < len(self.text):
            step = self.parser.step(self.text, self.pos, final)
            if isinstance(step, Pending):
                pending = step.calls
                break
            if isinstance(step, Content):
                content.append(self.text[self.pos:step.end])
            else:
                self.done.extend(step.calls)
            assert step.end > self.pos, "a step decides at least one character"
            self.pos = step.end
        out: list[dict[str, Any]] = [{"content": "".join(content)}] if content else []
        view = self.done + pending
        for index, call in enumerate(view[:self.max_calls]):
            if call.name is None:
                break  # calls are sent in order
            if index == len(self.sent):
                self.sent.append(ToolCall(call.name, "", self.parser.new_id()))
                out.append({"tool_calls": [{"index": index, "id": self.sent[index].id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            sent = self.sent[index]
            if sent.name != call.name or not call.arguments.startswith(sent.arguments):
                continue  # a streamed call that turned invalid: what was sent stays (module docstring)
            if len(call.arguments) > len(sent.arguments):
                fragment = call.arguments[len(sent.arguments):]
                sent.arguments = call.arguments
                out.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
        return out


# -- formats --------------------------------------------------------------------------------


class HermesParser(ToolParser):
    """Hermes / Qwen 2.5 / Qwen 3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    several in a row, with content around them. A missing closing tag is forgiven (the
    model stopped, or went on writing, right after the object)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def step(self, s: str, pos: int, final: bool) -> Step:
        before = content_until(s, pos, final, self.OPEN)
        if before is not None:
            return before
        body = pos + len(self.OPEN)
        not_a_call = Content(body)  # the tag is content; scanning goes on after it
        j = skip_ws(s, body)
        if j >= len(s):
            return not_a_call if final else Pending([])
        if s[j] != "{":
            return not_a_call
        try:
            call, end = object_call(s, j)
        except Invalid:
            return not_a_call
        if end is None:
            return cut_short([call], len(s), not_a_call) if final else Pending([call])
        k = skip_ws(s, end)
        if s.startswith(self.CLOSE, k):
            return Calls(k + len(self.CLOSE), [call])
        if self.CLOSE.startswith(s[k:]):  # the closing tag may follow (or was cut off)
            return Calls(len(s), [call]) if final else Pending([call])
        return Calls(end, [call])  # no closing tag: the call stands, what follows is content


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2 JSON calls: the reply is `{"name": ..., "parameters": {...}}`
    objects separated by `;`, optionally after `<|python_tag|>`. A reply opening with
    `{` is read as calls (as vLLM's llama3_json does); text after the calls is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def step(self, s: str, pos: int, final: bool) -> Step:
        if pos == 0:
            j = skip_ws(s, 0)
            if j >= len(s):
                return Content(len(s)) if final else Pending([])
            if s[j] == "{":
                return self._calls(s, j, final, Content(j + 1))
        before = content_until(s, pos, final, self.TAG)
        if before is not None:
            return before
        body = pos + len(self.TAG)
        j = skip_ws(s, body)
        if j >= len(s):
            return Content(body) if final else Pending([])
        return self._calls(s, j, final, Content(body))

    def _calls(self, s: str, j: int, final: bool, not_a_call: Step) -> Step:
        calls: list[PartialCall] = []
        last_end = None  # the end of the last complete object
        k = j
        while True:
            try:
                if s[k] != "{":
                    raise Invalid("not an object")
                call, end = object_call(s, k)
            except Invalid:
                return Calls(last_end, calls) if calls else not_a_call
            if end is None:
                if final:
                    return cut_short([*calls, call], len(s), not_a_call)
                return Pending([*calls, call])
            calls.append(call)
            last_end = end
            k = skip_ws(s, end)
            if k < len(s) and s[k] == ";":
                k = skip_ws(s, k + 1)
            if k >= len(s):
                return Calls(len(s), calls) if final else Pending(calls)
            if s[k] != "{":
                return Calls(last_end, calls)


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers up to
    v7) and `[TOOL_CALLS]name[ARGS]{...}`, repeated per call (v11 and later). `[TOOL_CALLS]`
    is a special token: requests keep special tokens in the text for this parser."""

    name = "mistral"
    needs_special_tokens = True
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")

    def new_id(self) -> str:
        return mistral_call_id()

    def step(self, s: str, pos: int, final: bool) -> Step:
        before = content_until(s, pos, final, self.TAG)
        if before is not None:
            return before
        body = pos + len(self.TAG)
        not_a_call = Content(body)
        j = skip_ws(s, body)
        if j >= len(s):
            return not_a_call if final else Pending([])
        if s[j] == "[":
            try:
                calls, end = array_calls(s, j)
            except Invalid:
                return not_a_call
            if end is not None:
                return Calls(end, calls) if calls else not_a_call
            return cut_short(calls, len(s), not_a_call) if final else Pending(calls)
        return self._named(s, j, final, not_a_call)

    def _named(self, s: str, j: int, final: bool, not_a_call: Step) -> Step:
        m = self._NAME.match(s, j)
        if m is None:
            return not_a_call
        k = m.end()
        if not s.startswith(self.ARGS, k):
            undecided = not final and self.ARGS.startswith(s[k:])  # the name or the marker may go on
            return Pending([]) if undecided else not_a_call
        call = PartialCall(m.group(0))
        a = skip_ws(s, k + len(self.ARGS))
        if a >= len(s):
            return Calls(len(s), [call]) if final else Pending([])  # announced once its arguments begin
        if s[a] != "{":
            return not_a_call
        try:
            end = value_end(s, a)
        except Invalid:
            return not_a_call
        except Incomplete:
            call.arguments = s[a:]
            return Calls(len(s), [call]) if final else Pending([call])
        call.arguments = s[a:end]
        return Calls(end, [call])


class NamedFunctionParser(ToolParser):
    """tool_choice naming one function: the output (grammar-constrained) is that
    function's arguments object, streamed as it arrives."""

    name = "named_function"

    def __init__(self, function: str):
        self.function = function

    def step(self, s: str, pos: int, final: bool) -> Step:
        j = skip_ws(s, pos)
        if pos > 0:  # after the object: whitespace is dropped, anything else is content
            if j < len(s):
                return Content(len(s))
            return Calls(len(s), []) if final else Pending([])
        call = PartialCall(self.function)
        if j >= len(s):
            return Calls(len(s), [call]) if final else Pending([call])
        if s[j] != "{":
            return Content(len(s))
        try:
            end = value_end(s, j)
        except Invalid:
            return Content(len(s))
        except Incomplete:
            call.arguments = s[j:]
            return Calls(len(s), [call]) if final else Pending([call])
        call.arguments = s[j:end]
        return Calls(end, [call])


class CallArrayParser(ToolParser):
    """tool_choice "required": the output (grammar-constrained) is a JSON array of
    `{"name": ..., "arguments": {...}}` objects (tools.required_schema)."""

    name = "call_array"

    def step(self, s: str, pos: int, final: bool) -> Step:
        j = skip_ws(s, pos)
        if pos > 0:
            if j < len(s):
                return Content(len(s))
            return Calls(len(s), []) if final else Pending([])
        if j >= len(s):
            return Calls(len(s), []) if final else Pending([])
        if s[j] != "[":
            return Content(len(s))
        try:
            calls, end = array_calls(s, j)
        except Invalid:
            return Content(len(s))
        if end is None:
            return cut_short(calls, len(s), Content(len(s))) if final else Pending(calls)
        return Calls(end, calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The registered parser `name` (`--tool-call-parser`)."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)} or auto") from None
