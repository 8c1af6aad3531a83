"""Structured outputs from the body to the proto: OpenAI's `response_format`
(`json_object`, `json_schema`) and vLLM's `structured_outputs` / `guided_*` spellings, each
checked here (a 400 naming the field) and judged further by the worker's grammar engine."""

from __future__ import annotations

import json
from typing import Any

from kvmesh._proto import llm_pb2
from kvmesh.serve.openai.errors import APIError


def structured_outputs_for_schema(schema: dict[str, Any] | bool | str,
                                  disable_any_whitespace: bool = False) -> llm_pb2.StructuredOutputs:
    """The proto constraint "the output is JSON valid against `schema`" (e.g. tool_choice=required)."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return llm_pb2.StructuredOutputs(json_schema=text, disable_any_whitespace=disable_any_whitespace)


def response_format_proto(rf: dict[str, Any]) -> llm_pb2.StructuredOutputs:
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


def vllm_structured_proto(so: dict[str, Any], param: str = "structured_outputs") -> llm_pb2.StructuredOutputs:
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
