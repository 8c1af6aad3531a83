"""`kvmesh bench throughput` and `kvmesh bench latency`: the offline engine in this
process (kvmesh.llm.LLM), no server, as vLLM's `bench throughput` / `bench latency`.

- throughput: every request submitted at once to `LLM.generate` (continuous batching
  does the rest); requests/s, output and total tokens/s over the wall time;
- latency: one batch (`batch_size` prompts of `input_len` random ids, `output_len`
  tokens each, EOS ignored) generated `num_iters` times after `num_iters_warmup` untimed
  runs; percentiles of the end-to-end time of a batch.
"""

from __future__ import annotations

import time

import numpy as np
from tqdm import tqdm

from kvmesh.bench.datasets import Sample
from kvmesh.bench.metrics import distribution
from kvmesh.engine.sampling_params import SamplingParams


def _params(samples: list[Sample], temperature: float, ignore_eos: bool) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=s.output_len, temperature=temperature, ignore_eos=ignore_eos)
            for s in samples]


def run_throughput(llm, samples: list[Sample], temperature: float = 0.0, ignore_eos: bool = True,
                   progress: bool = True) -> dict:
    """Generate every sample at once; the report of the pass."""
    prompts = [s.prompt_ids for s in samples]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, _params(samples, temperature, ignore_eos), use_tqdm=progress)
    wall = time.perf_counter() - t0
    inp = sum(len(p) for p in prompts)
    out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"num_requests": len(samples), "elapsed_s": wall, "total_input_tokens": inp,
            "total_output_tokens": out, "requests_per_s": len(samples) / wall,
            "output_tokens_per_s": out / wall, "total_tokens_per_s": (inp + out) / wall}


def latency_batch(tokenizer_vocab: int, batch_size: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """`batch_size` prompts of `input_len` random ids (from id 3 up: past the usual specials)."""
    rng = np.random.default_rng(seed)
    return rng.integers(3, max(tokenizer_vocab, 4), size=(batch_size, input_len)).tolist()


def run_latency(llm, prompts: list[list[int]], output_len: int, num_iters: int = 10, num_iters_warmup: int = 2,
                progress: bool = True) -> dict:
    """Time `num_iters` generations of the whole batch; mean and percentiles in seconds."""
    if num_iters < 1:
        raise ValueError(f"--num-iters must be >= 1, got {num_iters}")
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def once() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        if any(len(o.outputs[0].token_ids) != output_len for o in outs):
            raise RuntimeError("a request stopped before --output-len tokens (EOS should be ignored)")
        return wall

    for _ in tqdm(range(num_iters_warmup), desc="warm-up", disable=not progress):
        once()
    lat = [once() for _ in tqdm(range(num_iters), desc="timed", disable=not progress)]
    d = distribution(lat, ps=(10, 25, 50, 75, 90, 99))
    return {"batch_size": len(prompts), "input_len": len(prompts[0]) if prompts else 0, "output_len": output_len,
            "num_iters": num_iters, "num_iters_warmup": num_iters_warmup, "latencies_s": lat,
            "avg_latency_s": d["mean"], "percentiles_s": {k: v for k, v in d.items() if k.startswith("p")},
            "output_tokens_per_s": len(prompts) * output_len / d["mean"]}
