"""Tool-call parsers: whole-text results, streamed deltas that reassemble to exactly the
whole-text result for random splits of the text, and malformed calls that stay content."""

from __future__ import annotations

import json
import random

import pytest

from kvmesh.chat import merge_deltas
from kvmesh.chat.tool_parsers import (
    TOOL_PARSERS,
    CallArrayParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedFunctionParser,
    ToolParser,
    get_tool_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2, 3], "note": "a \"quoted\" </tool_call> {brace}"}


def stream(parser: ToolParser, text: str, rng: random.Random, max_calls: int | None = None):
    """(content, [(id, name, arguments)], deltas) of `text` fed in random pieces."""
    s = parser.stream(max_calls)
    deltas, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        deltas += s.feed(text[i:i + n])
        i += n
    deltas += s.finish()
    merged = merge_deltas(deltas)
    calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in merged.get("tool_calls", [])]
    return merged.get("content", ""), calls, deltas


def whole(parser: ToolParser, text: str, max_calls: int | None = None):
    content, calls = parser.extract(text, max_calls)
    return content, [(c.name, c.arguments) for c in calls]


def check_stream_matches(parser: ToolParser, text: str, seeds: int = 25, max_calls: int | None = None):
    expected = whole(parser, text, max_calls)
    for seed in range(seeds):
        content, calls, deltas = stream(parser, text, random.Random(seed), max_calls)
        assert (content, [(n, a) for _, n, a in calls]) == expected, f"seed {seed}"
        for d in deltas:  # the OpenAI delta shape: a header per call, then argument fragments
            for c in d.get("tool_calls", []):
                assert set(c) in ({"index", "id", "type", "function"}, {"index", "function"})
                if "id" in c:
                    assert c["type"] == "function" and c["function"]["arguments"] == ""
    return expected


def hermes_call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_hermes_calls_between_content():
    text = "Let me check.\n" + hermes_call("get_weather", WEATHER) + "\n" + hermes_call("now", {}) + " Done."
    content, calls = check_stream_matches(HermesParser(), text)
    assert content == "Let me check.\n\n Done."
    assert [n for n, _ in calls] == ["get_weather", "now"]
    assert json.loads(calls[0][1]) == WEATHER and json.loads(calls[1][1]) == {}


def test_hermes_qwen_variants():
    # No newlines, "parameters" for "arguments", arguments omitted, closing tag missing at the end.
    text = ('<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "b"}</tool_call><tool_call>\n{"arguments": {"y": [true, null]}, "name": "c"}\n')
    content, calls = check_stream_matches(HermesParser(), text)
    assert content == ""
    assert calls == [("a", '{"x": 1}'), ("b", "{}"), ("c", '{"y": [true, null]}')]


def test_plain_text_and_partial_tags_are_content():
    for text in ["no calls here", "a < b and <tool and <tool_cal", "x <tool_call", "<tool_call>", "{}"]:
        content, calls = check_stream_matches(HermesParser(), text)
        assert (content, calls) == (text, [])


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": get_weather}</tool_call>',          # not JSON
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',   # name not a string
    '<tool_call>{"city": "Paris"}</tool_call>',               # not a call object
    '<tool_call>{"arguments": {}}</tool_call>',              # no name
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
    '<tool_call>["f"]</tool_call>',
    '<tool_call>{"name": "f", "name": "g"}</tool_call>',     # duplicate key
])
def test_malformed_hermes_calls_stay_content(text):
    content, calls = check_stream_matches(HermesParser(), "before " + text + " after")
    assert calls == [] and content == "before " + text + " after"


def test_malformed_then_good_call():
    text = '<tool_call>{oops}</tool_call>' + hermes_call("f", {"a": 1})
    content, calls = check_stream_matches(HermesParser(), text)
    assert content == "<tool_call>{oops}</tool_call>" and calls == [("f", '{"a": 1}')]


def test_truncated_call_keeps_its_name_and_partial_arguments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = check_stream_matches(HermesParser(), text)
    assert content == "" and calls == [("get_weather", '{"city": "Par')]
    # cut before the name is complete: content
    content, calls = check_stream_matches(HermesParser(), '<tool_call>\n{"name": "get_w')
    assert calls == [] and content == '<tool_call>\n{"name": "get_w'


def test_arguments_stream_in_fragments():
    text = hermes_call("get_weather", WEATHER)
    _, calls, deltas = stream(HermesParser(), text, random.Random(0))
    fragments = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []) if "id" not in c]
    assert len(fragments) > 5 and "".join(fragments) == calls[0][2]
    assert calls[0][0].startswith("call_")


def test_parallel_tool_calls_false_keeps_the_first():
    text = hermes_call("a", {}) + hermes_call("b", {})
    content, calls = check_stream_matches(HermesParser(), text, max_calls=1)
    assert calls == [("a", "{}")] and content == ""


def test_llama3_json():
    text = '<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "parameters": {}}'
    assert check_stream_matches(Llama3JsonParser(), text) == ("", [("a", '{"q": "x;y"}'), ("b", "{}")])
    text = ' {"name": "search", "parameters": {"query": "kv cache"}}'
    assert check_stream_matches(Llama3JsonParser(), text) == ("", [("search", '{"query": "kv cache"}')])
    # JSON that is not a call, and prose, stay content
    for text in ['{"answer": 42}', "Hello {there}", '{"name": "Bob", "age": 3}']:
        assert check_stream_matches(Llama3JsonParser(), text) == (text, [])
    # text after the calls is content
    text = '{"name": "a", "parameters": {}} and that is it'
    assert check_stream_matches(Llama3JsonParser(), text) == (" and that is it", [("a", "{}")])


def test_mistral_both_forms():
    text = 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    content, calls = check_stream_matches(MistralParser(), text)
    assert content == "Sure. " and calls == [("a", '{"x": 1}'), ("b", "{}")]
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}'
    content, calls = check_stream_matches(MistralParser(), text)
    assert content == "" and calls == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    _, calls = MistralParser().extract(text)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    for bad in ['[TOOL_CALLS][{"name": 1}]', "[TOOL_CALLS] hello", "[TOOL_CALLS]f[ARGS][1]"]:
        assert check_stream_matches(MistralParser(), bad) == (bad, [])


def test_constrained_outputs():
    args = json.dumps(WEATHER)
    assert check_stream_matches(NamedFunctionParser("get_weather"), " " + args + "\n") == ("", [("get_weather", args)])
    arr = json.dumps([{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": WEATHER}])
    content, calls = check_stream_matches(CallArrayParser(), arr)
    assert content == "" and calls == [("a", '{"x": 1}'), ("b", json.dumps(WEATHER))]
    assert check_stream_matches(CallArrayParser(), arr[:-20])[1][0] == ("a", '{"x": 1}')  # cut short


def test_random_mixtures_reassemble_exactly():
    """Random content, calls and junk: the stream always equals the whole-text parse."""
    rng = random.Random(1234)
    pieces = ["hi ", "<", "<tool_call>", "</tool_call>", "{", "}", '"', "\n", "[TOOL_CALLS]", "[ARGS]", ";",
              '{"name": "f", "arguments": {"a": [1, "x"]}}', '{"name": "g"}', "f", "<|python_tag|>"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        for name in TOOL_PARSERS:
            check_stream_matches(get_tool_parser(name), text, seeds=3)


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        get_tool_parser("nope")
