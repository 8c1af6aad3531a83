"""Soak: a bounded loopback run (router + two unified workers as OS processes) under a
steady mixed load, sampling every process's RSS and each worker's free KV blocks.

The load is what a hostile-but-fair user sends (issue 19): normal streams, streams the
client cancels after a few tokens, requests with `top_k` far above the vocabulary mixed
with small-`top_k` ones, invalid requests (NaN temperature, bad token ids, prompts over
max_model_len), all concurrently. What must hold, and is checked at the end: no worker
died, no request other than the invalid ones failed, memory is flat (last-quarter median
RSS within `--rss-slack` of the second-quarter median, after warm-up) and, once idle,
every worker is back to its full free-block count.

    python benchmarks/soak.py --duration 120            # embedded SmolLM2
    python benchmarks/soak.py --smoke --out-dir /tmp     # tiny random model, 20 s
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
from pathlib import Path

import grpc
import psutil

from kvmesh._proto import llm_pb2, llm_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.serve.local import Child, spawn, stop, wait_ready

from _common import check_idle, loadavg, md_table, write_results

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("normal", "cancelled", "poison_pair", "invalid")


def tiny_model() -> Path:
    """The tests' tiny random Llama (tests/tiny_models.py), built into a temp folder."""
    spec = importlib.util.spec_from_file_location("kvmesh_tests_tiny_models", ROOT / "tests" / "tiny_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_tiny_model(Path(tempfile.mkdtemp(prefix="kvmesh-soak-tiny-")))


def _request(kind: str, rng: random.Random, vocab: int, args) -> llm_pb2.GenerateRequest:
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, args.prompt_tokens))]
    params = llm_pb2.SamplingParams(max_tokens=args.output_tokens, temperature=0.8, ignore_eos=True)
    if kind == "poison_pair":
        params.top_k = rng.choice([10**9, 2])
    if kind == "invalid":
        choice = rng.randrange(3)
        if choice == 0:
            params.temperature = float("nan")
        elif choice == 1:
            prompt = [-5] * 20
        else:
            prompt = [3] * 100_000
    return llm_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)


async def _client(stub, kind_of, rng, vocab, args, deadline, counts, errors) -> None:
    while time.monotonic() < deadline:
        kind = kind_of(rng)
        call = stub.Generate(_request(kind, rng, vocab, args), timeout=120)
        try:
            n = 0
            async for msg in call:
                n += len(msg.token_ids)
                if kind == "cancelled" and n >= 3:
                    call.cancel()
                    break
            counts[kind]["ok"] += 1
        except grpc.aio.AioRpcError as exc:
            if kind == "invalid" and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                counts[kind]["ok"] += 1  # refused as it must be
            elif kind == "cancelled" and exc.code() == grpc.StatusCode.CANCELLED:
                counts[kind]["ok"] += 1
            else:
                counts[kind]["failed"] += 1
                errors.append(f"{kind}: {exc.code().name}: {exc.details()}")


async def _stats(address: str) -> worker_pb2.StatsResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)


async def _sampler(procs: list[Child], workers: list[Child], t0: float, deadline: float, period: float,
                   samples: list[dict]) -> None:
    handles = {c.name: psutil.Process(c.popen.pid) for c in procs}
    while time.monotonic() < deadline:
        row = {"t_s": round(time.monotonic() - t0, 2)}
        for name, h in handles.items():
            row[f"rss_mb.{name}"] = round(h.memory_info().rss / 2**20, 1) if h.is_running() else None
        for w in workers:
            try:
                row[f"free_blocks.{w.name}"] = (await _stats(w.address)).num_free_blocks
            except grpc.aio.AioRpcError:
                row[f"free_blocks.{w.name}"] = None
        samples.append(row)
        await asyncio.sleep(period)


async def run_soak(router: Child, procs: list[Child], workers: list[Child], vocab: int, args) -> dict:
    rng = random.Random(args.seed)
    weights = [0.55, 0.2, 0.15, 0.1]
    counts = {k: {"ok": 0, "failed": 0} for k in KINDS}
    errors: list[str] = []
    samples: list[dict] = []
    t0 = time.monotonic()
    deadline = t0 + args.duration
    async with grpc.aio.insecure_channel(router.address) as ch:
        stub = llm_pb2_grpc.LLMStub(ch)
        tasks = [_client(stub, lambda r: r.choices(KINDS, weights)[0], random.Random(rng.random()), vocab, args,
                         deadline, counts, errors) for _ in range(args.concurrency)]
        await asyncio.gather(_sampler(procs, workers, t0, deadline, args.sample_s, samples), *tasks)
    await asyncio.sleep(2.0)  # let aborts land
    idle = [await _stats(w.address) for w in workers]
    return {"counts": counts, "errors": errors[:20], "samples": samples,
            "idle": {w.name: {"free": s.num_free_blocks, "usable": s.num_usable_blocks, "running": s.num_running}
                     for w, s in zip(workers, idle)}}


def verdicts(report: dict, procs: list[Child], args) -> dict:
    samples = report["samples"]
    n = len(samples)
    flat = {}
    for key in [k for k in samples[0] if k.startswith("rss_mb.")] if samples else []:
        q2 = [s[key] for s in samples[n // 4 : n // 2] if s[key] is not None]
        q4 = [s[key] for s in samples[3 * n // 4 :] if s[key] is not None]
        if q2 and q4:
            growth = statistics.median(q4) / statistics.median(q2) - 1
            flat[key[len("rss_mb."):]] = {"growth": round(growth, 4), "flat": growth <= args.rss_slack}
    counts = report["counts"]
    return {
        "all_alive": all(c.popen.poll() is None for c in procs),
        "failed_valid_requests": sum(counts[k]["failed"] for k in KINDS if k != "invalid"),
        "invalid_not_refused": counts["invalid"]["failed"],
        "blocks_returned": all(v["free"] == v["usable"] and v["running"] == 0 for v in report["idle"].values()),
        "rss": flat,
    }


def markdown(report: dict) -> str:
    v = report["verdicts"]
    lines = [f"# Soak ({report['config']['duration']:.0f} s, {report['config']['concurrency']} clients, "
             f"{report['config']['model']})", "", f"Date {report['date']}; load at start {report['loadavg_start']}.",
             ""]
    lines += md_table(["kind", "ok", "failed"], [(k, c["ok"], c["failed"]) for k, c in report["counts"].items()],
                      "lrr")
    lines += ["", *md_table(["process", "RSS growth (last quarter vs second)", "flat"],
                            [(p, f"{r['growth']:+.1%}", r["flat"]) for p, r in v["rss"].items()], "lrl")]
    lines += ["", f"- every process alive at the end: **{v['all_alive']}**",
              f"- failed valid requests: **{v['failed_valid_requests']}**; invalid ones not refused: "
              f"**{v['invalid_not_refused']}**",
              f"- every KV block back once idle: **{v['blocks_returned']}** ({report['idle']})"]
    if report["errors"]:
        lines += ["", "First errors:", *[f"- `{e}`" for e in report["errors"]]]
    return "\n".join(lines) + "\n"


def plot(plt, report: dict):
    samples = report["samples"]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t = [s["t_s"] for s in samples]
    for key in [k for k in samples[0] if k != "t_s"] if samples else []:
        ax = a if key.startswith("rss_mb.") else b
        ax.plot(t, [s[key] for s in samples], label=key.split(".", 1)[1])
    a.set_ylabel("RSS, MiB")
    b.set_ylabel("free KV blocks")
    b.set_xlabel("seconds")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    a.set_title("kvmesh soak: memory and free KV blocks under mixed load")
    fig.tight_layout()
    return fig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: embedded; --smoke: tiny random)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 20 s: checks the pipeline only")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (bounded soak)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=1.0, help="seconds between RSS / free-block samples")
    p.add_argument("--rss-slack", type=float, default=0.05, help="allowed RSS growth, fraction")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.smoke and args.duration == 120.0:
        args.duration = 20.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    load_start = loadavg()
    idle = check_idle(2 * args.threads, load_start[0])
    model = args.model or (str(tiny_model()) if args.smoke else None)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from kvmesh.checkpoint.files import resolve_model_path
    from kvmesh.models.loader import load_arch_config

    vocab = load_arch_config(resolve_model_path(model)).vocab_size
    model_args = ["--model", model] if model else []
    engine_args = ["--threads", str(args.threads), "--max-model-len", "512"]
    workers: list[Child] = []
    router = None
    report: dict = {"date": dt.datetime.now().isoformat(timespec="seconds"), "loadavg_start": load_start,
                    "idle_at_start": idle, "config": {**vars(args), "model": model or "embedded SmolLM2-135M"}}
    try:
        workers = [spawn(f"worker{i}", ["-m", "kvmesh.cli", "worker", "--role", "unified", "--port", "0",
                                        *engine_args, *model_args]) for i in range(2)]
        for w in workers:
            wait_ready(w, 600)
        worker_args = [a for w in workers for a in ("--worker", w.address)]
        router = wait_ready(spawn("router", ["-m", "kvmesh.cli", "router", "--port", "0", *model_args,
                                             *worker_args], is_worker=False), 600)
        procs = [*workers, router]
        report.update(asyncio.run(run_soak(router, procs, workers, vocab, args)))
        report["verdicts"] = verdicts(report, procs, args)
    finally:
        for c in [router, *workers]:
            if c is not None:
                stop(c)
    report["loadavg_end"] = loadavg()
    md = markdown(report)
    write_results("soak_smoke" if args.smoke else "soak", report, md, plot, args.out_dir)
    print(md)
    v = report["verdicts"]
    ok = v["all_alive"] and not v["failed_valid_requests"] and not v["invalid_not_refused"] and v["blocks_returned"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
