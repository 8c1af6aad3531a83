"""The `bench serve` workloads: random lengths within their ranges and no special tokens,
prefix sharing exactly as configured, ShareGPT parsing and filters, and Mooncake replay
(the trace sample in benchmarks/data: timing re-based and scaled, lengths scaled, equal
hash ids giving equal prompt blocks)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from tiny_models import build_tokenizer

from kvmesh.bench import mooncake_samples, prefix_samples, random_samples, sharegpt_samples, with_text
from kvmesh.bench.datasets import length_range

TRACE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "mooncake_conversation_200.jsonl"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(384)


def test_random_lengths_stay_in_range_and_avoid_special_tokens(tok):
    samples = random_samples(tok, 200, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    assert length_range(40, 0.5) == (20, 60) and length_range(10, 0.5) == (5, 15)
    assert all(20 <= s.prompt_len <= 60 and 5 <= s.output_len <= 15 for s in samples)
    assert min(s.prompt_len for s in samples) < 25 and max(s.prompt_len for s in samples) > 55  # the whole range
    special = set(tok.all_special_ids)
    assert not special & {t for s in samples for t in s.prompt_ids}
    assert all(0 <= t < len(tok) for s in samples for t in s.prompt_ids)
    again = random_samples(tok, 200, 40, 10, 0.5, seed=3)
    assert [s.prompt_ids for s in again] == [s.prompt_ids for s in samples]
    fixed = random_samples(tok, 5, 16, 4, seed=0)
    assert {(s.prompt_len, s.output_len) for s in fixed} == {(16, 4)}
    with pytest.raises(ValueError, match="range-ratio"):
        random_samples(tok, 5, 16, 4, range_ratio=1.0)
    assert with_text(fixed, tok)[0].prompt == tok.decode(fixed[0].prompt_ids, skip_special_tokens=True)


def test_prefix_requests_share_exactly_the_configured_prefixes(tok):
    samples = prefix_samples(tok, 12, num_prefixes=3, prefix_len=20, suffix_len=5, output_len=7, seed=1)
    assert all(s.prompt_len == 25 and s.output_len == 7 for s in samples)
    prefixes = Counter(tuple(s.prompt_ids[:20]) for s in samples)
    assert sorted(prefixes.values()) == [4, 4, 4]
    assert len({tuple(s.prompt_ids[20:]) for s in samples}) == 12  # every suffix its own



def test_sharegpt_first_turns_with_vllm_filters(tok, tmp_path):
    long_text = "word " * 3000
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is the capital of France, please?"},
                                      {"from": "gpt", "value": "The capital of France is Paris, of course."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        {"id": "c", "conversations": [{"from": "human", "value": long_text}, {"from": "gpt", "value": "ok ok ok ok"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "only one turn here"}]},
        {"id": "e", "messages": [{"role": "user", "content": "Name three prime numbers below twenty."},
                                 {"role": "assistant", "content": "Two, three and five are three of them."}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    samples = sharegpt_samples(path, tok, 10, seed=0)
    assert sorted(s.prompt for s in samples) == sorted([data[0]["conversations"][0]["value"],
                                                        data[4]["messages"][0]["content"]])
    for s in samples:
        assert s.prompt_ids == tok(s.prompt, add_special_tokens=False)["input_ids"] and s.output_len >= 4
    answer = tok(data[0]["conversations"][1]["value"], add_special_tokens=False)["input_ids"]
    assert next(s for s in samples if "France" in s.prompt).output_len == len(answer)
    assert {s.output_len for s in sharegpt_samples(path, tok, 10, output_len=9)} == {9}
    assert len(sharegpt_samples(path, tok, 1)) == 1
    with pytest.raises(ValueError, match="no such file"):
        sharegpt_samples(tmp_path / "missing.json", tok, 1)


def test_mooncake_replay_timing_lengths_and_shared_blocks():
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()[:30]]
    samples = mooncake_samples(TRACE, 384, 30, block_size=16, time_scale=4.0)
    assert len(samples) == 30
    for s, row in zip(samples, rows):
        assert s.arrival_s == pytest.approx((row["timestamp"] - rows[0]["timestamp"]) / 1000 / 4.0)
        assert s.prompt_len == -(-row["input_length"] * 16 // 512)  # ceil of the scaled length
        assert s.output_len == max(1, -(-row["output_length"] * 16 // 512))
    # equal leading hash ids -> equal leading 16-token blocks; a different id -> a different block
    a, b = rows[0]["hash_ids"], rows[1]["hash_ids"]
    assert a[0] == b[0] and a[1] != b[1]
    assert samples[0].prompt_ids[:16] == samples[1].prompt_ids[:16]
    assert samples[0].prompt_ids[16:32] != samples[1].prompt_ids[16:32]
    capped = mooncake_samples(TRACE, 384, 10, block_size=16, max_input_len=100, max_output_len=3)
    assert all(s.prompt_len <= 100 and s.output_len <= 3 for s in capped)
    assert capped[0].arrival_s == 0.0
    with pytest.raises(ValueError, match="Mooncake"):
        mooncake_samples(TRACE.with_name("missing.jsonl"), 384, 1)
