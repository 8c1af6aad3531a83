"""The `kvmesh` command line: `kvmesh generate` (more subcommands come with serving)."""

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
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _engine_config(args):
    from kvmesh.config import EngineConfig

    return EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
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
