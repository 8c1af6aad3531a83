"""The older scripts' spelling of `kvmesh bench serve`'s load generator (kvmesh.bench),
for benchmarks/fleet_real.py and benchmarks/autoscale_ramp.py: `run_load` sends token-id
prompts to an OpenAI /v1/completions stream (open loop, Poisson at `rate` or at given
arrival times) through kvmesh.bench's client, and `summarize` gives the flat, seconds-
based summary those scripts read. New code uses kvmesh.bench directly (serving_peers.py).
"""

from __future__ import annotations

import math
import statistics

from kvmesh.bench import RequestOptions, RequestRecord, Sample, ServeConfig, percentile, run_serve_async

Result = RequestRecord  # ok, ttft_s, e2e_s, itl_s, output_tokens, tpot_s, error


def Request(prompt_ids: list[int], max_tokens: int) -> Sample:  # noqa: N802 (the old dataclass's name)
    return Sample(list(prompt_ids), max_tokens)


async def run_load(base_url: str, model: str, requests: list[Sample], rate: float, seed: int = 0,
                   timeout_s: float = 600.0, progress=None,
                   arrivals_s: list[float] | None = None) -> tuple[list[RequestRecord], float]:
    """Send `requests` open-loop at `rate` req/s (inf: all at once), or at `arrivals_s`
    (seconds from the start, one per request: a trace replay); (records, wall seconds).
    `base_url` ends in /v1, as the OpenAI client's does."""
    samples = [Sample(r.prompt_ids, r.output_len, arrival_s=None if arrivals_s is None else arrivals_s[i])
               for i, r in enumerate(requests)]
    target = base_url.rstrip("/").removesuffix("/v1")
    cfg = ServeConfig(backend="openai", target=target, model=model, request_rate=rate if rate > 0 else math.inf,
                      seed=seed, options=RequestOptions(timeout_s=timeout_s), progress=False)
    res = await run_serve_async(cfg, samples)
    if progress is not None:
        progress.update(len(samples))
    return res.records, res.duration_s


def summarize(results: list[RequestRecord], wall_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if r.ttft_s <= slo_ttft_s and r.tpot_s <= slo_tpot_s]
    summary = {
        "requests": len(results), "failed": len(results) - len(ok), "wall_s": wall_s,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else 0.0, "output_tokens": out_tokens,
        "goodput_req_s": len(good) / wall_s if wall_s > 0 else 0.0,
        "slo_attainment": len(good) / len(results) if results else 0.0,
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }
    for name, xs in (("ttft", [r.ttft_s for r in ok]), ("tpot", [r.tpot_s for r in ok if r.output_tokens > 1]),
                     ("itl", [x for r in ok for x in r.itl_s]), ("e2e", [r.e2e_s for r in ok])):
        summary[f"{name}_p50_s"] = statistics.median(xs) if xs else float("nan")
        summary[f"{name}_p99_s"] = percentile(xs, 99)
    summary["ttft_all_s"] = sorted(r.ttft_s for r in ok)
    summary["tpot_all_s"] = sorted(r.tpot_s for r in ok if r.output_tokens > 1)
    return summary
