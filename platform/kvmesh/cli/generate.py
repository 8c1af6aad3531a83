"""`kvmesh generate` (one prompt, streamed to the terminal) and `kvmesh quantize`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvmesh.build import build_engine
from kvmesh.checkpoint.files import resolve_model_path
from kvmesh.cli.args import add_engine_args, engine_config
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.quant import get_method
from kvmesh.quant.checkpoint import quantize_checkpoint


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None, help="sampling seed of this request")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="print token count and timings to stderr")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos,
    )
    engine = build_engine(engine_config(args))
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


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="write an int8 / int4 quantized copy of a checkpoint folder")
    q.add_argument("model", help="float HF checkpoint folder, or 'embedded' for SmolLM2-135M-Instruct")
    q.add_argument("out", help="output folder (new or empty)")
    q.add_argument("--method", required=True, choices=["int8", "int4"])
    q.add_argument("--group-size", type=int, default=None, help="int4 group size: 32 (default), 64 or 128")
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    method = get_method(args.method, args.group_size)
    src = resolve_model_path(None if args.model == "embedded" else args.model)
    out = quantize_checkpoint(src, Path(args.out), method)
    print(f"wrote {args.method} checkpoint to {out}")
    return 0
