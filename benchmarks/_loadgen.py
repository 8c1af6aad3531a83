"""An open-loop OpenAI-streaming load generator (what `vllm bench serve` does), used by
benchmarks/serving_peers.py against any OpenAI-compatible server: kvmesh's and vLLM's.

Requests are token-id prompts sent to /v1/completions with `stream: true` and
`stream_options.include_usage`, so every server sees exactly the same prompts and the
output token count comes from the server's own usage record. Arrivals are a Poisson
process (`rate` requests/s) or a burst (`rate=inf`). Per request: TTFT (first content
chunk), inter-token latencies (one per chunk after the first, divided over the tokens
the chunk carried), end-to-end latency and output tokens.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (vLLM's TPOT)."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def _one(client: httpx.AsyncClient, url: str, model: str, req: Request) -> Result:
    body = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    res = Result(ok=False)
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if msg.get("usage"):
                    res.output_tokens = msg["usage"]["completion_tokens"]
                if not msg.get("choices") or not msg["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last = now
        res.e2e_s = time.perf_counter() - t0
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no usage record in the stream"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = repr(exc)
    return res


async def run_load(base_url: str, model: str, requests: list[Request], rate: float, seed: int = 0,
                   timeout_s: float = 600.0, progress=None,
                   arrivals_s: list[float] | None = None) -> tuple[list[Result], float]:
    """Send `requests` open-loop at `rate` req/s (inf: all at once), or at the given
    `arrivals_s` (seconds from the start, one per request: a trace replay); returns
    (results, wall seconds)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        url = base_url.rstrip("/") + "/completions"
        tasks = []
        t0 = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(_one(client, url, model, req)))
            if progress is not None:
                tasks[-1].add_done_callback(lambda _: progress.update(1))
            if arrivals_s is not None:
                nxt = len(tasks)
                if nxt < len(arrivals_s):
                    await asyncio.sleep(max(0.0, t0 + arrivals_s[nxt] - time.perf_counter()))
            elif not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], wall_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    itl = [x for r in ok for x in r.itl_s]
    good = [r for r in ok if r.ttft_s <= slo_ttft_s and r.tpot_s <= slo_tpot_s]
    summary = {
        "requests": len(results), "failed": len(results) - len(ok), "wall_s": wall_s,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else 0.0, "output_tokens": out_tokens,
        "goodput_req_s": len(good) / wall_s if wall_s > 0 else 0.0,
        "slo_attainment": len(good) / len(results) if results else 0.0,
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }
    for name, xs in (("ttft", [r.ttft_s for r in ok]), ("tpot", [r.tpot_s for r in ok if r.output_tokens > 1]),
                     ("itl", itl), ("e2e", [r.e2e_s for r in ok])):
        summary[f"{name}_p50_s"] = statistics.median(xs) if xs else float("nan")
        summary[f"{name}_p99_s"] = _pct(xs, 99)
    summary["ttft_all_s"] = sorted(r.ttft_s for r in ok)
    summary["tpot_all_s"] = sorted(r.tpot_s for r in ok if r.output_tokens > 1)
    return summary
