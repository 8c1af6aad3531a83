"""The OpenAI wire shapes kvmesh speaks: request bodies (pydantic) and the error shape.

Request models ignore unknown fields (as vLLM does) and reject known but unsupported
ones with a non-default value (n > 1, best_of, logit_bias, ...) with a 400 that says what to
change. `APIError` is the OpenAI error `{"error": {"message", "type", "param", "code"}}`
with its HTTP status; `APIError.of` maps the router's typed errors onto it
(InvalidRequestError -> 400 with `param` the field it names, UnavailableError -> 503,
RateLimitedError -> 429 with Retry-After, ...); `code` is always a string.

Bodies are checked so that nothing invalid reaches the gRPC layer (where it would be a
500): integers within the protobuf types' ranges, finite floats (`NaN` / `Infinity`
are refused, not read as "default"), no lone UTF-16 surrogates in any string, and
text-only chat content parts whose `text` is a string.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmesh._proto import llm_pb2
from kvmesh.chat.tools import ToolSet
from kvmesh.errors import InvalidRequestError, KVMeshError, RateLimitedError
from kvmesh.rpc.status import error_of_rpc, status_of

HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class APIError(KVMeshError):
    """An OpenAI-style HTTP error: `status` is the HTTP status, `body()` the JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers: dict[str, str] = {}  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code or _CODE_OF_STATUS.get(self.status, self.type)}}

    @classmethod
    def of(cls, exc: BaseException) -> APIError:
        """The OpenAI error of a typed kvmesh error from the router (the field it names
        becomes `param`), of a failed gRPC call (decoded to its typed error first), or of
        anything else (a 500)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, grpc.aio.AioRpcError):
            exc = error_of_rpc(exc)
        if isinstance(exc, RateLimitedError):  # the router's per-API-key rate limit (router/ratelimit.py)
            err = cls(429, str(exc), "rate_limit_exceeded", code="rate_limit_exceeded")
            err.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
            return err
        code, message = status_of(exc)
        status, type_ = HTTP_OF_GRPC.get(code, (500, "internal_error"))
        return cls(status, message, type_, param=getattr(exc, "field", None), code=code.name.lower())


_CODE_OF_STATUS = {400: "invalid_request", 401: "invalid_api_key", 403: "permission_denied", 404: "not_found",
                   405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type",
                   422: "invalid_request", 429: "rate_limit_exceeded", 499: "cancelled", 500: "internal_error",
                   503: "unavailable", 504: "timeout"}

# The protobuf types these fields travel as (llm.proto): out of range is a 400 here.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


def _lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for k, v in value.items():
            found = _lone_surrogate_at(k, path) or _lone_surrogate_at(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate_at(v, f"{path}[{i}]")
            if found:
                return found
    return None


class SamplingFields(BaseModel):
    """Fields common to completions and chat; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: Int32 | None = Field(None, description="Default 16 (completions) / until EOS (chat).")
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: Int32 = Field(1, description="Choices per prompt; the prompt is computed once and its KV shared.")
    best_of: Int32 | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM extension: top-k logprobs of every "
                                        "prompt token given its prefix (the first has none).")
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    compression: dict[str, Any] | None = Field(
        None, description="kvmesh extension: prompt compression {method, target_ratio} (see kvmesh.compress)."
    )
    cache_salt: str | None = Field(
        None, max_length=256, description="Prefix-cache isolation (as vLLM): cached KV is reused only between "
        "requests with the same salt (within the caller's API key); `cached_tokens` counts only those hits.")
    # Structured outputs (see structured_outputs_proto): OpenAI's response_format, vLLM's guided_*
    # and its newer structured_outputs {json, regex, choice, grammar, json_object}; at most one.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        at = _lone_surrogate_at(data)
        if at is not None:
            # An APIError, not a ValueError: pydantic lets it through, so the field travels as data
            # (a ValueError from a whole-body validator would lose its location).
            raise APIError(400, f"{at}: holds a lone UTF-16 surrogate (e.g. \\ud800); send valid Unicode text",
                           param=at)
        return data

    def check_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of must be unset or equal to n ({self.n}): kvmesh returns every choice it "
                                "samples and does not rank extra ones", param="best_of")

    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` with its keys (token ids as JSON strings) as integers."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias: key {key!r} is not a token id; map token ids (as strings) to "
                                    "biases in [-100, 100]", param="logit_bias") from None
            if not 0 <= token <= 2**31 - 1:
                raise APIError(400, f"logit_bias: token id {token} is out of range", param="logit_bias")
            out[token] = bias
        return out

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def to_proto(self, logprobs: int | None, default_max_tokens: int | None) -> llm_pb2.SamplingParams:
        msg = llm_pb2.SamplingParams(ignore_eos=self.ignore_eos,
                                     include_stop_str_in_output=self.include_stop_str_in_output)
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        scalars = {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                   "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed,
                   "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                   "repetition_penalty": self.repetition_penalty, "skip_special_tokens": self.skip_special_tokens,
                   "logprobs": logprobs, "n": self.n if self.n != 1 else None, "prompt_logprobs": self.prompt_logprobs}
        for name, value in scalars.items():
            if value is not None:
                setattr(msg, name, value)
        if self.stop is not None:
            msg.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        if self.stop_token_ids:
            msg.stop_token_ids.extend(self.stop_token_ids)
        if self.logit_bias:
            msg.logit_bias.update(self.logit_bias_ids())
        so = self.structured_outputs_proto()
        if so is not None:
            msg.structured_outputs.CopyFrom(so)
        return msg

    def structured_outputs_proto(self) -> llm_pb2.StructuredOutputs | None:
        """The one output constraint the body asks for, or None; a 400 naming the field when
        more than one is given or one is malformed (the worker's grammar engine judges the rest)."""
        given = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                   "structured_outputs") if getattr(self, name) is not None]
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise APIError(400, f"give at most one output constraint; got {', '.join(given)}", param=given[1])
        if not given:
            return None
        name = given[0]
        if name == "response_format":
            return _response_format_proto(rf)
        if name == "structured_outputs":
            return _vllm_structured_proto(self.structured_outputs)
        return _vllm_structured_proto({name.removeprefix("guided_"): getattr(self, name)}, param=name)


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # a batch of prompts: one choice each


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(..., min_length=1)
    arguments: str = Field("", description="The call's arguments as JSON text (as the API returned them).")


class MessageToolCall(BaseModel):
    """A past call of an assistant message (sent back with the tool's result)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="assistant: the calls it made.")
    tool_call_id: str | None = Field(None, description="tool: the call this message answers.")

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (kvmesh.chat.tools.template_messages)."""
        out: dict[str, Any] = {"role": self.role if self.role != "developer" else "system", "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
            if self.content is None:
                out["content"] = None
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"content part of type {part.get('type')!r} is not supported; send text parts",
                               param="messages")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise APIError(400, f"a text content part's text must be a string, got {type(text).__name__}",
                               param="messages")
            parts.append(text)
        return "".join(parts)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = Field(None, description="Functions the model may call: [{type: function, function: "
                                    "{name, description, parameters}}] (kvmesh.chat.tools).")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto (the default with tools), required, or {type: function, function: {name}}.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per reply.")
    response_format: dict[str, Any] | None = None

    def tool_set(self) -> ToolSet:
        """The validated tools and tool_choice (a 400 naming the field when wrong)."""
        try:
            return ToolSet.parse(self.tools, self.tool_choice, self.parallel_tool_calls)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.field) from None

    def check_unsupported(self) -> None:
        super().check_unsupported()


def structured_outputs_for_schema(schema: dict[str, Any] | bool | str,
                                  disable_any_whitespace: bool = False) -> llm_pb2.StructuredOutputs:
    """The proto constraint "the output is JSON valid against `schema`" (e.g. tool_choice=required)."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return llm_pb2.StructuredOutputs(json_schema=text, disable_any_whitespace=disable_any_whitespace)


def _response_format_proto(rf: dict[str, Any]) -> llm_pb2.StructuredOutputs:
    """OpenAI's response_format {type: json_object} / {type: json_schema, json_schema: {name, schema, strict}}."""
    kind = rf.get("type")
    if kind == "json_object":
        return llm_pb2.StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                       param="response_format")
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, dict) else None
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, "response_format.json_schema.schema must be a JSON schema object "
                       "({type: json_schema, json_schema: {name, schema, strict}})", param="response_format")
    return structured_outputs_for_schema(schema)


_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _vllm_structured_proto(so: dict[str, Any], param: str = "structured_outputs") -> llm_pb2.StructuredOutputs:
    """vLLM's structured_outputs {json | regex | choice | grammar | json_object, disable_any_whitespace}."""
    kinds = [k for k in _VLLM_KINDS if so.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise APIError(400, f"{param} needs exactly one of {', '.join(_VLLM_KINDS)}; got "
                       f"{', '.join(kinds) or 'none'}", param=param)
    kind, value = kinds[0], so[kinds[0]]
    ws = so.get("disable_any_whitespace", False)
    if not isinstance(ws, bool):
        raise APIError(400, f"{param}.disable_any_whitespace must be true or false", param=param)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise APIError(400, f"{param}: the JSON schema is not valid JSON: {exc}", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise APIError(400, f"{param}: a JSON schema must be an object", param=param)
        return structured_outputs_for_schema(value, ws)
    if kind == "json_object":
        return llm_pb2.StructuredOutputs(json_object=True, disable_any_whitespace=ws)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"{param}: choice must be a non-empty list of non-empty strings", param=param)
        return llm_pb2.StructuredOutputs(choice=llm_pb2.StructuredChoice(choices=value), disable_any_whitespace=ws)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}: {kind} must be a non-empty string", param=param)
    return llm_pb2.StructuredOutputs(**{kind: value}, disable_any_whitespace=ws)
