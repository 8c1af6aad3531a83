"""Served performance against the peer: `kvmesh serve` (Ray), `kvmesh serve --local`,
`vllm serve` (vLLM's CPU build) and the offline kvmesh engine, on the same requests.

Each server is started in turn on the same weights (float32; the embedded
SmolLM2-135M converted folder), waited for, driven by an open-loop OpenAI streaming
client (benchmarks/_loadgen.py; same token-id prompts for every server, output counts
from the servers' usage records) on three workloads, then stopped before the next one
starts, so servers never share the cores:

- random:  prompts 128-384 tokens, outputs 64-192, Poisson arrivals at --rate;
- prefix:  4 shared 512-token prefixes + 64-token suffixes, 64 outputs, Poisson --rate;
- burst:   --burst-requests random requests sent at once.

The Poisson rate is a load, not a constant: machines of this pool differ 4x in speed (an
AVX2 Zen 1 core does a quarter of an AMX Xeon's fp32 FLOPs), so a fixed 2 req/s that keeps
an Intel Xeon near saturation overloads a Zen 1 by 4x, and TTFT then measures how long the
backlog is, not how fast a server answers. `--rate auto` (the default) runs the offline
engine first and gives each Poisson workload `--load` (0.6) times the request rate the
offline engine sustains on that workload's requests on this machine; `--rate R` fixes it.
Served capacity is ~0.8-0.9x offline, so 0.6 is a busy server with a short queue; at 0.8
the queue's swings dominate (TTFT p50 of one server ranged 2.2-3.5 s over three runs).

Reported per server and workload: output tok/s, TTFT / TPOT / ITL / E2E p50 and p99,
goodput (requests/s meeting the TTFT and TPOT SLOs) and SLO attainment; the offline
engine's throughput on each workload's requests (all at once) is the ceiling the
served numbers are read against. JSON + markdown + PNG (latency CDFs and throughput
bars) into benchmarks/results/serving_peers.*; the load average is printed and stored
beside every run. vLLM is skipped (with a note) when its venv is missing; install it
with ../shared/peers/install_vllm_cpu.sh /tmp/vllm-cpu.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

from _common import RESULTS_DIR, check_idle, load_snapshot, md_table, wait_for_idle, write_results
from _loadgen import Request, run_load, summarize

SERVERS = ("kvmesh-ray", "kvmesh-local", "vllm")
WORKLOADS = ("random", "prefix", "burst")


# -- workloads --------------------------------------------------------------------------


def make_workload(name: str, args, vocab: int, seed: int = 0) -> tuple[list[Request], float]:
    """(requests, arrival rate) of one workload; token ids avoid the first 100 (specials)."""
    rng = random.Random(f"{name}-{seed}")

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    rate = None if args.rate == "auto" else float(args.rate)  # auto: set from the offline engine
    if name == "random":
        reqs = [Request(toks(rng.randint(128, 384)), rng.randint(64, 192)) for _ in range(args.num_requests)]
        return reqs, rate
    if name == "prefix":
        prefixes = [toks(args.prefix_tokens) for _ in range(4)]
        reqs = [Request(prefixes[i % 4] + toks(64), 64) for i in range(args.num_requests)]
        rng.shuffle(reqs)
        return reqs, rate
    if name == "burst":
        return [Request(toks(rng.randint(128, 384)), rng.randint(64, 192))
                for _ in range(args.burst_requests)], float("inf")
    raise ValueError(name)


# -- servers ----------------------------------------------------------------------------


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/models", timeout=2) as r:
                if r.status == 200 and json.loads(r.read()).get("data"):
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s")


def start_server(name: str, model_dir: Path, port: int, grpc_port: int, log: Path, args) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if name == "kvmesh-ray":
        cmd = [sys.executable, "-m", "kvmesh.cli", "serve", "--model", str(model_dir), "--http-port", str(port),
               "--port", str(grpc_port), *shlex.split(args.kvmesh_args)]
    elif name == "kvmesh-local":
        cmd = [sys.executable, "-m", "kvmesh.cli", "serve", "--local", "--prefill-replicas", "0", "--model",
               str(model_dir), "--http-port", str(port), "--port", str(grpc_port), *shlex.split(args.kvmesh_args)]
    elif name == "vllm":
        env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="4")
        cmd = [str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", str(model_dir), "--served-model-name", "kvmesh",
               "--dtype", "float32", "--port", str(port), "--max-model-len", "2048"]
    else:
        raise ValueError(name)
    fh = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _wait_http(f"http://127.0.0.1:{port}/v1", proc, args.start_timeout)
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    if "ray" in " ".join(proc.args):  # a Ray instance can outlive an interrupted driver
        subprocess.run(["ray", "stop", "--force"], capture_output=True)


# -- runs -------------------------------------------------------------------------------


def run_served(name: str, model_dir: Path, workloads: dict, args) -> dict:
    port, grpc_port = 8400, 50400
    log = Path(args.log_dir) / f"{name}.log"
    print(f"== {name}: starting (log {log})", flush=True)
    t0 = time.perf_counter()
    proc = start_server(name, model_dir, port, grpc_port, log, args)
    out = {"start_s": time.perf_counter() - t0}
    try:
        url = f"http://127.0.0.1:{port}/v1"
        warm = [Request(list(range(200, 264)), 8) for _ in range(4)]
        asyncio.run(run_load(url, "kvmesh", warm, float("inf")))
        for wl, (reqs, rate) in workloads.items():
            load = load_snapshot()
            with tqdm(total=len(reqs), desc=f"{name}/{wl}") as bar:
                results, wall = asyncio.run(run_load(url, "kvmesh", reqs, rate, seed=1, progress=bar))
            out[wl] = {**summarize(results, wall, args.slo_ttft, args.slo_tpot), "load_before": load,
                       "load_after": load_snapshot()}
            s = out[wl]
            print(f"   {wl}: {s['output_tok_s']:.1f} out tok/s, TTFT p50 {s['ttft_p50_s']:.2f}s, "
                  f"TPOT p50 {1000 * s['tpot_p50_s']:.0f}ms, failed {s['failed']}, "
                  f"load {load['1min']:.2f}", flush=True)
    finally:
        stop_server(proc)
    return out


def run_offline(model_dir: Path, workloads: dict) -> dict:
    """The offline engine on each workload's requests, all at once: the served ceiling."""
    from kvmesh import LLM, SamplingParams

    llm = LLM(str(model_dir), progress=False)
    llm.generate([list(range(200, 264))] * 4, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    out = {}
    for wl, (reqs, _) in workloads.items():
        load = load_snapshot()
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt_ids for r in reqs], params)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        out[wl] = {"output_tok_s": tokens / wall, "output_tokens": tokens, "wall_s": wall, "req_s": len(reqs) / wall,
                   "load_before": load}
        print(f"== offline/{wl}: {tokens / wall:.1f} out tok/s, {len(reqs) / wall:.2f} req/s "
              f"(load {load['1min']:.2f})", flush=True)
    return out


def calibrate_rates(workloads: dict, offline: dict, load: float) -> dict[str, float]:
    """`--rate auto`: each Poisson workload arrives at `load` x the request rate the offline
    engine sustained on its requests (all at once, so at saturation) on this machine."""
    rates = {}
    for wl, (reqs, rate) in list(workloads.items()):
        if rate is None:
            rates[wl] = round(load * offline[wl]["req_s"], 3)
            workloads[wl] = (reqs, rates[wl])
            print(f"== {wl}: Poisson rate {rates[wl]:.3f} req/s = {load:g} x the offline engine's "
                  f"{offline[wl]['req_s']:.3f} req/s", flush=True)
    return rates


# -- report -----------------------------------------------------------------------------


def render(data: dict) -> str:
    lines = [f"# Served performance vs vLLM ({data['date']})", "",
             f"CPU: {data['cpu']}; model {data['model']}, float32; SLO TTFT <= {data['slo_ttft_s']}s, "
             f"TPOT <= {1000 * data['slo_tpot_s']:.0f}ms; load (1 min) at start {data['load_start']['1min']:.2f}.",
             ""]
    rates = data.get("rates") or {}
    if rates:
        lines += ["Poisson arrival rates, " + (f"{data['args']['load']:g} x the offline engine's request rate on this "
                  "machine (--rate auto): " if data["args"].get("rate") == "auto" else "fixed (--rate): ")
                  + ", ".join(f"{wl} {r:.3f} req/s" for wl, r in rates.items()) + ".", ""]
    for wl in data["workloads"]:
        off = data["results"].get("offline", {}).get(wl, {}).get("output_tok_s")
        rows = []
        for name in [*SERVERS]:
            s = data["results"].get(name, {}).get(wl)
            if not s:
                continue
            ratio = f"{s['output_tok_s'] / off:.2f}" if off else "-"
            rows.append([name, f"{s['output_tok_s']:.1f}", ratio, f"{s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f}",
                         f"{1000 * s['tpot_p50_s']:.0f} / {1000 * s['tpot_p99_s']:.0f}",
                         f"{1000 * s['itl_p50_s']:.0f} / {1000 * s['itl_p99_s']:.0f}",
                         f"{s['e2e_p50_s']:.1f} / {s['e2e_p99_s']:.1f}", f"{s['goodput_req_s']:.2f}",
                         f"{100 * s['slo_attainment']:.0f}%", s["failed"], f"{s['load_before']['1min']:.2f}"])
        if off:
            rows.append(["offline engine", f"{off:.1f}", "1.00", "-", "-", "-", "-", "-", "-", "-",
                         f"{data['results']['offline'][wl]['load_before']['1min']:.2f}"])
        lines += [f"## {wl}", ""]
        lines += md_table(["server", "out tok/s", "/ offline", "TTFT p50/p99 s", "TPOT p50/p99 ms",
                           "ITL p50/p99 ms", "E2E p50/p99 s", "goodput req/s", "SLO met", "failed", "load"],
                          rows, "lrrrrrrrrrr")
        vl = data["results"].get("vllm", {}).get(wl)
        km = data["results"].get("kvmesh-ray", {}).get(wl)
        if vl and km:
            lines += ["", f"kvmesh serve / vllm serve: {km['output_tok_s'] / vl['output_tok_s']:.2f}x output "
                          f"tok/s, TTFT p50 {km['ttft_p50_s']:.2f}s vs {vl['ttft_p50_s']:.2f}s, TPOT p50 "
                          f"{1000 * km['tpot_p50_s']:.0f}ms vs {1000 * vl['tpot_p50_s']:.0f}ms"]
        lines.append("")
    return "\n".join(lines)


def plot(plt, data: dict):
    wls = data["workloads"]
    fig, axes = plt.subplots(2, len(wls), figsize=(5 * len(wls), 8), squeeze=False)
    for j, wl in enumerate(wls):
        ax = axes[0][j]
        for name in SERVERS:
            s = data["results"].get(name, {}).get(wl)
            if s and s["ttft_all_s"]:
                xs = s["ttft_all_s"]
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xscale("log")
        ax.set_title(f"{wl}: TTFT CDF")
        ax.set_xlabel("seconds")
        ax.legend()
        ax = axes[1][j]
        names = [n for n in (*SERVERS, "offline") if data["results"].get(n, {}).get(wl)]
        ax.bar(names, [data["results"][n][wl]["output_tok_s"] for n in names])
        ax.set_title(f"{wl}: output tok/s")
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    return fig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded model's folder)")
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of " + ",".join(SERVERS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--burst-requests", type=int, default=64)
    p.add_argument("--rate", default="auto",
                   help="Poisson arrival rate (random, prefix) in requests/s, or 'auto': --load x the offline "
                        "engine's request rate on each workload on this machine (the default)")
    p.add_argument("--load", type=float, default=0.6, help="with --rate auto: offered load as a fraction of the "
                                                           "offline engine's saturated request rate (0.6)")
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO for goodput, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="TPOT SLO for goodput, seconds")
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--kvmesh-args", default="", help="extra `kvmesh serve` flags for both kvmesh servers (A/B runs)")
    p.add_argument("--vllm-venv", default="/tmp/vllm-cpu")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--wait-idle", type=float, default=0, help="wait up to this many seconds for an idle machine")
    p.add_argument("--log-dir", default="/tmp/kvmesh-serving-peers")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="serving_peers")
    args = p.parse_args()
    if args.rate != "auto":
        try:
            float(args.rate)
        except ValueError:
            p.error(f"--rate must be a number of requests/s or 'auto', got {args.rate!r}")
    if args.rate == "auto" and args.no_offline:
        p.error("--rate auto sets the rates from the offline engine: drop --no-offline or give --rate R")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)

    from kvmesh.checkpoint.files import resolve_model_path
    from kvmesh.models.loader import load_arch_config

    from _common import cpu_model

    model_dir = resolve_model_path(args.model)
    vocab = load_arch_config(model_dir).vocab_size
    if args.wait_idle:
        wait_for_idle(args.wait_idle)
    check_idle(os.cpu_count() or 1)
    wls = [w for w in args.workloads.split(",") if w]
    workloads = {w: make_workload(w, args, vocab) for w in wls}
    data = {"date": time.strftime("%Y-%m-%dT%H:%M"), "cpu": cpu_model(), "model": str(model_dir),
            "load_start": load_snapshot(), "workloads": wls, "slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot,
            "args": vars(args), "results": {}}
    if not args.no_offline:  # first: --rate auto reads it, and it runs on cool cores
        data["results"]["offline"] = run_offline(model_dir, workloads)
        gc.collect()  # the offline engine's weights and KV cache go before the servers start
    calibrate_rates(workloads, data["results"].get("offline", {}), args.load)
    data["rates"] = {wl: r for wl, (_, r) in workloads.items() if r != float("inf")}  # the Poisson ones
    for name in [s for s in args.servers.split(",") if s]:
        if name == "vllm" and not (Path(args.vllm_venv) / "bin" / "vllm").exists():
            print(f"== vllm: skipped, no venv at {args.vllm_venv} (../shared/peers/install_vllm_cpu.sh)")
            continue
        try:
            data["results"][name] = run_served(name, model_dir, workloads, args)
        except (RuntimeError, TimeoutError) as exc:
            print(f"== {name}: failed: {exc}", file=sys.stderr)
            data["results"][name] = {"error": str(exc)}
    data["load_end"] = load_snapshot()
    paths = write_results(args.name, data, render(data), plot, args.out_dir)
    print(render(data))
    print("wrote", ", ".join(str(x) for x in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
