"""`kvmesh optimize prune | distill`: argument definitions and thin command handlers.

kvmesh/cli.py only calls add_optimize_parser(sub); every flag lives here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmesh.errors import ConfigError
from kvmesh.models.loader import load_arch_config, load_tokenizer, resolve_model_path
from kvmesh.optimize.corpus import token_windows
from kvmesh.optimize.distill import DistillConfig, distill
from kvmesh.optimize.prune import check_output_folder, prune_checkpoint, resolve_shape


def _model_path(model: str | None) -> Path:
    return resolve_model_path(None if model in (None, "embedded") else model)


def cmd_prune(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    src = _model_path(args.model)
    out = Path(args.out)
    check_output_folder(out)
    shape = resolve_shape(load_arch_config(src), args.target_params, args.drop_layers, args.heads,
                          args.mlp_ratio, args.depth_share)
    windows = token_windows(load_tokenizer(src), "calibration", args.calibration_seq_len,
                            max_windows=args.calibration_windows)
    res = prune_checkpoint(src, out, shape, windows)
    print(f"pruned {res.params_before:,} -> {res.params_after:,} parameters "
          f"({100 * (1 - res.params_after / res.params_before):.1f}% fewer): {shape.num_layers} layers, "
          f"{shape.num_heads} heads, MLP width {shape.intermediate_size}; wrote {out}")
    return 0


def cmd_distill(args) -> int:
    if args.student is not None:
        if args.out is not None:
            raise ConfigError("with --student give only TEACHER OUT, e.g. "
                              "`kvmesh optimize distill embedded out/ --student first-layers:6 --steps 100`")
        student, out = args.student, args.student_or_out
    else:
        if args.out is None:
            raise ConfigError("give TEACHER STUDENT OUT, or TEACHER OUT with --student first-layers:K")
        student, out = args.student_or_out, args.out
    cfg = DistillConfig(steps=args.steps, temperature=args.temperature, hidden_loss_weight=args.hidden_loss_weight,
                        lr=args.lr, batch_size=args.batch_size, seq_len=args.seq_len,
                        warmup_steps=args.warmup_steps, checkpoint_every=args.checkpoint_every, seed=args.seed,
                        teacher_top_k=args.teacher_top_k, data=args.data, chat_prompts=args.chat_prompts,
                        chat_max_tokens=args.chat_max_tokens, threads=args.threads, lora_rank=args.lora_rank,
                        lora_alpha=args.lora_alpha)
    res = distill(_model_path(args.teacher), student, Path(out), cfg, resume=args.resume)
    first = f"{res.losses[0]:.4f}" if res.losses else "?"
    print(f"distilled {res.steps} steps (loss {first} -> {res.losses[-1]:.4f}"
          f"{f', resumed at step {res.resumed_from}' if res.resumed_from else ''}); wrote {res.out}")
    return 0


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def add_optimize_parser(sub) -> None:
    """Register `optimize prune` and `optimize distill` on the top-level subparsers."""
    o = sub.add_parser("optimize", help="offline model optimization: structured pruning, distillation")
    osub = o.add_subparsers(dest="optimize_command", required=True)

    p = osub.add_parser("prune", help="structured pruning (layers, GQA head groups, MLP channels) with calibration")
    p.add_argument("model", nargs="?", default="embedded",
                   help="HF checkpoint folder, or 'embedded' (default) for SmolLM2-135M-Instruct")
    p.add_argument("out", help="output folder (new or empty)")
    p.add_argument("--target-params", default=None,
                   help="parameter count to reach (100M, 1.2B, 75000 or 75%%): drops the least influential "
                        "layers for --depth-share of the cut, MLP channels (then head groups) for the rest")
    p.add_argument("--depth-share", type=float, default=0.5,
                   help="with --target-params: fraction of the removed parameters taken as whole layers")
    p.add_argument("--drop-layers", type=int, default=None, help="drop this many whole decoder layers")
    p.add_argument("--heads", type=int, default=None,
                   help="query heads to keep per layer (a multiple of the GQA group size)")
    p.add_argument("--mlp-ratio", type=float, default=None, help="fraction of MLP channels to keep, in (0, 1]")
    p.add_argument("--calibration-windows", type=_positive_int, default=16,
                   help="calibration windows from the corpus calibration split")
    p.add_argument("--calibration-seq-len", type=_positive_int, default=256)
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_prune)

    d = osub.add_parser("distill", help="distil a student from its teacher's logits on CPU (resumable)")
    d.add_argument("teacher", help="teacher HF folder, or 'embedded'")
    d.add_argument("student_or_out", metavar="STUDENT",
                   help="student folder (e.g. from `optimize prune`), or first-layers:K")
    d.add_argument("out", nargs="?", default=None, metavar="OUT", help="output folder")
    d.add_argument("--student", default=None,
                   help="first-layers:K: the teacher's first K layers as the student (then give TEACHER OUT)")
    d.add_argument("--steps", type=_positive_int, required=True, help="optimizer steps")
    d.add_argument("--temperature", type=float, default=1.0, help="softmax temperature of the KL term")
    d.add_argument("--hidden-loss-weight", type=float, default=0.0,
                   help="weight of the hidden-state MSE on matched layers (0 = logits only)")
    d.add_argument("--lr", type=float, default=2e-4, help="peak AdamW learning rate (warmup, cosine decay)")
    d.add_argument("--batch-size", type=_positive_int, default=4)
    d.add_argument("--seq-len", type=_positive_int, default=128)
    d.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    d.add_argument("--checkpoint-every", type=_positive_int, default=50, help="steps between checkpoints")
    d.add_argument("--teacher-top-k", type=int, default=0,
                   help="cache the teacher's top-k logits once (0 = full logits on the fly)")
    d.add_argument("--data", choices=("corpus", "chat"), default="corpus",
                   help="training text: the corpus train split, or the teacher's own greedy replies to chat "
                        "instructions built from it (best for a speculative-decoding draft)")
    d.add_argument("--chat-prompts", type=_positive_int, default=256, help="with --data chat: instructions")
    d.add_argument("--chat-max-tokens", type=_positive_int, default=96, help="with --data chat: reply length")
    d.add_argument("--lora-rank", type=int, default=0,
                   help="train a LoRA adapter of this rank on the frozen STUDENT (the base you serve) and write "
                        "it as a peft folder, served with --enable-lora --lora-modules NAME=OUT (0 = full student)")
    d.add_argument("--lora-alpha", type=float, default=None, help="with --lora-rank: LoRA alpha (default 2 x rank)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--resume", action="store_true", help="continue from OUT's last checkpoint")
    d.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    d.set_defaults(func=cmd_distill)
