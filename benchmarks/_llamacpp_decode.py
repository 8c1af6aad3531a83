"""engine_throughput's llama.cpp runner: greedy batch-1 decode speed of GGUF files.

Run by ``_peer_procs.run_llamacpp`` with the llama.cpp venv's interpreter
(``scripts/install_llamacpp.sh``); it imports only the standard library and ``llama_cpp``.
Usage::

    VENV/bin/python _llamacpp_decode.py --in spec.json --out result.json

Input JSON: ``{"models": {name: gguf path}, "prompt": [ids], "max_tokens": n, "repeats": r,
"warmup": w, "threads": t, "extra_bufts": true}``; ``extra_bufts: false`` loads the weights
without llama.cpp's extra CPU buffer types (the AMX and repacked layouts; llama.cpp 0.3.36's
AMX path crashes on Q4_1 on an AMX Xeon). Per model: load it (``n_threads`` = ``n_threads_batch`` = t),
run ``warmup`` untimed generations, then ``repeats`` timed ones. A generation feeds the prompt
ids as they are (no BOS added) and decodes greedily (``temp=0``, ``top_k=1``, no penalties)
``max_tokens`` tokens; its decode speed is ``(max_tokens - 1) / (time from the first generated
token to the last)``, so the prompt's prefill is excluded, as on kvmesh's side. Output JSON:
per model the decode tok/s of each run, their median, the prefill time, and the generated ids.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def generate(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """(greedy ids, seconds to the first token, seconds from the first token to the last)."""
    llm.reset()  # a fresh sequence: no prompt reuse from the previous run
    ids, t0 = [], time.perf_counter()
    t_first = t0
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                            repeat_penalty=1.0, reset=True):
        ids.append(int(tok))
        if len(ids) == 1:
            t_first = time.perf_counter()
        if len(ids) == max_tokens:
            break
    return ids, t_first - t0, time.perf_counter() - t_first


def _no_extra_bufts() -> None:
    """Default model params with use_extra_bufts off, for every Llama() made afterwards."""
    import llama_cpp
    import llama_cpp.llama as high_level

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    high_level.llama_cpp.llama_model_default_params = params


def bench_model(path: str, spec: dict) -> dict:
    from llama_cpp import Llama

    n = spec["max_tokens"]
    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=max(512, len(spec["prompt"]) + n + 16), n_batch=512,
                n_threads=spec["threads"], n_threads_batch=spec["threads"], seed=0, verbose=False)
    load_s = time.perf_counter() - t0
    for _ in range(spec["warmup"]):
        generate(llm, spec["prompt"], n)
    runs, ids = [], []
    for r in range(spec["repeats"]):
        ids, first_s, decode_s = generate(llm, spec["prompt"], n)
        runs.append({"first_token_s": first_s, "decode_s": decode_s, "tok_per_s": (len(ids) - 1) / decode_s})
        print(f"{path.rsplit('/', 1)[-1]} run {r + 1}: {runs[-1]['tok_per_s']:.1f} tok/s", file=sys.stderr,
              flush=True)
    del llm
    return {"path": path, "load_s": load_s, "runs": runs,
            "decode_tok_per_s": statistics.median(r["tok_per_s"] for r in runs),
            "first_token_s_median": statistics.median(r["first_token_s"] for r in runs),
            "output_ids": ids}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--in", dest="inp", required=True, help="spec JSON")
    p.add_argument("--out", required=True, help="result JSON")
    args = p.parse_args()
    with open(args.inp) as f:
        spec = json.load(f)
    import llama_cpp

    if not spec.get("extra_bufts", True):
        _no_extra_bufts()
    res = {"llama_cpp_version": llama_cpp.__version__,
           "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
           "models": {name: bench_model(path, spec) for name, path in spec["models"].items()}}
    with open(args.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
