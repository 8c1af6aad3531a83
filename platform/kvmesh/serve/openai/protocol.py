"""The OpenAI wire shapes kvmesh speaks: request bodies (pydantic) and the error shape.

Request models keep the fields they do not declare as extras (`model_extra`), which
`check_unsupported` reads (fields.py): a known field that would change the output is a
400 that names it and says what to use; an unknown one is ignored, as vLLM does, with a
warning naming it. The OpenAI error shape is errors.py's `APIError` (re-exported here),
the structured-output fields' proto structured.py's.

Bodies are checked so that nothing invalid reaches the gRPC layer (where it would be a
500): integers within the protobuf types' ranges, finite floats (`NaN` / `Infinity`
are refused, not read as "default"), no lone UTF-16 surrogates in any string, and
text-only chat content parts whose `text` is a string.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmesh._proto import llm_pb2
from kvmesh.chat.tools import ToolSet
from kvmesh.errors import InvalidRequestError
from kvmesh.serve.openai.errors import APIError
from kvmesh.serve.openai.fields import (
    CHAT_REFUSED,
    MESSAGE_REPLY_FIELDS,
    SAMPLING_REFUSED,
    Refused,
    refusal,
    warn_unknown,
)
from kvmesh.serve.openai.structured import response_format_proto, structured_outputs_for_schema, vllm_structured_proto

__all__ = ["APIError", "ChatMessage", "ChatRequest", "CompletionRequest", "SamplingFields",
           "structured_outputs_for_schema"]

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
    """Fields common to completions and chat; undeclared ones are kept as extras for
    `check_unsupported` (refused when they change the output, else ignored and logged)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: Int32 | None = Field(None, description="Default 16 (completions) / until EOS (chat).")
    min_tokens: Annotated[int, Field(ge=0, le=2**31 - 1)] = Field(
        0, description="vLLM extension: generate at least this many tokens (EOS and stop_token_ids are not "
        "sampled, stop strings not looked for, until then).")
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

    def check_unsupported(self, route: str = "/v1/completions", refused: dict[str, Refused] = SAMPLING_REFUSED) -> None:
        """A 400 for what would change the output and is not served; a warning for unknown fields."""
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of must be unset or equal to n ({self.n}): kvmesh returns every choice it "
                                "samples and does not rank extra ones", param="best_of")
        found = refusal(self.model_extra, refused)
        if found is not None:
            raise APIError(400, found[1], param=found[0])
        warn_unknown(self.model_extra, refused, route)

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
        scalars = {"max_tokens": max_tokens, "min_tokens": self.min_tokens or None, "temperature": self.temperature, "top_p": self.top_p,
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
            return response_format_proto(rf)
        if name == "structured_outputs":
            return vllm_structured_proto(self.structured_outputs)
        return vllm_structured_proto({name.removeprefix("guided_"): getattr(self, name)}, param=name)


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = Field(True, description="vLLM extension: false encodes a text prompt without the "
                                     "tokenizer's special tokens (no BOS).")

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
    """One chat message; `name` and `tool_call_id` reach the chat template. Legacy
    `function` messages and an assistant's `function_call` are read as tool messages and
    tool calls (legacy.py)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="assistant: the calls it made.")
    tool_call_id: str | None = Field(None, description="tool: the call this message answers.")
    function_call: FunctionCall | None = Field(None, description="Legacy: an assistant's one call.")

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


# apply_chat_template's own arguments: a template variable may not take their names.
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "chat_template", "tokenize", "padding",
                                 "truncation", "max_length", "return_tensors", "return_dict",
                                 "return_assistant_tokens_mask", "tokenizer_kwargs"})


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
    functions: list[Any] | None = Field(None, description="Legacy form of tools (served as tools; the reply comes "
                                        "in the legacy shape, message.function_call).")
    function_call: str | dict[str, Any] | None = Field(None, description="Legacy form of tool_choice: none, auto "
                                                       "or {name}.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: variables for the chat template (e.g. {enable_thinking: false}).")
    add_generation_prompt: bool = Field(True, description="vLLM extension: end the prompt with the opening of the "
                                        "assistant's turn; false renders the messages as they are.")
    continue_final_message: bool = Field(
        False, description="vLLM extension: continue the last message (an assistant prefix) instead of opening a "
        "new turn; needs add_generation_prompt false.")
    documents: list[dict[str, Any]] | None = Field(None, description="vLLM extension: documents for templates "
                                                   "that read them (RAG templates).")
    reasoning_effort: str | None = Field(None, description="Passed to the chat template as the variable "
                                         "reasoning_effort (templates of reasoning models read it).")

    def template_options(self) -> dict[str, Any]:
        """apply_chat_template's keyword arguments from the body: add_generation_prompt,
        continue_final_message, documents and the template's variables (a 400 naming the
        field when they clash)."""
        kwargs = dict(self.chat_template_kwargs or {})
        for key in kwargs:
            if key in _TEMPLATE_ARGUMENTS:
                use = f"use the top-level {key} field" if key in ("tools", "messages") else "the server sets it"
                raise APIError(400, f"chat_template_kwargs.{key} is not a template variable: {use}",
                               param=f"chat_template_kwargs.{key}")
        opts: dict[str, Any] = {"add_generation_prompt": self.add_generation_prompt,
                                "continue_final_message": self.continue_final_message}
        if self.documents is not None:
            opts["documents"] = self.documents
        if self.reasoning_effort is not None:
            opts["reasoning_effort"] = self.reasoning_effort
        opts.update(kwargs)  # as vLLM: chat_template_kwargs may set the top-level ones too
        for key in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(opts[key], bool):
                raise APIError(400, f"chat_template_kwargs.{key} must be true or false",
                               param=f"chat_template_kwargs.{key}")
        if opts["continue_final_message"] and opts["add_generation_prompt"]:
            raise APIError(400, "continue_final_message continues the last message, so it needs "
                                "add_generation_prompt false", param="continue_final_message")
        return opts

    def tool_set(self) -> ToolSet:
        """The validated tools and tool_choice (a 400 naming the field when wrong)."""
        try:
            return ToolSet.parse(self.tools, self.tool_choice, self.parallel_tool_calls)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.field) from None

    def check_unsupported(self, route: str = "/v1/chat/completions",
                          refused: dict[str, Refused] = CHAT_REFUSED) -> None:
        super().check_unsupported(route, refused)
        for m in self.messages:
            extras = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
            warn_unknown(extras, MESSAGE_REPLY_FIELDS, f"{route} messages[]")
