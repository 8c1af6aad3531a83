"""Benchmark workloads: lists of `Sample` (prompt token ids, output length, and for trace
replays an arrival time), built from a tokenizer and a seed so every server and every
round sees exactly the same requests.

- `random`: prompt and output lengths uniform in [len * (1 - r), len * (1 + r)] (vLLM's
  --random-range-ratio), prompt ids uniform over the tokenizer's non-special vocabulary;
- `prefix`: N shared prefixes, each request one of them (round robin, then shuffled) plus
  its own random suffix: what a prefix cache and prefix-aware routing are for;
- `sharegpt`: a ShareGPT-format JSON file; the first human turn is the prompt, the first
  answer's token count the output length (vLLM's filters: both >= 4 tokens, prompt <=
  1024, prompt + output <= 2048);
- `mooncake`: a Mooncake trace (JSONL of timestamp ms, input_length, output_length,
  hash_ids of 512-token blocks) replayed at its timestamps; each hash id becomes a fixed
  pseudo-random block of ids (so equal ids share a prefix), lengths and blocks scaled by
  `block_size / 512` for a small model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmesh.sim.trace import TRACE_BLOCK_SIZE, block_tokens, load_trace

DATASETS = ("random", "prefix", "sharegpt", "mooncake")


@dataclass
class Sample:
    """One request of a workload."""

    prompt_ids: list[int]
    output_len: int
    prompt: str = ""  # the text, for chat backends (decoded from prompt_ids when empty)
    arrival_s: float | None = None  # trace replays: send time, seconds from the start

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def vocab_ids(tokenizer) -> np.ndarray:
    """The token ids a random prompt may use: the whole vocabulary but the special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def length_range(mean: int, ratio: float) -> tuple[int, int]:
    """The inclusive range [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    if mean < 1:
        raise ValueError(f"lengths must be >= 1, got {mean}")
    return max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))


def random_samples(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[Sample]:
    """`num` requests of random ids, lengths uniform in the ranges of `length_range`."""
    rng = np.random.default_rng(seed)
    ids = vocab_ids(tokenizer)
    (ilo, ihi), (olo, ohi) = length_range(input_len, range_ratio), length_range(output_len, range_ratio)
    ins, outs = rng.integers(ilo, ihi + 1, size=num), rng.integers(olo, ohi + 1, size=num)
    return [Sample(rng.choice(ids, size=int(n)).tolist(), int(m)) for n, m in zip(ins, outs)]


def prefix_samples(tokenizer, num: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                   seed: int = 0) -> list[Sample]:
    """`num` requests, request i starting with prefix i % num_prefixes, order shuffled."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError("--prefix-num-prefixes and --prefix-len must be >= 1")
    rng = np.random.default_rng(seed)
    ids = vocab_ids(tokenizer)
    prefixes = [rng.choice(ids, size=prefix_len).tolist() for _ in range(num_prefixes)]
    out = [Sample(prefixes[i % num_prefixes] + rng.choice(ids, size=suffix_len).tolist(), output_len)
           for i in range(num)]
    return [out[i] for i in rng.permutation(num)]


def _turns(conv: dict) -> list[str]:
    """The turn texts of one ShareGPT record ({"conversations": [{"from", "value"}]}, or
    OpenAI-style {"messages": [{"role", "content"}]})."""
    turns = conv.get("conversations") or conv.get("messages") or []
    return [t.get("value", t.get("content")) for t in turns if isinstance(t, dict)]


def sharegpt_samples(path: str | Path, tokenizer, num: int, seed: int = 0, output_len: int | None = None,
                     max_model_len: int | None = None) -> list[Sample]:
    """`num` first-turn prompts of a ShareGPT JSON file, shuffled with `seed`; the output
    length is the first answer's token count unless `output_len` fixes it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset-path {path}: no such file (a ShareGPT JSON list of conversations)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    rng = np.random.default_rng(seed)
    out: list[Sample] = []
    for i in rng.permutation(len(data)):
        turns = _turns(data[i]) if isinstance(data[i], dict) else []
        if len(turns) < 2 or not all(isinstance(t, str) for t in turns[:2]):
            continue
        prompt_ids = tokenizer(turns[0], add_special_tokens=False)["input_ids"]
        n_out = output_len or len(tokenizer(turns[1], add_special_tokens=False)["input_ids"])
        limit = max_model_len or 2048
        if len(prompt_ids) < 4 or (output_len is None and n_out < 4):
            continue
        if len(prompt_ids) > min(1024, limit) or len(prompt_ids) + n_out > limit:
            continue
        out.append(Sample(list(prompt_ids), n_out, prompt=turns[0]))
        if len(out) >= num:
            break
    if not out:
        raise ValueError(f"{path}: no usable conversations (two turns, 4..1024 prompt tokens)")
    return out


def mooncake_samples(path: str | Path, vocab_size: int, num: int, block_size: int = TRACE_BLOCK_SIZE,
                     time_scale: float = 1.0, start_s: float = 0.0, max_input_len: int | None = None,
                     max_output_len: int | None = None) -> list[Sample]:
    """The first `num` requests of a Mooncake trace from `start_s`, re-timed from 0 and
    sped up `time_scale` times, lengths scaled by block_size / 512 (one trace block =
    `block_size` tokens); requests whose scaled prompt exceeds `max_input_len` are skipped."""
    if not Path(path).is_file():
        raise ValueError(f"--dataset-path {path}: no such file (a Mooncake JSONL trace)")
    if block_size < 1:
        raise ValueError(f"--trace-block-size must be >= 1, got {block_size}")
    scale = block_size / TRACE_BLOCK_SIZE
    out: list[Sample] = []
    for r in load_trace(path, start_s=start_s, time_scale=time_scale):
        n_in = max(1, math.ceil(r.input_length * scale))
        n_out = max(1, math.ceil(r.output_length * scale))
        if max_input_len is not None and n_in > max_input_len:
            continue
        if max_output_len is not None:
            n_out = min(n_out, max_output_len)
        blocks = r.hash_ids[: math.ceil(n_in / block_size)]
        ids = [t for h in blocks for t in block_tokens(h, block_size, vocab_size)][:n_in]
        if len(ids) < n_in:  # fewer hash ids than the length needs: pad with the request's own block
            ids += block_tokens(hash((r.arrival_s, r.input_length)) & 0xFFFFFFFF, n_in - len(ids), vocab_size)
        out.append(Sample(ids, n_out, arrival_s=r.arrival_s))
        if len(out) >= num:
            break
    if not out:
        raise ValueError(f"{path}: no requests from {start_s} s (check --trace-start-s / --trace-max-input-len)")
    t0 = out[0].arrival_s or 0.0
    for s in out:
        s.arrival_s = (s.arrival_s or 0.0) - t0
    return out


def with_text(samples: list[Sample], tokenizer) -> list[Sample]:
    """Fill in each sample's text (for chat backends) by decoding its ids."""
    for s in samples:
        if not s.prompt:
            s.prompt = tokenizer.decode(s.prompt_ids, skip_special_tokens=True)
    return samples
