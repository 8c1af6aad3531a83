"""StructuredOutputsParams validation (torch-free), its proto round trip (what the router
checks with convert.params_from_proto), and the OpenAI body mapping (response_format, vLLM's
guided_* and structured_outputs) with its 400s."""

from __future__ import annotations

import json

import pytest

from kvmesh._proto import llm_pb2
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.structured_outputs import StructuredOutputsParams as SO
from kvmesh.errors import InvalidRequestError
from kvmesh.rpc.convert import params_from_proto, params_to_proto
from kvmesh.serve.openai.protocol import APIError, ChatRequest, CompletionRequest, structured_outputs_for_schema

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


@pytest.mark.parametrize("kwargs, field", [
    ({}, "structured_outputs"),
    ({"json": SCHEMA, "regex": "a+"}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1, 2]}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": 5}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"choice": "ab"}, "structured_outputs.choice"),
    ({"regex": "a" * 300_000}, "structured_outputs.regex"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"regex": "a", "prefilled_output_ids": (-1,)}, "structured_outputs.prefilled_output_ids"),
])
def test_invalid_specs_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SO(**kwargs)
    assert err.value.field == field


def test_sampling_params_field_and_its_checks():
    p = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert p.structured_outputs.kind == "choice"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_outputs={"regex": "a", "bogus": 1})
    assert err.value.field == "structured_outputs"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(ignore_eos=True, structured_outputs=SO(regex="a"))
    assert err.value.field == "ignore_eos"
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs="json")


def test_cache_key_keeps_property_order_and_ignores_formatting():
    a = SO(json=SCHEMA)
    assert a.cache_key == SO(json=json.dumps(SCHEMA, indent=4)).cache_key
    reordered = {**SCHEMA, "properties": {"a": SCHEMA["properties"]["a"], "b": SCHEMA["properties"]["b"]}}
    assert SO(json=reordered).cache_key != a.cache_key  # property order is the output's order
    assert SO(json=SCHEMA, disable_any_whitespace=True).cache_key != a.cache_key


@pytest.mark.parametrize("so", [SO(json=SCHEMA, disable_any_whitespace=True), SO(json_object=True),
                                SO(regex=r"\d+"), SO(choice=["a b", "ü"]), SO(grammar='root ::= "x"')])
def test_proto_round_trip(so):
    back = params_from_proto(params_to_proto(SamplingParams(temperature=0, structured_outputs=so)))
    assert back.structured_outputs.cache_key == so.cache_key


def test_proto_without_a_kind_is_refused():
    msg = llm_pb2.SamplingParams(structured_outputs=llm_pb2.StructuredOutputs(disable_any_whitespace=True))
    with pytest.raises(InvalidRequestError) as err:
        params_from_proto(msg)
    assert err.value.field == "structured_outputs"


def _so(body: dict, cls=ChatRequest) -> llm_pb2.StructuredOutputs | None:
    base = {"messages": [{"role": "user", "content": "hi"}]} if cls is ChatRequest else {"prompt": "hi"}
    msg = cls(**base, **body).to_proto(None, None)
    return msg.structured_outputs if msg.HasField("structured_outputs") else None


def test_openai_and_vllm_spellings_map_to_the_proto():
    js = {"type": "json_schema", "json_schema": {"name": "P", "schema": SCHEMA, "strict": True}}
    assert json.loads(_so({"response_format": js}).json_schema) == SCHEMA
    assert _so({"response_format": {"type": "json_object"}}).json_object
    assert _so({"response_format": {"type": "text"}}) is None
    assert _so({}) is None
    assert json.loads(_so({"guided_json": json.dumps(SCHEMA)}, CompletionRequest).json_schema) == SCHEMA
    assert _so({"guided_regex": "a+"}, CompletionRequest).regex == "a+"
    assert list(_so({"guided_choice": ["x", "y"]}).choice.choices) == ["x", "y"]
    assert _so({"guided_grammar": 'root ::= "x"'}).grammar == 'root ::= "x"'
    so = _so({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, CompletionRequest)
    assert json.loads(so.json_schema) == SCHEMA and so.disable_any_whitespace
    assert _so({"structured_outputs": {"json_object": True}}).json_object
    # what the tools helper builds for tool_choice=required
    assert json.loads(structured_outputs_for_schema(SCHEMA).json_schema) == SCHEMA


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": "{bad"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
])
def test_malformed_constraints_are_400_naming_the_param(body, param):
    with pytest.raises(APIError) as err:
        _so(body)
    assert err.value.status == 400 and err.value.param == param


def test_response_format_no_longer_refused_by_check_unsupported():
    ChatRequest(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"}).check_unsupported()
