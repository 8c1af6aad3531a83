"""engine_throughput's workload: requests whose prompts are windows of real English text.

Prompt lengths and output lengths are uniform in inclusive ranges (numpy
``default_rng(seed)``); prompts are windows of tokenized docstrings at distinct random
offsets, so no two prompts share a prefix and the prefix cache cannot help.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Modules whose docstrings are the prompt text (English prose with some code).
TEXT_SOURCES = ("torch.nn.modules.module", "transformers.generation.utils")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    source: str
    seed: int
    prompt_offsets: list[int] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)


def load_text_tokens(tokenizer) -> tuple[list[int], str]:
    """Token ids of the docstrings of TEXT_SOURCES (read from disk, not imported)."""
    docs, used = [], []
    for mod in TEXT_SOURCES:
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.origin:
            continue
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        nodes = (n for n in ast.walk(tree)
                 if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
        texts = [d for d in (ast.get_docstring(n) for n in nodes) if d]
        docs.extend(texts)
        used.append(f"{mod} ({len(texts)} docstrings)")
    ids = tokenizer("\n\n".join(docs), add_special_tokens=False, verbose=False)["input_ids"] if docs else []
    return list(ids), "docstrings of " + ", ".join(used)


def make_workload(tokenizer, num_requests: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int = 0) -> Workload:
    """Requests with uniform prompt/output lengths (inclusive ranges), text windows as prompts."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_requests)
    text, source = load_text_tokens(tokenizer)
    if len(text) < 4 * prompt_range[1]:
        # Fallback: random ids from a safe range (skips the special tokens at the start).
        vocab = len(tokenizer)
        text = rng.integers(3, min(vocab, 49152), size=max(64 * prompt_range[1], 8192)).tolist()
        source = "random token ids in [3, 49152) (text source unavailable)"
    prompts, offsets, used = [], [], set()
    for n in prompt_lens:
        n = int(n)
        while True:  # distinct start offsets: no shared prefixes between prompts
            start = int(rng.integers(0, len(text) - n + 1))
            if start not in used:
                break
        used.add(start)
        offsets.append(start)
        prompts.append([int(t) for t in text[start:start + n]])
    source += f"; {len(text)} tokens, windows at distinct random offsets"
    return Workload(prompts, [int(x) for x in output_lens], source, seed, offsets)


def text_prompt(tokenizer, n: int) -> list[int]:
    """An n-token prompt: the last n tokens of the text (random ids if the text is shorter)."""
    text, _ = load_text_tokens(tokenizer)
    if len(text) >= n:
        return text[-n:]
    return np.random.default_rng(1).integers(3, 49152, size=n).tolist()
