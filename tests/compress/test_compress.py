"""Both compression methods on real models (embedded SmolLM2-135M, all-MiniLM-L6-v2),
each loaded once per process by kvmesh.compress.get_compressor."""

from __future__ import annotations

import pytest

from kvmesh.compress import compress, compress_prompt, get_compressor
from kvmesh.compress.api import default_tokenizer
from kvmesh.quant.quality import license_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

INSTRUCTION = "Answer the question using only the passages below."
QUESTION = "Question: What is the capital city of Burkina Faso?"
ANSWER = "The capital city of Burkina Faso is Ouagadougou, home to about two and a half million people."
DISTRACTORS = [
    "Bananas are grown in tropical regions and are harvested while still green.",
    "The violin has four strings tuned in perfect fifths and is played with a bow.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The Pacific Ocean is the largest and deepest of the world's five oceans.",
    "Chess originated in India during the Gupta empire, around the sixth century.",
    "Copper is an excellent conductor of electricity and is widely used in wiring.",
    "The Great Wall of China stretches for thousands of kilometres across the north.",
    "Honey bees communicate the location of flowers through a waggle dance.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa.",
    "The French Revolution began in 1789 with the storming of the Bastille.",
    "Saturn's rings are made mostly of ice particles with some rock and dust.",
]


def rag_prompt(passages: list[str]) -> str:
    return f"{INSTRUCTION}\n\n<context>{chr(10).join(p + chr(10) for p in passages)}</context>\n\n{QUESTION}"


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def test_passage_keeps_the_answer_and_never_touches_instruction_or_question(tok):
    passages = DISTRACTORS[:6] + [ANSWER] + DISTRACTORS[6:]
    prompt = rag_prompt(passages)
    out = compress_prompt(prompt, {"method": "passage", "target_ratio": 4}, tokenizer=tok)
    head, tail = prompt.split("<context>")[0], prompt.split("</context>")[1]
    assert out.text.startswith(head) and out.text.endswith(tail)
    assert ANSWER in out.text
    assert out.kept_context_tokens <= out.original_context_tokens / 4 * 1.02 + 1
    assert out.original_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert out.kept_tokens == len(tok.encode(out.text, add_special_tokens=False))
    kept = [prompt.split("<context>")[1][s.start:s.end] for s in out.kept_spans]
    assert ANSWER in kept and all(k in passages for k in kept)
    # kept passages stay in their original order
    assert [passages.index(k) for k in kept] == sorted(passages.index(k) for k in kept)


def test_passage_ratio_is_met(tok):
    passages = [f"{d} This is filler sentence number {i}." for i, d in enumerate(DISTRACTORS * 2)]
    for ratio in (2.0, 3.0, 5.0):
        out = compress(INSTRUCTION, passages, QUESTION, {"method": "passage", "target_ratio": ratio}, tokenizer=tok)
        budget = out.original_context_tokens / ratio
        biggest = max(len(tok.encode(p, add_special_tokens=False)) for p in passages)
        assert budget - biggest <= out.kept_context_tokens <= budget * 1.02 + 1, (ratio, out.kept_context_tokens, budget)
        assert out.text.startswith(INSTRUCTION + "\n\n") and out.text.endswith("\n\n" + QUESTION)


def test_token_method_drops_predictable_tokens_first(tok):
    # The second copy of an odd sentence is predictable from the first (induction):
    # self-information ranks its words low, so they go first.
    s = "Marmalade otters negotiate quietly with seventeen violet umbrellas beside the frozen harbour of Quillmore."
    out = compress("Read this.", [f"{s} {s}"], "What happened?", {"method": "token", "target_ratio": 2}, tokenizer=tok)
    first = sum(1 for k in out.kept_spans if k.start < len(s))
    second = len(out.kept_spans) - first
    assert first >= 4 * max(second, 1), out.contexts
    scores = out.scores[0]
    n = len(scores) // 2
    assert sum(scores[:n]) / n > 2 * sum(scores[n:]) / n  # mean self-information per word, nats


def test_token_method_meets_ratio_keeps_whole_words_and_fixed_spans(tok):
    text = license_text()[0][:1600]
    context = " ".join(text.split())  # one paragraph of real English
    prompt = f"Summarize the license history.\n<context>{context}</context>\nSummary:"
    out = compress_prompt(prompt, {"method": "token", "target_ratio": 3}, tokenizer=tok)
    assert out.text.startswith("Summarize the license history.\n") and out.text.endswith("\nSummary:")
    budget = out.original_context_tokens / 3
    assert 0.85 * budget <= out.kept_context_tokens <= 1.02 * budget + 1, (out.kept_context_tokens, budget)
    words = set(context.split())
    assert all(w in words for w in out.contexts[0].split())  # whole words only, verbatim
    assert len(out.kept_spans) == len(out.contexts[0].split())


def test_ratio_one_keeps_everything_without_loading_a_model(tok, monkeypatch):
    import kvmesh.compress.api as api

    monkeypatch.setattr(api, "get_compressor", lambda m: pytest.fail("no model needed at ratio 1"))
    out = compress_prompt("I\n<context>a b c</context>\nQ", {"method": "token", "target_ratio": 1}, tokenizer=tok)
    assert out.text == "I\na b c\nQ"


def test_compressors_are_loaded_once():
    assert get_compressor("passage") is get_compressor("passage")
