"""`kvmesh bench serve` (open-loop load on a running server: OpenAI HTTP or gRPC),
`kvmesh bench throughput` and `kvmesh bench latency` (the offline engine in-process),
with vLLM's `bench` flag names where they exist. The library lives in kvmesh.bench."""

from __future__ import annotations

import argparse
import math
import time

from kvmesh.bench import report
from kvmesh.bench.clients import BACKENDS, RequestOptions
from kvmesh.bench.datasets import (
    DATASETS,
    Sample,
    mooncake_samples,
    prefix_samples,
    random_samples,
    sharegpt_samples,
    with_text,
)
from kvmesh.bench.loadgen import ServeConfig, run_serve
from kvmesh.bench.metrics import parse_goodput
from kvmesh.bench.offline import latency_batch, run_latency, run_throughput
from kvmesh.checkpoint.files import load_tokenizer, resolve_model_path
from kvmesh.cli.args import add_engine_args, engine_config
from kvmesh.llm import LLM

DEFAULT_PORTS = {"openai": 8000, "openai-chat": 8000, "grpc": 50051}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a running server (serve) or the offline engine "
                                     "(throughput, latency)")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    _add_serve(bsub)
    _add_throughput(bsub)
    _add_latency(bsub)


def _dataset_args(p: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=names, default="random")
    g.add_argument("--dataset-path", default=None, help="sharegpt: the JSON file; mooncake: the JSONL trace "
                   "(a 200-request sample ships as benchmarks/data/mooncake_conversation_200.jsonl)")
    g.add_argument("--num-prompts", type=int, default=100, help="requests in the run (default 100)")
    g.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the arrival times")
    g.add_argument("--random-input-len", "--input-len", type=int, default=256, help="random: prompt tokens")
    g.add_argument("--random-output-len", "--output-len", type=int, default=64, help="random: output tokens")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len * (1 - r), len * (1 + r)] (default 0: fixed)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: output tokens of every request (default: the answer's length)")
    if "prefix" in names:
        g.add_argument("--prefix-num-prefixes", type=int, default=4, help="prefix: shared prefixes")
        g.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens per shared prefix")
        g.add_argument("--prefix-suffix-len", type=int, default=32, help="prefix: per-request suffix tokens")
        g.add_argument("--prefix-output-len", type=int, default=64, help="prefix: output tokens")
    if "mooncake" in names:
        g.add_argument("--trace-block-size", type=int, default=512,
                       help="mooncake: tokens per trace block (512 = the trace's own lengths; 16 scales "
                            "lengths by 16/512 for a small model)")
        g.add_argument("--trace-time-scale", type=float, default=1.0, help="mooncake: speed-up of the "
                       "timestamps (2 = twice the trace's rate)")
        g.add_argument("--trace-start-s", type=float, default=0.0, help="mooncake: start of the slice, seconds")
        g.add_argument("--trace-max-input-len", type=int, default=None,
                       help="mooncake: skip requests whose scaled prompt is longer")
        g.add_argument("--trace-max-output-len", type=int, default=None, help="mooncake: cap the output length")


def _add_serve(bsub) -> None:
    s = bsub.add_parser("serve", help="open-loop load on a running server: latency percentiles, throughput, "
                                      "goodput")
    s.add_argument("--backend", choices=sorted(BACKENDS), default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions; grpc: kvmesh LLM.Generate")
    s.add_argument("--base-url", default=None, help="http://host:port of the server (openai*), or host:port "
                   "(grpc); default: --host and --port")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=None, help="default: 8000 (openai*), 50051 (grpc)")
    s.add_argument("--model", default=None, help="served model name (default: the server's first)")
    s.add_argument("--tokenizer", default=None,
                   help="checkpoint folder (or packaged model name) whose tokenizer builds the prompts "
                        "(default: the embedded model's)")
    _dataset_args(s, DATASETS)
    g = s.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    g.add_argument("--burst", "--burstiness", dest="burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 more even (vLLM's --burstiness)")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    g.add_argument("--ignore-timestamps", action="store_true",
                   help="mooncake: send at --request-rate instead of the trace's timestamps")
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent (unrecorded) before the run")
    g.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the requested output lengths (default: on)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    o = s.add_argument_group("report")
    o.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=None,
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (names ttft, tpot, e2el; milliseconds)")
    o.add_argument("--result-dir", default=None, help="write NAME.json, NAME.md, NAME.png here")
    o.add_argument("--result-filename", default=None, help="NAME (default: bench-serve-BACKEND-TIME)")
    o.add_argument("--disable-tqdm", action="store_true")
    s.set_defaults(func=cmd_serve)


def serve_target(args: argparse.Namespace) -> str:
    """The base URL (openai*) or host:port (grpc) the flags name."""
    if args.base_url:
        url = args.base_url.rstrip("/")
        if args.backend == "grpc":
            return url.split("://", 1)[-1]
        return url if "://" in url else f"http://{url}"
    port = args.port or DEFAULT_PORTS[args.backend]
    return f"{args.host}:{port}" if args.backend == "grpc" else f"http://{args.host}:{port}"


def load_samples(args: argparse.Namespace, tokenizer) -> list[Sample]:
    """The workload the dataset flags describe."""
    n, name = args.num_prompts, args.dataset_name
    if n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}")
    if name in ("sharegpt", "mooncake") and not args.dataset_path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    if name == "random":
        return random_samples(tokenizer, n, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.seed)
    if name == "prefix":
        return prefix_samples(tokenizer, n, args.prefix_num_prefixes, args.prefix_len, args.prefix_suffix_len,
                              args.prefix_output_len, args.seed)
    if name == "sharegpt":
        return sharegpt_samples(args.dataset_path, tokenizer, n, args.seed, args.sharegpt_output_len)
    return mooncake_samples(args.dataset_path, len(tokenizer), n, args.trace_block_size, args.trace_time_scale,
                            args.trace_start_s, args.trace_max_input_len, args.trace_max_output_len)


def cmd_serve(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(resolve_model_path(args.tokenizer, progress=False))
    samples = load_samples(args, tokenizer)
    if args.backend == "openai-chat":
        with_text(samples, tokenizer)
    cfg = ServeConfig(backend=args.backend, target=serve_target(args), model=args.model,
                      request_rate=args.request_rate, burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency, seed=args.seed,
                      use_trace_timestamps=not args.ignore_timestamps, num_warmups=args.num_warmups,
                      options=RequestOptions(args.temperature, args.ignore_eos, args.timeout),
                      slos=parse_goodput(args.goodput), progress=not args.disable_tqdm)
    result = run_serve(cfg, samples)
    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "backend": args.backend, "target": cfg.target,
            "dataset": args.dataset_name, "request_rate": args.request_rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "num_prompts": args.num_prompts, "seed": args.seed,
            **result.to_dict()}
    md = report.serve_markdown(data)
    print(md)
    _write(args, data, md, report.serve_plot, f"bench-serve-{args.backend}")
    return 0 if result.summary["completed"] else 1


def _write(args: argparse.Namespace, data: dict, md: str, plot, stem: str) -> None:
    if args.result_dir:
        name = args.result_filename or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        paths = report.write_results(args.result_dir, name, data, md, plot)
        print("wrote " + ", ".join(str(p) for p in paths))


def _add_offline_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--result-dir", default=None, help="write NAME.json and NAME.md here")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)


def _add_throughput(bsub) -> None:
    t = bsub.add_parser("throughput", help="offline throughput of the engine in this process (LLM.generate)")
    _dataset_args(t, ("random", "sharegpt"))
    _add_offline_common(t)
    t.set_defaults(func=cmd_throughput)


def cmd_throughput(args: argparse.Namespace) -> int:
    llm = LLM(config=engine_config(args), progress=not args.disable_tqdm)
    samples = load_samples(args, llm.tokenizer)
    res = run_throughput(llm, samples, progress=not args.disable_tqdm)
    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "dataset": args.dataset_name,
            "model": llm.engine.model_info.path, **res}
    md = (f"# kvmesh bench throughput\n\n{res['num_requests']} requests ({args.dataset_name}), "
          f"{res['total_input_tokens']} prompt + {res['total_output_tokens']} output tokens in "
          f"{res['elapsed_s']:.2f} s\n\nThroughput: {res['requests_per_s']:.2f} requests/s, "
          f"{res['total_tokens_per_s']:.2f} total tokens/s, {res['output_tokens_per_s']:.2f} output tokens/s\n")
    print(md)
    _write(args, data, md, None, "bench-throughput")
    return 0


def _add_latency(bsub) -> None:
    lp = bsub.add_parser("latency", help="end-to-end latency of one batch on the engine in this process")
    lp.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    lp.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    lp.add_argument("--batch-size", type=int, default=1)
    lp.add_argument("--num-iters-warmup", type=int, default=2)
    lp.add_argument("--num-iters", type=int, default=10)
    lp.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    _add_offline_common(lp)
    lp.set_defaults(func=cmd_latency)


def cmd_latency(args: argparse.Namespace) -> int:
    llm = LLM(config=engine_config(args), progress=not args.disable_tqdm)
    prompts = latency_batch(len(llm.tokenizer), args.batch_size, args.input_len, args.seed)
    res = run_latency(llm, prompts, args.output_len, args.num_iters, args.num_iters_warmup,
                      progress=not args.disable_tqdm)
    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": llm.engine.model_info.path, **res}
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in res["percentiles_s"].items())
    md = (f"# kvmesh bench latency\n\nbatch {res['batch_size']}, {res['input_len']} prompt + "
          f"{res['output_len']} output tokens per request, {res['num_iters']} timed iterations\n\n"
          f"Avg latency: {res['avg_latency_s']:.4f} s\n\n| percentile | seconds |\n|---|---:|\n{rows}\n")
    print(md)
    _write(args, data, md, None, "bench-latency")
    return 0

