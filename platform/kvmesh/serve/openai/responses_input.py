"""`POST /v1/responses` bodies, read into the chat request the chat path serves.

The Responses API is rendered over chat (chat.py): `instructions` becomes a system message,
the `input` items chat messages (a `function_call` item an assistant message's tool call,
consecutive calls one assistant turn; a `function_call_output` item a tool message), the
flat `tools` chat's `{type: function, function: {...}}`, `tool_choice {type: function,
name}` the named choice, `text.format` chat's `response_format` and `max_output_tokens`
`max_tokens`. Validation stays in one place (the chat path); its errors name chat's fields,
which `responses_error` renames to the Responses ones (`messages` -> `input`,
`tools[0].function.parameters` -> `tools[0].parameters`, ...).

kvmesh keeps no conversation state: `store` is accepted but nothing is stored, and
what needs a stored response (`previous_response_id`, `conversation`, `background`,
`item_reference` items) is a 400 naming the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvmesh.serve.openai.fields import RESPONSES_REFUSED, refusal, warn_unknown
from kvmesh.serve.openai.protocol import APIError, ChatMessage, ChatRequest, FunctionCall, Int64, MessageToolCall
from kvmesh.serve.openai.protocol import _lone_surrogate_at as lone_surrogate_at

LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(BaseModel):
    """A Responses API body; undeclared fields are refused when they change the output,
    else ignored with a warning, as on the other routes (fields.py)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[Any] = Field(..., description="A user message's text, or a list of items: messages "
                                   "{role, content}, function_call and function_call_output items.")
    instructions: str | None = Field(None, description="A system message ahead of the input.")
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    tools: list[Any] | None = Field(None, description="Functions the model may call: [{type: function, name, "
                                    "description, parameters, strict}].")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto (the default with tools), required, or {type: function, name}.")
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description="{format: {type: text | json_object | json_schema, "
                                        "name, schema, strict}}.")
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    store: bool | None = Field(None, description="Accepted; kvmesh stores no responses.")
    reasoning: dict[str, Any] | None = Field(None, description="Accepted and ignored (the model's own format "
                                             "decides whether it reasons).")
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        at = lone_surrogate_at(data)
        if at is not None:
            raise APIError(400, f"{at}: holds a lone UTF-16 surrogate (e.g. \\ud800); send valid Unicode text",
                           param=at)
        return data

    def check_unsupported(self) -> None:
        """Refuse what needs server-side conversation state, which kvmesh does not keep."""
        stateless = "kvmesh keeps no conversation state; send the whole conversation as input"
        if self.previous_response_id is not None:
            raise APIError(400, f"previous_response_id is not supported: {stateless}", param="previous_response_id")
        if self.conversation is not None:
            raise APIError(400, f"conversation is not supported: {stateless}", param="conversation")
        if self.background:
            raise APIError(400, "background is not supported: kvmesh stores no responses to poll; leave it unset "
                                "(stream instead)", param="background")
        found = refusal(self.model_extra, RESPONSES_REFUSED)
        if found is not None:
            raise APIError(400, found[1], param=found[0])
        warn_unknown(self.model_extra, RESPONSES_REFUSED, "/v1/responses")

    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())

    def text_format(self) -> dict[str, Any]:
        """`text.format`, default {type: text}."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return {"type": "text"}
        if not isinstance(fmt, dict):
            raise APIError(400, "text.format: must be an object {type: text | json_object | json_schema}",
                           param="text.format")
        return fmt


def to_chat(body: ResponsesRequest) -> ChatRequest:
    """The chat request that serves `body` (a 400 naming the Responses field when it is wrong)."""
    messages = ([ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else [])
    messages += input_messages(body.input)
    try:
        return ChatRequest(model=body.model, messages=messages, max_tokens=body.max_output_tokens,
                           temperature=body.temperature, top_p=body.top_p, seed=body.seed, user=body.user,
                           stream=body.stream, tools=chat_tools(body.tools), tool_choice=chat_tool_choice(body),
                           parallel_tool_calls=body.parallel_tool_calls,
                           response_format=response_format(body.text_format()),
                           logprobs=body.wants_logprobs(), top_logprobs=body.top_logprobs)
    except ValidationError as e:  # what the checks above let through that chat's model refuses
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        param = responses_param(loc) or "input"
        raise APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param) from None


def input_messages(items: str | list[Any]) -> list[ChatMessage]:
    """The `input` items as chat messages."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise APIError(400, "input: must not be empty; send a string or a list of items", param="input")
    out: list[ChatMessage] = []
    calls: set[str] = set()  # call_ids of the function_call items so far
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{at}: must be an object: a message {{role, content}}, a function_call or a "
                                "function_call_output item", param=at)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, at))
        elif kind == "function_call":
            call = _function_call(item, at)
            calls.add(call.id)
            if out and out[-1].role == "assistant":  # a reply's text and its calls are one assistant turn
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in calls:
                raise APIError(400, f"{at}.call_id: no function_call item with call_id {call_id!r} comes before it",
                               param=f"{at}.call_id")
            out.append(ChatMessage(role="tool", tool_call_id=call_id,
                                   content=_text(item.get("output"), f"{at}.output")))
        elif kind == "reasoning":
            continue  # past thoughts are not sent back to the model (chat templates drop them too)
        elif kind == "item_reference":
            raise APIError(400, f"{at}.type: item_reference needs a stored item and kvmesh stores none; send the "
                                "item itself", param=f"{at}.type")
        else:
            raise APIError(400, f"{at}.type: {kind!r} is not supported; send message, function_call or "
                                "function_call_output items", param=f"{at}.type")
    if not out:
        raise APIError(400, "input: holds no message; send at least one", param="input")
    return out


def _message(item: dict[str, Any], at: str) -> ChatMessage:
    role = item.get("role")
    if role not in ROLES:
        raise APIError(400, f"{at}.role: must be one of {', '.join(ROLES)}, got {role!r}", param=f"{at}.role")
    return ChatMessage(role=role, content=_text(item.get("content"), f"{at}.content"))


def _text(content: Any, at: str) -> str:
    """A message's (or a function output's) text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{at}: must be a string or a list of input_text / output_text parts", param=at)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(400, f"{at}[{j}].type: only text parts (input_text, output_text) are supported, got "
                                f"{kind!r}", param=f"{at}[{j}].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise APIError(400, f"{at}[{j}].text: must be a string", param=f"{at}[{j}].text")
        parts.append(text)
    return "".join(parts)


def _function_call(item: dict[str, Any], at: str) -> MessageToolCall:
    for key in ("call_id", "name"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise APIError(400, f"{at}.{key}: must be a non-empty string", param=f"{at}.{key}")
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise APIError(400, f"{at}.arguments: must be the call's arguments as JSON text", param=f"{at}.arguments")
    return MessageToolCall(id=item["call_id"], function=FunctionCall(name=item["name"], arguments=arguments))


def chat_tools(tools: list[Any] | None) -> list[Any] | None:
    """Responses' flat function tools in chat's nested shape (validated by the chat path)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(400, f"{at}: must be an object {{type: function, name, parameters}}", param=at)
        if tool.get("type") != "function":
            raise APIError(400, f"{at}.type: only function tools are served, got {tool.get('type')!r} (kvmesh "
                                "runs no hosted tools)", param=f"{at}.type")
        if "name" not in tool and isinstance(tool.get("function"), dict):
            raise APIError(400, f"{at}.name: missing; Responses tools are flat {{type: function, name, parameters}} "
                                "(chat completions nests them under `function`)", param=f"{at}.name")
        out.append({"type": "function",
                    "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    return out


def chat_tool_choice(body: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = body.tool_choice
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise APIError(400, f"tool_choice.type: must be 'function' (or tool_choice none, auto or required), got "
                            f"{choice.get('type')!r}", param="tool_choice.type")
    return {"type": "function", "function": {"name": choice.get("name")}}


def response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text.format.type: must be text, json_object or json_schema, got {kind!r}",
                   param="text.format.type")


# Chat's field names (as the chat path's errors give them) -> the Responses fields they came from.
_PARAMS = [(re.compile(r"^messages\b.*"), "input"), (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
           (re.compile(r"^response_format\b.*"), "text.format"), (re.compile(r"^(logprobs|top_logprobs)$"),
                                                                  "top_logprobs"),
           (re.compile(r"^(tools\[\d+\])\.function\b"), r"\1"), (re.compile(r"^tool_choice\.function\."),
                                                                 "tool_choice.")]


def responses_param(param: str | None) -> str | None:
    if not param:
        return param
    for pattern, repl in _PARAMS:
        if pattern.search(param):
            return pattern.sub(repl, param, count=1)
    return param


def responses_error(err: APIError) -> APIError:
    """`err` with chat's field names (param and message) renamed to the Responses ones."""
    param = responses_param(err.param)
    if param == err.param:
        return err
    message = err.message.replace(err.param, param, 1) if err.param else err.message
    out = APIError(err.status, message, err.type, param=param, code=err.code)
    out.headers = err.headers
    return out
