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
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="quantize the weights at load (a checkpoint saved quantized needs no flag)")
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


def cmd_serve(args) -> int:
    from kvmesh.serve.local import serve_local

    if not args.local:
        print("kvmesh: error: only `kvmesh serve --local` exists so far (router + prefill + decode "
              "worker as local processes); Ray Serve deployment comes later", file=sys.stderr)
        return 2
    engine_args = []
    for flag, value in (("--model", args.model), ("--dtype", args.dtype), ("--device", args.device),
                        ("--max-model-len", args.max_model_len), ("--block-size", args.block_size),
                        ("--num-blocks", args.num_blocks), ("--kv-cache-memory-gb", args.kv_cache_memory_gb),
                        ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens), ("--threads", args.threads),
                        ("--quantization", args.quantization), ("--group-size", args.group_size),
                        ("--kv-store", args.kv_store)):
        if value is not None:
            engine_args += [flag, str(value)]
    if args.no_prefix_caching:
        engine_args.append("--no-prefix-caching")
    router_args = ["--pd-threshold-tokens", str(args.pd_threshold_tokens)]
    return serve_local(engine_args, args.host, args.port, router_args, args.transfer_ttl, args.model)


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
    s = sub.add_parser("serve", help="serve the gRPC API (kvmesh.v1.LLM)")
    s.add_argument("--local", action="store_true",
                   help="router + one prefill + one decode worker as processes on this machine (no Ray)")
    s.add_argument("--host", default="127.0.0.1", help="router listen address")
    s.add_argument("--port", type=int, default=50051, help="router port")
    s.add_argument("--pd-threshold-tokens", type=int, default=256,
                   help="prompts with fewer uncached tokens skip prefill/decode disaggregation")
    s.add_argument("--transfer-ttl", type=float, default=30.0, help="seconds prefilled KV waits for its decode")
    _add_engine_args(s)
    s.set_defaults(func=cmd_serve)
    q = sub.add_parser("quantize", help="write an int8 / int4 quantized copy of a checkpoint folder")
    q.add_argument("model", help="float HF checkpoint folder, or 'embedded' for SmolLM2-135M-Instruct")
    q.add_argument("out", help="output folder (new or empty)")
    q.add_argument("--method", required=True, choices=["int8", "int4"])
    q.add_argument("--group-size", type=int, default=None, help="int4 group size: 32 (default), 64 or 128")
    q.set_defaults(func=cmd_quantize)
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
