"""Compression plumbing without models: markup, units, rendering, budgets, options."""

from __future__ import annotations

import pytest

from kvmesh._proto import llm_pb2
from kvmesh.compress import CompressionOptions, options_from_openai, parse_options
from kvmesh.compress.proto import options_from_proto, options_to_proto
from kvmesh.compress.text import (
    default_question, paragraph_spans, parse_marked_prompt, render, select_under_budget, sentence_spans, word_spans,
)
from kvmesh.errors import InvalidRequestError


def test_marked_prompt_splits_fixed_and_context_pieces():
    m = parse_marked_prompt("Instr.\n<context>a b</context> mid <context>c</context>\nQ: why?")
    assert m.fixed == ["Instr.\n", " mid ", "\nQ: why?"]
    assert m.contexts == ["a b", "c"]
    assert default_question(m) == "Q: why?"
    assert default_question(parse_marked_prompt("Q: who?<context>x</context>")) == "Q: who?"


@pytest.mark.parametrize("prompt, words", [
    ("no tags at all", "marks no compressible context"),
    ("<context>a<context>b</context></context>", "unbalanced"),
    ("a</context>", "unbalanced"),
    ("<context>never closed", "never closed"),
])
def test_bad_markup_is_a_clear_error(prompt, words):
    with pytest.raises(InvalidRequestError, match=words):
        parse_marked_prompt(prompt)


def test_units_never_cut_words_and_render_cleanly():
    text = "First para one. Second sentence!\n\n  Para two here.\nNext line."
    assert [text[s:e] for s, e in paragraph_spans(text)] == ["First para one. Second sentence!",
                                                            "Para two here.\nNext line."]
    assert [text[s:e] for s, e in sentence_spans(text)] == ["First para one.", "Second sentence!",
                                                           "Para two here.", "Next line."]
    words = word_spans(text)
    assert render(text, words) == text.strip()  # everything kept: the original text
    kept = [words[0], words[2], words[4], words[7]]
    assert render(text, kept) == "First one. sentence!\n\nhere."


def test_select_under_budget_prefers_high_scores_and_fills():
    #            0    1    2    3
    scores = [0.1, 0.9, 0.5, 0.8]
    costs = [2, 5, 2, 4]
    assert select_under_budget(scores, costs, 7) == [1, 2]  # 3 does not fit after 1, 2 does
    assert select_under_budget(scores, costs, 3) == [2]
    assert select_under_budget(scores, costs, 3, min_keep=1) == [1]  # the best overflows but is kept


def test_options_validate_with_field_names():
    assert parse_options(None) is None
    assert parse_options({"method": "token", "target_ratio": 3}).method == "token"
    with pytest.raises(InvalidRequestError, match=r"^compression.target_ratio: .*greater than or equal to 1"):
        parse_options({"target_ratio": 0.5})
    with pytest.raises(InvalidRequestError, match=r"^compression.method: "):
        parse_options({"method": "lingua"})
    with pytest.raises(InvalidRequestError, match=r"^compression.ratio: .*[Ee]xtra"):
        parse_options({"ratio": 2})
    with pytest.raises(InvalidRequestError, match=r"^compression: must be an object"):
        parse_options("passage")


def test_options_from_openai_body():
    assert options_from_openai({"model": "m", "prompt": "x"}) is None
    assert options_from_openai({"compression": None}) is None
    assert options_from_openai({"compression": {"target_ratio": 4}}) == CompressionOptions(target_ratio=4)
    with pytest.raises(InvalidRequestError, match="compression.granularity"):
        options_from_openai({"compression": {"granularity": "word"}})


def test_proto_round_trip_and_defaults():
    opts = CompressionOptions(method="token", target_ratio=3.5, question="who?", granularity="sentence")
    assert options_from_proto(options_to_proto(opts)) == opts
    assert options_from_proto(llm_pb2.Compression()) == CompressionOptions()
    with pytest.raises(InvalidRequestError, match="compression.target_ratio"):
        options_from_proto(llm_pb2.Compression(target_ratio=0.0))
