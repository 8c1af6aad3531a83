"""Reasoning parsers: <think> split into reasoning_content, whole and streamed alike."""

from __future__ import annotations

import random

import pytest

from kvmesh.chat import ChatOutput, ChatOutputSpec, get_reasoning_parser, merge_deltas
from kvmesh.chat.output import prompt_opens_think
from kvmesh.chat.tool_parsers import HermesParser

CASES = [
    # (parser, prompt opened <think>, reply, reasoning, content)
    ("deepseek_r1", False, "Let me think.</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", False, "<think>\nhmm</think>4", "\nhmm", "4"),
    ("deepseek_r1", False, "still thinking when cut", "still thinking when cut", ""),
    ("qwen3", False, "<think>\nstep 1</think>\n\nDone.", "\nstep 1", "Done."),
    ("qwen3", False, "Plain answer with </think> inside", None, "Plain answer with </think> inside"),
    ("qwen3", False, "  <thinking is not a tag", None, "  <thinking is not a tag"),
    ("qwen3", True, "opened by the prompt</think>answer", "opened by the prompt", "answer"),
    ("qwen3", False, "<think></think>\n\nempty thought", "", "empty thought"),
]


@pytest.mark.parametrize("name, opened, reply, reasoning, content", CASES)
def test_whole_and_streamed(name, opened, reply, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser.extract(reply, opened) == (reasoning, content)
    for seed in range(20):
        rng = random.Random(seed)
        s = parser.stream(opened)
        r_parts, c_parts, i = [], [], 0
        while i < len(reply):
            n = rng.randint(1, 4)
            r, c = s.feed(reply[i:i + n])
            r_parts.append(r)
            c_parts.append(c)
            i += n
        r, c = s.finish()
        assert ("".join(r_parts) + r if s.reasoned else None, "".join(c_parts) + c) == (reasoning, content)


def test_prompt_opens_think():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")


def test_reasoning_then_tool_calls():
    """The thought is reasoning_content; a call inside it is not a call; the one after is."""
    reply = ('<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call>?</think>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    spec = ChatOutputSpec(tool_parser=HermesParser(), reasoning=get_reasoning_parser("qwen3"))
    msg = ChatOutput(spec).message(reply)
    assert msg["reasoning_content"] == 'maybe <tool_call>{"name": "x", "arguments": {}}</tool_call>?'
    assert msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo"}')]
    out = ChatOutput(spec)
    deltas = [out.feed(reply[i:i + 3]) for i in range(0, len(reply), 3)] + [out.finish()]
    merged = merge_deltas(deltas)
    assert merged["reasoning_content"] == msg["reasoning_content"]
    assert [c["function"] for c in merged["tool_calls"]] == [c["function"] for c in msg["tool_calls"]]
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("o1")
