"""A chat request's tools: validation, `tool_choice`, the conversation a template sees, and
the JSON schema that enforces `required` / named choices.

- `ToolSet.parse(tools, tool_choice, parallel_tool_calls)` checks the OpenAI fields and
  raises `InvalidRequestError` naming the field (`tools[0].function.parameters`, ...);
  each `parameters` is checked against its JSON-Schema meta-schema.
- `template_messages` turns the request's messages into what a chat template reads:
  templates that take `tools` get HF's shape (assistant `tool_calls` with parsed
  arguments, `tool` messages with `tool_call_id`); templates that ignore `tools` (the
  embedded SmolLM2's renders only role and content) get the tools as a Hermes / Qwen 2.5
  style system prompt instead, past calls as `<tool_call>` text and tool results as a
  user turn of `<tool_response>` blocks, which any ChatML-like template renders; a
  message's `name` stays on it for the templates that render it.
- `ToolSet.output_schema()` is the constraint of vLLM's tool_choice handling: for a named
  function its parameters schema (the output *is* the arguments), for `required` an
  array of `{"name": const, "arguments": that tool's schema}` objects (at most one when
  parallel_tool_calls is false). The grammar engine holds the output to it, so the call
  always parses and validates; `ToolSet.parser(...)` reads that output back as calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema

from kvmesh.chat.tool_parsers import CallArrayParser, NamedFunctionParser, ToolParser
from kvmesh.errors import InvalidRequestError

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def parse_tool(raw: Any, at: str) -> Tool:
    if not isinstance(raw, dict):
        raise InvalidRequestError(at, "must be an object {type: function, function: {name, parameters}}")
    if raw.get("type", "function") != "function":
        raise InvalidRequestError(f"{at}.type", f"must be 'function', got {raw.get('type')!r}")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequestError(f"{at}.function", "must be an object {name, description, parameters}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidRequestError(f"{at}.function.name", f"must be 1-64 letters, digits, '_' or '-', got {name!r}")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"{at}.function.description", "must be a string")
    params = fn.get("parameters")
    if params is None:
        params = dict(EMPTY_PARAMETERS)
    where = f"{at}.function.parameters"
    if not isinstance(params, dict):
        raise InvalidRequestError(where, "must be a JSON schema object, e.g. {type: object, properties: {...}}")
    if params.get("type", "object") != "object":
        raise InvalidRequestError(where, f"must describe an object (type: object), got type {params.get('type')!r}")
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise InvalidRequestError(where + path, f"is not a valid JSON schema: {e.message}") from None
    return Tool(name, description, params)


@dataclass(frozen=True)
class ToolSet:
    """A request's validated tools and choice. `choice` is none / auto / required, or
    `named` with `function` set; `parallel` is parallel_tool_calls."""

    tools: tuple[Tool, ...]
    choice: Literal["none", "auto", "required", "named"]
    function: str | None = None
    parallel: bool = True

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolSet:
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequestError("tools", "must be a list of {type: function, function: {...}}")
        parsed = tuple(parse_tool(t, f"tools[{i}]") for i, t in enumerate(tools or []))
        names = [t.name for t in parsed]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise InvalidRequestError(f"tools[{i}].function.name", f"{n!r} is defined twice; names must be unique")
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise InvalidRequestError("parallel_tool_calls", "must be true or false")
        parallel = True if parallel_tool_calls is None else parallel_tool_calls
        choice, function = cls._choice(tool_choice, names)
        return cls(parsed, choice, function, parallel)

    @staticmethod
    def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
        if tool_choice is None:
            return ("auto" if names else "none"), None
        if isinstance(tool_choice, str):
            if tool_choice not in ("none", "auto", "required"):
                raise InvalidRequestError("tool_choice", f"must be none, auto, required or "
                                          f"{{type: function, function: {{name}}}}, got {tool_choice!r}")
            if tool_choice == "required" and not names:
                raise InvalidRequestError("tool_choice", "'required' needs tools; send tools or drop tool_choice")
            return (tool_choice if names else "none"), None
        if not isinstance(tool_choice, dict):
            raise InvalidRequestError("tool_choice", "must be a string or {type: function, function: {name}}")
        if tool_choice.get("type", "function") != "function":
            raise InvalidRequestError("tool_choice.type", f"must be 'function', got {tool_choice.get('type')!r}")
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice.function.name", "must name one of the tools")
        if name not in names:
            raise InvalidRequestError("tool_choice.function.name",
                                      f"{name!r} is not among the tools ({', '.join(names) or 'none given'})")
        return "named", name

    @property
    def active(self) -> bool:
        """Whether the model may call tools (they are rendered and parsed)."""
        return self.choice != "none"

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow (required / named), else None."""
        if self.choice == "named":
            return self.tool(self.function).parameters
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]},
                                                    "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def parser(self, auto: ToolParser, constrained: bool) -> ToolParser:
        """The parser of this request's output: the format parser for auto (or when the
        constraint could not be applied), else the one that reads the constrained JSON."""
        if constrained and self.choice == "named":
            return NamedFunctionParser(self.function)
        if constrained and self.choice == "required":
            return CallArrayParser()
        return auto

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1


# -- the conversation a template sees -------------------------------------------------------


def _arguments_object(arguments: Any) -> Any:
    """HF templates render `arguments | tojson`: give them the object, not its JSON text."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _native(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments_object(c["function"].get("arguments"))}}
                             for c in message["tool_calls"]]
    out.setdefault("content", "")
    return out


def tools_system_prompt(tools: ToolSet) -> str:
    """The Hermes / Qwen 2.5 style tool prompt for templates that ignore `tools`."""
    lines = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools.tools)
    must = ""
    if tools.choice == "required":
        must = "\nYou must call at least one function."
    elif tools.choice == "named":
        must = f"\nYou must call the function {tools.function}."
    return ("# Tools\n\nYou may call one or more functions to answer the user.\n\n"
            f"The functions, one JSON signature per line, inside <tools></tools> tags:\n<tools>\n{lines}\n</tools>\n\n"
            "To call a function, reply with a JSON object of its name and arguments inside <tool_call></tool_call> "
            "tags, one block per call:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-object>}\n"
            f"</tool_call>{must}")


def call_text(call: dict[str, Any]) -> str:
    """A past call as the model would have written it under `tools_system_prompt`."""
    fn = call["function"]
    args = fn.get("arguments")
    obj = _arguments_object(args) if args not in (None, "") else {}
    body = json.dumps({"name": fn["name"], "arguments": obj}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _fallback(messages: list[dict[str, Any]], tools: ToolSet | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content, **({"name": m["name"]} if m.get("name") else {})})
    for m in out:
        m.pop("_tool_results", None)
    if tools is not None and tools.active:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_messages(messages: list[dict[str, Any]], tools: ToolSet | None,
                      template_takes_tools: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra apply_chat_template kwargs) for a template. `messages` are dicts
    of role, content (text or None), tool_calls, tool_call_id, name."""
    if template_takes_tools:
        extra = {"tools": [t.to_openai() for t in tools.tools]} if tools is not None and tools.active else {}
        return [_native(m) for m in messages], extra
    return _fallback(messages, tools), {}
