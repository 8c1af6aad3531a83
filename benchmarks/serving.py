"""gRPC serving benchmark: prefix-aware routing vs round robin, and the router's own latency.

Setup (all on loopback): two unified workers (separate processes, same model) behind a
router process. For each routing policy a fresh router is started over the same
workers; each policy gets its own tenants' system prompts, so no policy inherits
another's cached prefixes.

* **Workload**: `--num-requests` requests with Poisson arrivals at `--rate` per second
  (exponential gaps, seed 0), bounded by `--max-duration`. Each request belongs to one
  of 4 tenants (uniform): that tenant's system prompt (`--system-tokens` random token
  ids) + a fresh question (`--question-tokens`), greedy, EOS ignored, `--output-tokens`
  out.
* **Metrics per request**: TTFT (send -> first token), ITL (gaps between streamed
  messages), TPOT ((e2e - TTFT) / (tokens - 1)), e2e. Reported p50 / p90 / p99,
  output-token throughput, and goodput = requests per second meeting the SLO
  (`--slo-ttft-ms` and `--slo-tpot-ms`).
* **Router added latency**: `--overhead-requests` sequential 1-token requests on one
  cached prompt, through the router vs straight to a worker's Worker.Generate; the
  difference of the medians.

Run on idle cores (see benchmarks/README.md):

    python benchmarks/serving.py                # embedded SmolLM2-135M, full run
    python benchmarks/serving.py --smoke        # tiny random model, a few requests

Results: benchmarks/results/serving.{json,md,png} (serving_smoke.* with --smoke).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvmesh._proto import llm_pb2, llm_pb2_grpc, worker_pb2_grpc
from kvmesh.bench import arrival_times, percentile
from kvmesh.serve.local import Child, spawn, stop, wait_ready

from _common import check_idle, loadavg, md_table, write_results

ROOT = Path(__file__).resolve().parents[1]
TENANTS = 4


@dataclass
class Result:
    tenant: int
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    worker: str = ""
    cached_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else 0.0


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile in milliseconds (NaN for none)."""
    return percentile(xs, q) * 1e3


async def one_request(stub, ids: list[int], out_tokens: int, tenant: int, timeout: float) -> Result:
    t0 = time.perf_counter()
    res = Result(tenant, ok=False)
    last = None
    try:
        call = stub.Generate(llm_pb2.GenerateRequest(prompt_token_ids=ids, params=llm_pb2.SamplingParams(
            max_tokens=out_tokens, temperature=0, ignore_eos=True)), timeout=timeout)
        async for msg in call:
            now = time.perf_counter()
            if res.tokens == 0:
                res.ttft = now - t0
            else:
                res.itl.append(now - last)
            last = now
            res.tokens += len(msg.token_ids)
            if msg.finish_reason:
                res.cached_tokens = msg.usage.cached_prompt_tokens
        res.e2e = time.perf_counter() - t0
        res.worker = dict(await call.trailing_metadata()).get("kvmesh-decode", "")
        res.ok = res.tokens == out_tokens
    except grpc.aio.AioRpcError as exc:
        res.error = f"{exc.code().name}: {exc.details()}"
    return res


async def run_load(address: str, prompts: list[tuple[int, list[int]]], args) -> tuple[list[Result], float]:
    """Poisson arrivals (kvmesh.bench's schedule, seed 0); returns the results and the wall time."""
    arrivals = arrival_times(len(prompts), args.rate, seed=0)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = llm_pb2_grpc.LLMStub(ch)
        tasks = []
        t0 = time.perf_counter()
        for (tenant, ids), at in zip(prompts, arrivals):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            if time.perf_counter() - t0 > args.max_duration:
                break
            tasks.append(asyncio.create_task(one_request(stub, ids, args.output_tokens, tenant, args.max_duration)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def summarize(results: list[Result], wall: float, args) -> dict:
    ok = [r for r in results if r.ok]
    ttft, e2e, tpot = [r.ttft for r in ok], [r.e2e for r in ok], [r.tpot for r in ok]
    itl = [x for r in ok for x in r.itl]
    good = [r for r in ok if r.ttft * 1e3 <= args.slo_ttft_ms and r.tpot * 1e3 <= args.slo_tpot_ms]
    by_tenant: dict[int, dict[str, int]] = {}
    for r in ok:
        by_tenant.setdefault(r.tenant, {}).setdefault(r.worker, 0)
        by_tenant[r.tenant][r.worker] += 1
    return {
        "requests": len(results), "completed": len(ok), "errors": sorted({r.error for r in results if r.error}),
        "wall_s": wall, "output_tok_per_s": sum(r.tokens for r in ok) / wall if wall else 0.0,
        "goodput_req_per_s": len(good) / wall if wall else 0.0, "slo_attainment": len(good) / max(len(results), 1),
        **{f"{name}_ms": {f"p{q}": pct(xs, q) for q in (50, 90, 99)}
           for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e))},
        "cached_prompt_tokens_mean": statistics.mean([r.cached_tokens for r in ok]) if ok else 0.0,
        "tenant_to_workers": {str(t): w for t, w in sorted(by_tenant.items())},
    }


async def router_overhead(router: str, worker: str, ids: list[int], n: int) -> dict:
    req = llm_pb2.GenerateRequest(prompt_token_ids=ids, params=llm_pb2.SamplingParams(max_tokens=1, temperature=0))

    async def timed(stub) -> list[float]:
        out = []
        for _ in range(n + 2):
            t0 = time.perf_counter()
            async for _ in stub.Generate(req, timeout=60):
                pass
            out.append(time.perf_counter() - t0)
        return out[2:]  # the first ones fill caches and channels

    async with grpc.aio.insecure_channel(router) as rc, grpc.aio.insecure_channel(worker) as wc:
        via_router = await timed(llm_pb2_grpc.LLMStub(rc))
        direct = await timed(worker_pb2_grpc.WorkerStub(wc))
    return {"router_p50_ms": pct(via_router, 50), "direct_p50_ms": pct(direct, 50),
            "added_p50_ms": pct(via_router, 50) - pct(direct, 50), "requests": n}


def make_prompts(seed: int, vocab: int, args) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(args.system_tokens)] for _ in range(TENANTS)]
    out = []
    for _ in range(args.num_requests):
        t = rng.randrange(TENANTS)
        out.append((t, systems[t] + [rng.randrange(3, vocab) for _ in range(args.question_tokens)]))
    return out


def tiny_model() -> Path:
    """The tests' tiny random Llama (tests/tiny_models.py), built into a temp folder."""
    spec = importlib.util.spec_from_file_location("kvmesh_tests_tiny_models", ROOT / "tests" / "tiny_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_tiny_model(Path(tempfile.mkdtemp(prefix="kvmesh-bench-tiny-")))


def markdown(report: dict) -> str:
    lines = [f"# Serving benchmark ({report['date']})", "",
             (f"model: {report['config']['model']}, load at start {report['loadavg_start']}, "
              f"end {report['loadavg_end']}"), ""]
    lines += md_table(["policy", "done", "TTFT p50/p90/p99 ms", "TPOT p50 ms", "ITL p50 ms", "e2e p50/p99 ms", "tok/s",
                       "goodput req/s"],
                      ([name, f"{s['completed']}/{s['requests']}",
                        f"{s['ttft_ms']['p50']:.1f} / {s['ttft_ms']['p90']:.1f} / {s['ttft_ms']['p99']:.1f}",
                        f"{s['tpot_ms']['p50']:.1f}", f"{s['itl_ms']['p50']:.1f}",
                        f"{s['e2e_ms']['p50']:.1f} / {s['e2e_ms']['p99']:.1f}", f"{s['output_tok_per_s']:.1f}",
                        f"{s['goodput_req_per_s']:.2f}"] for name, s in report["policies"].items()))
    v = report["verdicts"]
    o = report["router_overhead"]
    lines += ["", (f"- median TTFT, round robin / prefix-aware: {v['ttft_ratio']:.2f}x (target >= 2x: "
                   f"{'met' if v['ttft_target_met'] else 'MISSED'})"),
              (f"- router added latency p50: {o['added_p50_ms']:.2f} ms (router {o['router_p50_ms']:.2f} ms, direct "
               f"{o['direct_p50_ms']:.2f} ms; target < 2 ms: {'met' if v['overhead_target_met'] else 'MISSED'})")]
    if not report["idle_at_start"]:
        lines.append("- WARNING: the machine was busy at the start; do not quote these numbers")
    return "\n".join(lines) + "\n"


def plot(plt, report: dict):
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(report["policies"])
    qs = ("p50", "p90", "p99")
    for i, q in enumerate(qs):
        ax.bar([j + i * 0.27 for j in range(len(names))], [report["policies"][n]["ttft_ms"][q] for n in names],
               0.27, label=f"TTFT {q}")
    ax.set_xticks([j + 0.27 for j in range(len(names))], names)
    ax.set_ylabel("ms")
    ax.set_title(f"TTFT by routing policy (round robin / prefix = {report['verdicts']['ttft_ratio']:.2f}x at p50)")
    ax.legend()
    fig.tight_layout()
    return fig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: embedded; --smoke: tiny random)")
    p.add_argument("--smoke", action="store_true", help="tiny model, few requests: checks the pipeline only")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--max-duration", type=float, default=600.0, help="stop sending after this many seconds")
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--overhead-requests", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.num_requests, args.rate, args.max_duration = 12, 4.0, 60.0
        args.system_tokens, args.question_tokens, args.output_tokens = 64, 8, 8
        args.overhead_requests = 10
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    load_start = loadavg()
    idle = check_idle(args.threads, load_start[0])
    model = args.model or (str(tiny_model()) if args.smoke else None)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    model_args = ["--model", model] if model else []
    from kvmesh.models.loader import load_arch_config, resolve_model_path

    vocab = load_arch_config(resolve_model_path(model)).vocab_size
    workers: list[Child] = []
    report: dict = {"date": dt.datetime.now().isoformat(timespec="seconds"), "loadavg_start": load_start,
                    "idle_at_start": idle, "config": {**vars(args), "model": model or "embedded SmolLM2-135M"},
                    "policies": {}}
    try:
        workers = [spawn(f"worker{i}", ["-m", "kvmesh.cli", "worker", "--role", "unified", "--port", "0",
                                        "--threads", str(args.threads), *model_args]) for i in range(2)]
        for w in workers:
            wait_ready(w, 600)
        for seed, policy in enumerate(("max_score", "round_robin")):
            worker_args = [a for w in workers for a in ("--worker", w.address)]
            router = wait_ready(spawn(f"router-{policy}", ["-m", "kvmesh.cli", "router", "--port", "0", "--picker", policy,
                                                           *model_args, *worker_args]), 600)
            try:
                report[f"loadavg_before_{policy}"] = loadavg()
                results, wall = asyncio.run(run_load(router.address, make_prompts(seed, vocab, args), args))
                name = "prefix-aware" if policy == "max_score" else "round-robin"
                report["policies"][name] = summarize(results, wall, args)
                if policy == "max_score":
                    ids = make_prompts(99, vocab, args)[0][1]
                    report["router_overhead"] = asyncio.run(
                        router_overhead(router.address, workers[0].address, ids, args.overhead_requests))
            finally:
                stop(router)
    finally:
        for w in workers:
            stop(w)
    report["loadavg_end"] = loadavg()
    pa, rr = report["policies"]["prefix-aware"], report["policies"]["round-robin"]
    ratio = rr["ttft_ms"]["p50"] / pa["ttft_ms"]["p50"] if pa["ttft_ms"]["p50"] else float("nan")
    report["verdicts"] = {"ttft_ratio": ratio, "ttft_target_met": ratio >= 2.0,
                          "overhead_target_met": report["router_overhead"]["added_p50_ms"] < 2.0}
    md = markdown(report)
    write_results("serving_smoke" if args.smoke else "serving", report, md, plot, args.out_dir)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
