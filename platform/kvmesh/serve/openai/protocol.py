"""The OpenAI wire shapes kvmesh speaks: request bodies (pydantic) and the error shape.

Request models ignore unknown fields (as vLLM does) and reject known but unsupported
ones with a non-default value (n > 1, echo, tools, ...) with a 400 that says what to
change. `APIError` is the OpenAI error `{"error": {"message", "type", "param", "code"}}`
with its HTTP status; `APIError.from_grpc` maps the router's gRPC status onto it
(INVALID_ARGUMENT -> 400, UNAVAILABLE -> 503, ...), naming the offending field when
kvmesh's message starts with it; `code` is always a string.

Bodies are checked so that nothing invalid reaches the gRPC layer (where it would be a
500): integers within the protobuf types' ranges, finite floats (`NaN` / `Infinity`
are refused, not read as "default"), no lone UTF-16 surrogates in any string, and
text-only chat content parts whose `text` is a string.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmesh._proto import llm_pb2
from kvmesh.errors import KVMeshError
from kvmesh.rpc.retry_info import retry_after_of

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
    def from_grpc(cls, exc: grpc.aio.AioRpcError) -> APIError:
        status, type_ = HTTP_OF_GRPC.get(exc.code(), (500, "internal_error"))
        message = exc.details() or exc.code().name
        # kvmesh's INVALID_ARGUMENT messages start with the field: "max_tokens: must be ..."
        m = re.match(r"([A-Za-z_][\w.]*): ", message) if status == 400 else None
        retry_after = retry_after_of(exc) if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        if retry_after is not None:  # the router's per-API-key rate limit (router/ratelimit.py)
            err = cls(429, message, "rate_limit_exceeded", code="rate_limit_exceeded")
            err.headers["Retry-After"] = str(retry_after)
            return err
        return cls(status, message, type_, param=m.group(1) if m else None, code=exc.code().name.lower())


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
    n: int = 1
    best_of: int | None = None
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
            raise ValueError(f"{at}: holds a lone UTF-16 surrogate (e.g. \\ud800); send valid Unicode text")
        return data

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n must be 1: kvmesh returns one choice per request; send n requests", param="n")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported; leave it unset", param="best_of")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported; leave it unset", param="logit_bias")

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
                   "logprobs": logprobs}
        for name, value in scalars.items():
            if value is not None:
                setattr(msg, name, value)
        if self.stop is not None:
            msg.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        if self.stop_token_ids:
            msg.stop_token_ids.extend(self.stop_token_ids)
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

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
    tools: list[dict[str, Any]] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise APIError(400, "tools / function calling is not supported by kvmesh yet; remove tools",
                           param="tools")


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
