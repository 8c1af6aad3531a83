"""Tools validation, tool_choice, the constraint schema, and how templates see tools:
the embedded SmolLM2 (its template ignores tools: the Hermes-style fallback prompt) and a
Qwen-like template that reads them."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from kvmesh.chat import ToolSet, takes_tools, template_messages, template_source
from kvmesh.chat.template import auto_tool_parser, resolve_tool_parser
from kvmesh.chat.tool_parsers import CallArrayParser, HermesParser, NamedFunctionParser
from kvmesh.errors import InvalidRequestError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("mutate, field, words", [
    (lambda t: t.update(type="retrieval"), "tools[0].type", "must be 'function'"),
    (lambda t: t.pop("function"), "tools[0].function", "must be an object"),
    (lambda t: t["function"].update(name="get weather"), "tools[0].function.name", "letters, digits"),
    (lambda t: t["function"].update(name="x" * 65), "tools[0].function.name", "1-64"),
    (lambda t: t["function"].update(parameters="city"), "tools[0].function.parameters", "JSON schema object"),
    (lambda t: t["function"].update(parameters={"type": "string"}), "tools[0].function.parameters",
     "must describe an object"),
    (lambda t: t["function"]["parameters"].update(required="city"), "tools[0].function.parameters.required",
     "not a valid JSON schema"),
    (lambda t: t["function"]["parameters"]["properties"]["city"].update(type="text"),
     "tools[0].function.parameters.properties.city.type", "not a valid JSON schema"),
    (lambda t: t["function"].update(description=3), "tools[0].function.description", "string"),
])
def test_bad_tools_name_the_field(mutate, field, words):
    tool = copy.deepcopy(WEATHER)
    mutate(tool)
    with pytest.raises(InvalidRequestError) as e:
        ToolSet.parse([tool])
    assert e.value.field == field and words in str(e.value)


def test_tools_list_and_duplicates():
    with pytest.raises(InvalidRequestError, match="tools: must be a list"):
        ToolSet.parse({"a": 1})
    with pytest.raises(InvalidRequestError) as e:
        ToolSet.parse([WEATHER, copy.deepcopy(WEATHER)])
    assert e.value.field == "tools[1].function.name"
    with pytest.raises(InvalidRequestError, match="tools\\[1\\]: must be an object"):
        ToolSet.parse([WEATHER, "now"])


def test_tool_choice():
    assert ToolSet.parse([WEATHER]).choice == "auto"
    assert ToolSet.parse(None).choice == "none"
    assert ToolSet.parse([WEATHER], "none").active is False
    assert ToolSet.parse([WEATHER], "required").choice == "required"
    named = ToolSet.parse([WEATHER, TIME], {"type": "function", "function": {"name": "now"}})
    assert (named.choice, named.function) == ("named", "now")
    for choice, field, words in [
        ("always", "tool_choice", "must be none, auto, required"),
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name", "'nope' is not among"),
        ({"type": "function"}, "tool_choice.function.name", "must name one of"),
        ({"type": "code", "function": {"name": "now"}}, "tool_choice.type", "must be 'function'"),
        (3, "tool_choice", "must be a string"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            ToolSet.parse([WEATHER, TIME], choice)
        assert e.value.field == field and words in str(e.value)
    with pytest.raises(InvalidRequestError, match="'required' needs tools"):
        ToolSet.parse(None, "required")
    with pytest.raises(InvalidRequestError, match="parallel_tool_calls: must be true or false"):
        ToolSet.parse([WEATHER], None, "yes")


def test_output_schemas_validate_calls_and_compile():
    import xgrammar  # a dependency of kvmesh (the structured-outputs engine): never skipped
    required = ToolSet.parse([WEATHER, TIME], "required", False).output_schema()
    good = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]
    jsonschema.validate(good, required)
    for bad in ([], [{"name": "get_weather", "arguments": {"unit": "c"}}], [{"name": "other", "arguments": {}}],
                good + [{"name": "now", "arguments": {}}]):  # maxItems 1: parallel_tool_calls false
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    parallel = ToolSet.parse([WEATHER, TIME], "required").output_schema()
    jsonschema.validate(good + [{"name": "now", "arguments": {}}], parallel)
    named = ToolSet.parse([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.output_schema() == WEATHER["function"]["parameters"]
    assert ToolSet.parse([WEATHER]).output_schema() is None
    for schema in (required, parallel, named.output_schema()):
        xgrammar.Grammar.from_json_schema(json.dumps(schema))  # the grammar engine accepts it


def test_constrained_output_parses_to_the_calls():
    tools = ToolSet.parse([WEATHER, TIME], "required")
    parser = tools.parser(HermesParser(), constrained=True)
    assert isinstance(parser, CallArrayParser)
    _, calls = parser.extract('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", '
                              '"arguments": {}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("now", {})]
    named = ToolSet.parse([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    parser = named.parser(HermesParser(), constrained=True)
    assert isinstance(parser, NamedFunctionParser)
    assert [(c.name, c.arguments) for c in parser.extract('{"city": "Oslo"}')[1]] == [("get_weather",
                                                                                     '{"city": "Oslo"}')]
    assert isinstance(named.parser(HermesParser(), constrained=False), HermesParser)


# -- templates --------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1"},
    {"role": "tool", "content": "12:00", "tool_call_id": "call_2"},
]

# A Qwen 2.5-like template that reads tools (written for this test).
QWEN_LIKE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def smollm2():
    from kvmesh.checkpoint.files import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(None, progress=False))


def test_smollm2_gets_the_fallback_prompt(smollm2):
    source = template_source(smollm2)
    assert not takes_tools(source) and auto_tool_parser(source) == "hermes"
    tools = ToolSet.parse([WEATHER, TIME])
    conv, extra = template_messages(CONVERSATION, tools, takes_tools(source))
    assert extra == {}
    text = smollm2.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in text and "<tool_call></tool_call>" in text
    # the past calls as the model writes them, the results as one user turn it can read
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 3}\n</tool_response>\n<tool_response>\n12:00\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    # the model's answer in that same format parses back to the calls
    _, calls = HermesParser().extract('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert calls[0].name == "now"


def test_smollm2_tool_choice_none_and_required(smollm2):
    none, _ = template_messages(CONVERSATION[:2], ToolSet.parse([WEATHER], "none"), False)
    assert "# Tools" not in smollm2.apply_chat_template(none, tokenize=False)
    required, _ = template_messages(CONVERSATION[1:2], ToolSet.parse([WEATHER], "required"), False)
    assert required[0]["role"] == "system" and "You must call at least one function." in required[0]["content"]
    named, _ = template_messages(CONVERSATION[1:2], ToolSet.parse(
        [WEATHER], {"type": "function", "function": {"name": "get_weather"}}), False)
    assert "You must call the function get_weather." in named[0]["content"]


def test_template_that_reads_tools(smollm2):
    tok = copy.copy(smollm2)
    tok.chat_template = QWEN_LIKE
    source = template_source(tok)
    assert takes_tools(source) and isinstance(resolve_tool_parser("auto", source), HermesParser)
    conv, extra = template_messages(CONVERSATION, ToolSet.parse([WEATHER, TIME]), True)
    assert extra["tools"][0] == WEATHER
    assert conv[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object for | tojson
    assert conv[3]["tool_call_id"] == "call_1"
    text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False, **extra)
    assert text.startswith("<|im_start|>system\nBe brief.\n<tools>" + json.dumps(WEATHER))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text and "# Tools" not in text


def test_auto_parser_from_template_markers():
    assert auto_tool_parser("{{ '[TOOL_CALLS]' }}{{ tools }}") == "mistral"
    assert auto_tool_parser("{% if tools %}{{ '<|python_tag|>' }}{% endif %}") == "llama3_json"
    assert auto_tool_parser("{{ messages }}") == "hermes"
    assert not takes_tools("{% set tools = [] %}{{ tools }}")  # defined by the template itself
