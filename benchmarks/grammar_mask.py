"""Grammar engines on this CPU: xgrammar vs llguidance, to choose kvmesh's structured-outputs backend.

What is measured, for each spec (three JSON schemas of growing size, json_object, a regex, a
choice) on the embedded model's tokenizer (SmolLM2, 49152 tokens):

* **compile**: building the grammar from the spec, with no cache (xgrammar: a fresh
  ``compile_*`` with the compiler's cache off; llguidance: constructing an ``LLMatcher``, which
  is where it builds its token trie / lexer for the spec), median of ``--repeats``;
* **mask**: the per-token cost of filling the (ceil(V / 32),) int32 allowed-token bitmask while
  walking a valid output of the spec token by token (fill, then accept the next token), median
  over the walk's positions and ``--repeats`` walks; ``mask p90`` as well, since one slow
  position stalls the whole batch's step.

The mask is what runs on every decode step (concurrently with the forward pass in kvmesh:
worker/structured.py), so it decides the choice; compile is paid once per distinct spec (cached).
The load average is printed next to the numbers (2 shared cores: compare within one run only).

    python benchmarks/grammar_mask.py              # ~10 s
    python benchmarks/grammar_mask.py --repeats 1  # smoke

Results: ``benchmarks/results/grammar_mask.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time

import torch

from kvmesh.checkpoint.embedded import ensure_embedded_model
from kvmesh.checkpoint.files import load_tokenizer

from _common import RESULTS_DIR, md_table, write_results

SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"]}
MEDIUM = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "temperature": {"type": "number", "minimum": -90, "maximum": 60},
        "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "temperature", "conditions"],
}
LARGE = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "user": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"},
            "roles": {"type": "array", "items": {"type": "string", "enum": ["admin", "dev", "ops"]}}},
            "required": ["name", "roles"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number"}}, "required": ["sku", "qty"]}},
        "note": {"type": ["string", "null"]},
        "paid": {"type": "boolean"},
    },
    "required": ["id", "user", "items", "paid"],
}

# (name, kind, spec, a valid output to walk)
SPECS = [
    ("json_small", "json", SMALL, json.dumps({"name": "Ada Lovelace", "age": 36})),
    ("json_medium", "json", MEDIUM, json.dumps({"city": "Paris", "temperature": 21.5, "conditions": "sunny",
                                                "tags": ["warm", "dry"]})),
    ("json_large", "json", LARGE, json.dumps({"id": 7, "user": {"name": "Bo", "email": "bo@x.io",
                                                                "roles": ["dev", "ops"]},
                                              "items": [{"sku": "A-1", "qty": 2, "price": 9.5},
                                                        {"sku": "B-22", "qty": 1}],
                                              "note": None, "paid": True})),
    ("json_object", "json_object", None, json.dumps({"answer": "yes", "score": [1, 2, 3]})),
    ("regex_date_time", "regex", r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2})?Z", "2024-05-17T09:30:00Z"),
    ("choice", "choice", ["positive", "negative", "neutral"], "neutral"),
]


def _regex_of_choice(choices: list[str]) -> str:
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False, max_threads=1)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec))
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_regex(_regex_of_choice(spec))

    def walk(self, compiled, tokens: list[int]) -> list[float]:
        m = self.xgr.GrammarMatcher(compiled)
        mask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            assert m.accept_token(t), "walk token rejected"
        return times


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        M = self.ll.LLMatcher
        if kind == "json":
            grammar = M.grammar_from_json_schema(json.dumps(spec))
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema('{"type": "object"}')
        elif kind == "regex":
            grammar = M.grammar_from_regex(spec)
        else:
            grammar = M.grammar_from_regex(_regex_of_choice(spec))
        m = M(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar, m

    def walk(self, compiled, tokens: list[int]) -> list[float]:
        import llguidance.torch as lt

        m = self.ll.LLMatcher(self.tok, compiled[0])
        mask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t0)
            assert m.consume_token(t), f"walk token rejected: {m.get_error()}"
        return times


def measure(backend, tokenizer, repeats: int) -> list[dict]:
    rows = []
    for name, kind, spec, text in SPECS:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        compile_s, mask_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = backend.compile(kind, spec)
            compile_s.append(time.perf_counter() - t0)
            mask_s.extend(backend.walk(compiled, tokens))
        mask_s.sort()
        rows.append({"backend": backend.name, "spec": name, "tokens": len(tokens),
                     "compile_ms": statistics.median(compile_s) * 1e3,
                     "mask_us": statistics.median(mask_s) * 1e6,
                     "mask_p90_us": mask_s[int(0.9 * (len(mask_s) - 1))] * 1e6})
    return rows


def render(data: dict) -> str:
    lines = ["# Grammar mask time: xgrammar vs llguidance (CPU)", "",
             f"{data['date']}; tokenizer: {data['tokenizer']} ({data['vocab_size']} tokens); "
             f"{data['repeats']} repeats; load average {data['load_start']} -> {data['load_end']} "
             f"on {os.cpu_count()} cores (shared).", ""]
    by = {(r["backend"], r["spec"]): r for r in data["rows"]}
    specs = [s[0] for s in SPECS]
    table = []
    for s in specs:
        x, g = by[("xgrammar", s)], by[("llguidance", s)]
        table.append([s, x["tokens"], f"{x['compile_ms']:.1f}", f"{g['compile_ms']:.1f}",
                      f"{x['mask_us']:.0f}", f"{g['mask_us']:.0f}", f"{x['mask_p90_us']:.0f}",
                      f"{g['mask_p90_us']:.0f}"])
    lines += md_table(["spec", "tokens", "compile ms xgr", "compile ms llg", "mask us xgr", "mask us llg",
                       "mask p90 us xgr", "mask p90 us llg"], table)
    lines += ["", f"Sum of median per-token mask times: xgrammar {data['mask_sum_us']['xgrammar']:.0f} us, "
              f"llguidance {data['mask_sum_us']['llguidance']:.0f} us. Chosen: **{data['chosen']}** "
              "(lower per-token mask time: the mask is paid on every constrained decode step).", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    path = ensure_embedded_model()
    tokenizer = load_tokenizer(path)
    vocab_size = len(tokenizer)
    load_start = [round(x, 2) for x in os.getloadavg()]
    print("load average at start:", load_start)
    rows = []
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        backend = cls(tokenizer, vocab_size)
        print(f"{cls.name}: tokenizer info in {time.perf_counter() - t0:.2f} s")
        rows += measure(backend, tokenizer, args.repeats)
    load_end = [round(x, 2) for x in os.getloadavg()]
    sums = {b: sum(r["mask_us"] for r in rows if r["backend"] == b) for b in ("xgrammar", "llguidance")}
    data = {"date": dt.datetime.now().isoformat(timespec="seconds"), "tokenizer": str(path.name),
            "vocab_size": vocab_size, "repeats": args.repeats, "load_start": load_start, "load_end": load_end,
            "rows": rows, "mask_sum_us": sums, "chosen": min(sums, key=sums.get)}
    md = render(data)
    print(md)
    print("load average at end:", load_end)
    write_results("grammar_mask", data, md, out_dir=args.out_dir)
    return data


if __name__ == "__main__":
    main()
