"""OpenAI's legacy function calling (`functions`, `function_call`), served as tools.

A chat body with `functions` is read as one with `tools` (each function a `{type:
function, function}` tool), `function_call` as `tool_choice` (`none` / `auto` /
`{name}` -> the named choice) and at most one call per reply (the legacy API made one).
Past turns in the legacy shape are read too: an assistant message's `function_call`
becomes its one tool call, a `function` message (`name`, `content`) the tool result that
answers the latest call of that name. The reply is rendered back in the legacy shape:
`message.function_call` instead of `tool_calls`, streamed `function_call` deltas, and
finish_reason `function_call` instead of `tool_calls`.
"""

from __future__ import annotations

from typing import Any

from kvmesh.serve.openai.protocol import APIError, ChatRequest, MessageToolCall


def uses_functions(body: ChatRequest) -> bool:
    return body.functions is not None or body.function_call is not None


def read_legacy_functions(body: ChatRequest) -> None:
    """Rewrite a legacy body in place as the tools body it means (a 400 naming the field
    when it mixes both styles or holds a malformed value)."""
    if not uses_functions(body):
        _legacy_messages(body)
        return
    if body.tools is not None or body.tool_choice is not None:
        raise APIError(400, "give tools / tool_choice or the legacy functions / function_call, not both; "
                            "tools is the current form", param="functions")
    if body.functions is not None:
        if not isinstance(body.functions, list):
            raise APIError(400, "functions must be a list of {name, description, parameters}", param="functions")
        body.tools = [{"type": "function", "function": f} for f in body.functions]
    fc = body.function_call
    if isinstance(fc, dict):
        if not isinstance(fc.get("name"), str):
            raise APIError(400, "function_call must be none, auto or {name: <one of functions>}",
                           param="function_call")
        body.tool_choice = {"type": "function", "function": {"name": fc["name"]}}
    elif fc is not None:
        if fc not in ("none", "auto"):
            raise APIError(400, f"function_call must be none, auto or {{name}}, got {fc!r}", param="function_call")
        body.tool_choice = fc
    if body.parallel_tool_calls is None:
        body.parallel_tool_calls = False
    _legacy_messages(body)


def _legacy_messages(body: ChatRequest) -> None:
    """Assistant `function_call`s as tool calls, `function` messages as tool results."""
    calls: dict[str, str] = {}  # function name -> id of its latest call
    for i, m in enumerate(body.messages):
        if m.function_call is not None:
            if m.role != "assistant" or m.tool_calls:
                raise APIError(400, f"messages[{i}].function_call: only an assistant message without tool_calls "
                                    "may carry a function_call", param=f"messages[{i}].function_call")
            call_id = f"call_{i}"
            m.tool_calls = [MessageToolCall(id=call_id, function=m.function_call)]
            m.function_call = None
            calls[m.tool_calls[0].function.name] = call_id
        elif m.tool_calls:
            calls.update({c.function.name: c.id for c in m.tool_calls if c.id})
        if m.role == "function":
            if not m.name:
                raise APIError(400, f"messages[{i}].name: a function message names the function whose result it "
                                    "holds", param=f"messages[{i}].name")
            m.role = "tool"
            m.tool_call_id = m.tool_call_id or calls.get(m.name)


def legacy_message(message: dict[str, Any]) -> dict[str, Any]:
    """A reply message in the legacy shape: its (one) call as `function_call`."""
    calls = message.pop("tool_calls", None)
    if calls:
        message["function_call"] = dict(calls[0]["function"])
    return message


def legacy_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A streamed delta in the legacy shape: call fragments as `function_call` fragments."""
    calls = delta.pop("tool_calls", None)
    if calls:
        fn = calls[0].get("function") or {}
        delta["function_call"] = {k: v for k, v in fn.items() if v is not None}
    return delta


def legacy_finish_reason(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason
