"""The `kvmesh` command line: `kvmesh generate`, `kvmesh serve --local`."""

from __future__ import annotations

import argparse
import logging
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF checkpoint folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-store", default=None,
                   help="shared KV block store: memory | redis://host:port/db (default: local cache only)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="speculative decoding proposer (default: off)")
    p.add_argument("--draft-model", default=None,
                   help="draft checkpoint for --speculative draft, or 'self' (with --draft-quantization: "
                        "a quantized copy of the target)")
    p.add_argument("--draft-quantization", default=None, choices=["int8", "int4"])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf"],
                   help="quantize the weights at load (a checkpoint saved quantized needs no flag); "
                        "gguf: keep the source GGUF's 4/8-bit weights as shipped (embedded model)")
    p.add_argument("--group-size", type=int, default=None, help="int4 group size: 32 (default), 64 or 128")


def _engine_config(args):
    from kvmesh.config import EngineConfig

    return EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads, kv_store=args.kv_store,
        quantization=args.quantization, quantization_group_size=args.group_size,
        speculative=None if args.speculative is None else {
            "method": args.speculative, "model": args.draft_model, "quantization": args.draft_quantization,
            "num_speculative_tokens": args.num_speculative_tokens},
    )


def cmd_generate(args) -> int:
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(_engine_config(args))
    prompt = engine.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    engine.add_request("cli", prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            if out.finished:
                final = out
    sys.stdout.write("\n")
    if final is not None and args.verbose:
        c = final.outputs[0]
        print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
              f"ttft={final.metrics['ttft_s']:.3f}s, total={final.metrics['e2e_s']:.3f}s]", file=sys.stderr)
    return 0


def _changed_engine_flags(args) -> dict:
    """Engine flags given on the command line (differing from their defaults), as flat
    EngineConfig keyword arguments: they override the serving config's engine."""
    defaults = build_parser().parse_args(["serve"])
    full = _engine_config(args).model_dump()
    base = _engine_config(defaults).model_dump()
    out = {}
    for section in ("model", "cache", "scheduler"):
        out.update({k: v for k, v in full[section].items() if base[section][k] != v})
    out.update({k: v for k, v in full.items() if k not in ("model", "cache", "scheduler") and base[k] != v})
    return out


def serving_config_from_args(args):
    """`kvmesh serve` flags (+ --config FILE) -> ServingConfig."""
    from kvmesh.serve.config import ServingConfig

    cfg = ServingConfig.from_yaml(args.config) if args.config else ServingConfig()
    data = cfg.model_dump()
    overrides = _changed_engine_flags(args)
    if overrides:
        data["engine"] = cfg.engine.with_overrides(**overrides).model_dump()
    if args.host is not None:
        data["host"] = args.host
    if args.port is not None:
        data["grpc_port"] = args.port
    if args.http_port is not None:
        data["http_port"] = args.http_port
    if args.redis_url:
        data["kv_store"]["redis_url"] = args.redis_url
    if args.prefill_replicas is not None:
        data["prefill"] = None if args.prefill_replicas == 0 else {**(data["prefill"] or {}),
                                                                   "replicas": args.prefill_replicas}
    if args.decode_replicas is not None:
        data["decode"] = {**data["decode"], "replicas": args.decode_replicas, "autoscaling": None}
    if args.pd_threshold_tokens is not None:
        data["router"]["config"]["pd_threshold_tokens"] = args.pd_threshold_tokens
    if args.otlp_endpoint:
        data["tracing"]["otlp_endpoint"] = args.otlp_endpoint
    return ServingConfig.model_validate(data)


def cmd_serve(args) -> int:
    if args.local:
        return _serve_local(args)
    import signal

    from kvmesh.serve import app as ray_app

    cfg = serving_config_from_args(args)
    started = ray_app.start_ray(args.address, cfg)
    mode = "disaggregated (prefill + decode)" if cfg.disaggregated else "unified"
    print(f"kvmesh: deploying {cfg.name!r} ({mode}) on Ray; first start loads the model...", flush=True)
    try:
        ray_app.deploy(cfg)
    except BaseException:
        if started:
            ray_app.shutdown(cfg, stop_ray=True)
        raise
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "") else cfg.host
    print(f"kvmesh: gRPC (kvmesh.v1.LLM) at {host}:{cfg.grpc_port}", flush=True)
    print(f"kvmesh: OpenAI-compatible HTTP at http://{host}:{cfg.http_port}/v1", flush=True)
    print(f"KVMESH_SERVE_READY grpc={host}:{cfg.grpc_port} http=http://{host}:{cfg.http_port}", flush=True)
    if args.detach:
        print("kvmesh: deployed; --detach leaves it running on the Ray cluster", flush=True)
        return 0
    import time

    # A plain list, not a threading.Event: Event.set() in a signal handler can deadlock
    # on the lock that Event.wait() holds in the same (main) thread.
    signals: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: signals.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    print("kvmesh: Ctrl-C to stop", flush=True)
    try:
        while not signals:
            time.sleep(0.2)
    finally:
        print("kvmesh: shutting down", flush=True)
        ray_app.shutdown(cfg, stop_ray=started)
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


def _serve_local(args) -> int:
    from kvmesh.serve.local import serve_local

    engine_args = []
    for flag, value in (("--model", args.model), ("--dtype", args.dtype), ("--device", args.device),
                        ("--max-model-len", args.max_model_len), ("--block-size", args.block_size),
                        ("--num-blocks", args.num_blocks), ("--kv-cache-memory-gb", args.kv_cache_memory_gb),
                        ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens), ("--threads", args.threads),
                        ("--quantization", args.quantization), ("--group-size", args.group_size),
                        ("--kv-store", args.redis_url or args.kv_store)):
        if value is not None:
            engine_args += [flag, str(value)]
    if args.no_prefix_caching:
        engine_args.append("--no-prefix-caching")
    router_args = ["--pd-threshold-tokens", str(256 if args.pd_threshold_tokens is None else args.pd_threshold_tokens)]
    if args.http_port is not None:
        router_args += ["--http-port", str(args.http_port)]
    if args.otlp_endpoint:
        router_args += ["--otlp-endpoint", args.otlp_endpoint]
        engine_args += ["--otlp-endpoint", args.otlp_endpoint]
    return serve_local(engine_args, args.host or "127.0.0.1", 50051 if args.port is None else args.port,
                       router_args, args.transfer_ttl, args.model)


def cmd_quantize(args) -> int:
    from pathlib import Path

    from kvmesh.models.loader import resolve_model_path
    from kvmesh.quant import get_method
    from kvmesh.quant.checkpoint import quantize_checkpoint

    method = get_method(args.method, args.group_size)
    src = resolve_model_path(None if args.model == "embedded" else args.model)
    out = quantize_checkpoint(src, Path(args.out), method)
    print(f"wrote {args.method} checkpoint to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh LLM engine and serving platform")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="print token count and timings to stderr")
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="serve gRPC (kvmesh.v1.LLM) and OpenAI-compatible HTTP on Ray Serve")
    s.add_argument("--config", default=None, help="serving config YAML (kvmesh.serve.config.ServingConfig)")
    s.add_argument("--address", default=None,
                   help="join this Ray cluster (e.g. auto, ray://head:10001); default: start a local Ray instance")
    s.add_argument("--detach", action="store_true",
                   help="deploy or update the app on --address and exit (e.g. to change replica counts)")
    s.add_argument("--redis-url", default=None, help="shared KV store redis://host:port/db (default: in-memory)")
    s.add_argument("--prefill-replicas", type=int, default=None,
                   help="prefill replicas; > 0 means disaggregated prefill/decode (default: from config, 0)")
    s.add_argument("--decode-replicas", type=int, default=None, help="decode (or unified) replicas")
    s.add_argument("--local", action="store_true",
                   help="no Ray: router + one prefill + one decode worker as processes on this machine")
    s.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="gRPC port (default 50051)")
    s.add_argument("--http-port", type=int, default=None, help="HTTP port (default 8000; --local: off unless set)")
    s.add_argument("--pd-threshold-tokens", type=int, default=None,
                   help="prompts with fewer uncached tokens skip prefill/decode disaggregation (default 256)")
    s.add_argument("--transfer-ttl", type=float, default=30.0, help="seconds prefilled KV waits for its decode")
    s.add_argument("--otlp-endpoint", default=None, help="export OpenTelemetry traces (OTLP/gRPC); default off")
    _add_engine_args(s)
    s.set_defaults(func=cmd_serve)
    q = sub.add_parser("quantize", help="write an int8 / int4 quantized copy of a checkpoint folder")
    q.add_argument("model", help="float HF checkpoint folder, or 'embedded' for SmolLM2-135M-Instruct")
    q.add_argument("out", help="output folder (new or empty)")
    q.add_argument("--method", required=True, choices=["int8", "int4"])
    q.add_argument("--group-size", type=int, default=None, help="int4 group size: 32 (default), 64 or 128")
    q.set_defaults(func=cmd_quantize)
    from kvmesh.optimize.cli import add_optimize_parser

    add_optimize_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvmesh.errors import KVMeshError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (KVMeshError, ValueError) as exc:
        print(f"kvmesh: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
