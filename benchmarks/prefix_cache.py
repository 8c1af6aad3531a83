"""TTFT with a shared 1,024-token prefix: cold vs local prefix-cache hit vs Redis hit.

Each repeat uses a fresh random 1,024-token prefix plus 32-token unique suffixes on the
embedded SmolLM2 (float32):

* cold  - engine A (connected to Redis) sees the prefix for the first time: computes
          all 1,056 tokens (and writes the prefix blocks to Redis behind the response);
* local - engine A again, same prefix, new suffix: local prefix-cache hit, computes 32;
* redis - engine B, a fresh engine (empty local cache) on the same Redis, new suffix:
          loads the 64 prefix blocks from Redis, computes 32.

TTFT = time from add_request to the first output token, medians over `--repeats`.
A real redis-server is started on a free loopback port (maxmemory 1gb, allkeys-lru).
Run on idle cores (`cat /proc/loadavg`; the load is recorded beside the results):

    python benchmarks/prefix_cache.py [--repeats 5] [--threads 2]

Results: benchmarks/results/prefix_cache.{json,md,png}.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import time

import torch
from tqdm import tqdm

from kvmesh import LLM, SamplingParams

from _common import RESULTS_DIR, check_idle, first_output, loadavg, write_results

PREFIX, SUFFIX = 1024, 32
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def start_redis() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    for _ in range(200):
        try:
            redis.Redis(port=port).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    return proc, f"redis://127.0.0.1:{port}/0?timeout_ms=1000"


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """(seconds from add_request to the first token, prompt tokens served from a cache)."""
    eng = llm.engine
    t0 = time.perf_counter()
    out = first_output(eng, eng.add_request(None, prompt, ONE_TOKEN))
    return time.perf_counter() - t0, out.num_cached_tokens


def ids(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=gen).tolist()


def measure(url: str, repeats: int, threads: int) -> tuple[dict, dict, dict]:
    """TTFTs and cached-token counts per path (cold, local, redis), and both engines' stats."""
    a = LLM(kv_store=url, num_threads=threads)
    b = LLM(kv_store=url, num_threads=threads)
    gen = torch.Generator().manual_seed(0)
    ttft(a, ids(64, gen)), ttft(b, ids(64, gen))  # warm up both engines
    rows = {"cold": [], "local": [], "redis": []}
    cached = {"cold": [], "local": [], "redis": []}
    prefixes = [ids(PREFIX, gen) for _ in range(repeats)]
    for prefix in tqdm(prefixes, desc="cold + local hit (engine A)"):
        for kind in ("cold", "local"):
            t, c = ttft(a, prefix + ids(SUFFIX, gen))
            rows[kind].append(t)
            cached[kind].append(c)
    a.engine.kv_connector.flush()
    for prefix in tqdm(prefixes, desc="redis hit (fresh engine B)"):
        t, c = ttft(b, prefix + ids(SUFFIX, gen))
        rows["redis"].append(t)
        cached["redis"].append(c)
    return rows, cached, {"a": a.engine.stats(), "b": b.engine.stats()}


def markdown(res: dict) -> str:
    med, cached, targets = res["median_ttft_s"], res["cached_tokens"], res["targets"]
    md = [
        (f"# Prefix cache TTFT ({res['prefix_tokens']}-token shared prefix + {res['suffix_tokens']}-token suffix, "
         f"embedded model, {res['threads']} threads, median of {res['repeats']})"),
        "", f"load average at start / end: {res['loadavg_start']} / {res['loadavg_end']}", "",
        "| path | median TTFT (ms) | cached tokens | speedup vs cold | target |",
        "|---|---:|---:|---:|---|",
        f"| cold | {med['cold'] * 1e3:.1f} | {cached['cold'][0]} | 1.0x | |",
        (f"| local hit | {med['local'] * 1e3:.1f} | {cached['local'][0]} | {res['speedup_local']:.1f}x | "
         f">= 8x: {'met' if targets['local >= 8x'] else 'missed'} |"),
        (f"| Redis hit (fresh engine) | {med['redis'] * 1e3:.1f} | {cached['redis'][0]} | "
         f"{res['speedup_redis']:.1f}x | >= 4x: {'met' if targets['redis >= 4x'] else 'missed'} |"),
    ]
    return "\n".join(md) + "\n"


def plot(plt, res: dict):
    med = res["median_ttft_s"]
    fig, ax = plt.subplots(figsize=(6, 4))
    names = ["cold", "local hit", "Redis hit"]
    vals = [med["cold"] * 1e3, med["local"] * 1e3, med["redis"] * 1e3]
    bars = ax.bar(names, vals, color=["#999999", "#2a9d8f", "#e76f51"])
    for bar, v, k in zip(bars, vals, ["cold", "local", "redis"]):
        ax.annotate(f"{v:.0f} ms\n{med['cold'] / med[k]:.1f}x", (bar.get_x() + bar.get_width() / 2, v),
                    ha="center", va="bottom")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title(f"TTFT, {res['prefix_tokens']}-token shared prefix")
    fig.tight_layout()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = loadavg()
    check_idle(args.threads, load_start[0])
    proc, url = start_redis()
    try:
        rows, cached, stats = measure(url, args.repeats, args.threads)
    finally:
        proc.kill()
    med = {k: statistics.median(v) for k, v in rows.items()}
    res = {
        "model": "SmolLM2-135M-Instruct (float32)", "prefix_tokens": PREFIX, "suffix_tokens": SUFFIX,
        "repeats": args.repeats, "threads": args.threads, "torch": torch.__version__,
        "loadavg_start": load_start, "loadavg_end": loadavg(),
        "ttft_s": rows, "median_ttft_s": med, "cached_tokens": cached,
        "speedup_local": med["cold"] / med["local"], "speedup_redis": med["cold"] / med["redis"],
        "targets": {"local >= 8x": med["cold"] / med["local"] >= 8, "redis >= 4x": med["cold"] / med["redis"] >= 4},
        "engine_stats": stats,
    }
    md = markdown(res)
    write_results("prefix_cache", res, md, plot, args.out_dir)
    print(md, end="")


if __name__ == "__main__":
    main()
