"""Command-line flags generated from the typed configs, in one place (as vLLM's
`EngineArgs.add_cli_args` does): every EngineConfig field is a flag with its
description, default and choices, so a new field needs no CLI code.

Flags default to "not given": a parsed namespace yields only what the user typed, as
flat overrides (`EngineConfig.with_overrides`) on top of a base config (defaults, or a
--config file).
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from kvmesh.chat.config import ChatConfig
from kvmesh.chat.reasoning import REASONING_PARSERS
from kvmesh.chat.tool_parsers import TOOL_PARSERS
from kvmesh.cli.vllm_args import speculative_config_arg
from kvmesh.config import EngineConfig, LoRAConfig, LoRAModule, SpeculativeConfig

# Sections whose fields are flattened without a prefix (their names are unique).
_FLAT_SECTIONS = ("model", "cache", "scheduler", "parallel", "kernels")
# The nested optional sections: `--speculative METHOD` turns speculative decoding on;
# `--enable-lora` (or any LoRA flag) turns multi-LoRA serving on.
_SPEC = "speculative"
_LORA = "lora"
_NESTED = (_SPEC, _LORA)

# Flag names that differ from `--field-name` (kept for the flags users already know).
_NAMES: dict[tuple[str, ...], list[str]] = {
    ("num_threads",): ["--threads", "--num-threads"],
    ("model", "seed"): ["--engine-seed"],  # --seed is the request's sampling seed
    ("model", "quantization_group_size"): ["--group-size", "--quantization-group-size"],
    (_SPEC, "method"): ["--speculative", "--speculative-method"],
    (_SPEC, "model"): ["--draft-model", "--speculative-model"],
    (_SPEC, "quantization"): ["--draft-quantization", "--speculative-quantization"],
    (_SPEC, "num_speculative_tokens"): ["--num-speculative-tokens"],
    (_LORA, "modules"): ["--lora-modules"],
}


def lora_module_arg(text: str) -> dict[str, str]:
    """`name=path` or `{"name": ..., "path": ...}` (vLLM's two spellings of --lora-modules)."""
    text = text.strip()
    if text.startswith("{"):
        entry = json.loads(text)
        if not isinstance(entry, dict):
            raise argparse.ArgumentTypeError(f"--lora-modules: expected a JSON object, got {text!r}")
        return entry
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path, got {text!r}")
    return {"name": name, "path": path}


@dataclass(frozen=True)
class Flag:
    """One EngineConfig field as a command-line flag."""

    path: tuple[str, ...]  # ("cache", "block_size"), ("num_threads",), ("speculative", "method")
    options: tuple[str, ...]  # ("--block-size",)

    @property
    def dest(self) -> str:
        return "engine__" + "__".join(self.path)


def _unwrap(annotation: Any) -> Any:
    """`X | None` -> X."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _fields(model: type[BaseModel], prefix: tuple[str, ...] = ()):
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        kind = _unwrap(field.annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel) and not prefix:
            yield from _fields(kind, path)
        else:
            yield path, field, kind


def engine_flags() -> list[Flag]:
    """Every leaf field of EngineConfig, with its flag names."""
    out = []
    for path, _, _ in _fields(EngineConfig):
        if path in _NAMES:
            options = _NAMES[path]
        elif path[0] == _SPEC:
            options = ["--speculative-" + path[-1].replace("_", "-")]
        else:
            options = ["--" + path[-1].replace("_", "-")]
        out.append(Flag(path, tuple(options)))
    return out


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineConfig field (group "engine")."""
    group = parser.add_argument_group("engine", "EngineConfig fields (kvmesh.config); unset flags keep the "
                                      "config's value")
    kinds = {path: (field, kind) for path, field, kind in _fields(EngineConfig)}
    for flag in engine_flags():
        field, kind = kinds[flag.path]
        if flag.path == (_LORA, "modules"):
            group.add_argument(*flag.options, dest=flag.dest, type=lora_module_arg, nargs="+", default=argparse.SUPPRESS,
                               metavar="NAME=PATH", help=f"{field.description} Each as name=path or as JSON "
                               '{"name": ..., "path": ...}; implies --enable-lora.')
            continue
        help_text = (field.description or "").replace("%", "%%")
        default = field.get_default(call_default_factory=True)
        if typing.get_origin(kind) is Literal:
            choices = list(typing.get_args(kind))
            group.add_argument(*flag.options, dest=flag.dest, choices=choices, default=argparse.SUPPRESS,
                               help=f"{help_text} (default: {default})")
        elif kind is bool:
            group.add_argument(*flag.options, dest=flag.dest, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=f"{help_text} (default: {default})")
        elif kind in (int, float, str):
            group.add_argument(*flag.options, dest=flag.dest, type=kind, default=argparse.SUPPRESS,
                               metavar=kind.__name__.upper(), help=f"{help_text} (default: {default})")
        else:  # lists of entries (prompt_cache): JSON
            group.add_argument(*flag.options, dest=flag.dest, type=json.loads, default=argparse.SUPPRESS,
                               metavar="JSON", help=f"{help_text} As JSON.")
    group.add_argument("--speculative-config", dest="engine_speculative_config", type=speculative_config_arg,
                       default=argparse.SUPPRESS, metavar="JSON",
                       help='vLLM\'s spelling of the speculative flags: \'{"method": "ngram", "num_speculative_tokens": '
                       '4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\' (prompt lookup) or \'{"model": PATH, '
                       '"num_speculative_tokens": N}\' (a draft model); also quantization and disable_by_batch_size '
                       "(kvmesh's max_batch_size). Instead of the --speculative-* flags, not with them.")
    group.add_argument("--enable-lora", dest="engine_enable_lora", action=argparse.BooleanOptionalAction,
                       default=argparse.SUPPRESS, help="Serve LoRA adapters of the base model (load them at run "
                       "time, or name them with --lora-modules). (default: off)")
    # Legacy spelling of --no-enable-prefix-caching.
    group.add_argument("--no-prefix-caching", dest="engine__cache__enable_prefix_caching",
                       action="store_false", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user gave, as flat EngineConfig overrides (speculative and lora
    nested)."""
    flat: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {name: {} for name in _NESTED}
    for flag in engine_flags():
        if not hasattr(args, flag.dest):
            continue
        value = getattr(args, flag.dest)
        if flag.path[0] in nested:
            nested[flag.path[0]][flag.path[-1]] = value
        else:
            flat[flag.path[-1]] = value
    for name, values in nested.items():
        if values:
            flat[name] = values
    return flat


def engine_config(args: argparse.Namespace, base: EngineConfig | None = None) -> EngineConfig:
    """`base` (default: EngineConfig()) with the given flags applied, validated."""
    base = base or EngineConfig()
    overrides = engine_overrides(args)
    vllm_spec = getattr(args, "engine_speculative_config", None)
    if vllm_spec is not None:
        if _SPEC in overrides:
            given = sorted(f.options[0] for f in engine_flags() if f.path[0] == _SPEC and hasattr(args, f.dest))
            raise ValueError(f"speculative: --speculative-config is the whole speculative config; drop "
                             f"{', '.join(given)} (or put them in the JSON)")
        overrides[_SPEC] = SpeculativeConfig(**vllm_spec)
    elif _SPEC in overrides:
        merged = {**(base.speculative.model_dump() if base.speculative else {}), **overrides[_SPEC]}
        if "method" not in merged:
            raise ValueError("speculative: set --speculative METHOD (ngram or draft) to use speculative decoding")
        overrides[_SPEC] = SpeculativeConfig(**merged)
    enable_lora = getattr(args, "engine_enable_lora", None)
    if enable_lora is False:
        if _LORA in overrides:
            raise ValueError("lora: --no-enable-lora conflicts with the LoRA flags given")
        overrides[_LORA] = None
    elif enable_lora or _LORA in overrides:
        merged = {**(base.lora.model_dump() if base.lora else {}), **overrides.get(_LORA, {})}
        if "modules" in overrides.get(_LORA, {}):  # the flag lists the start-up adapters: no duplicates
            merged["modules"] = [LoRAModule(**m) for m in merged["modules"]]
        overrides[_LORA] = LoRAConfig(**merged)
    return base.with_overrides(**overrides)


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """The chat flags (ChatConfig; vLLM's names), unset unless given."""
    group = parser.add_argument_group("chat", "how the OpenAI chat API reads the model's replies (kvmesh.chat)")
    fields = ChatConfig.model_fields
    group.add_argument("--tool-call-parser", dest="chat__tool_call_parser", choices=["auto", *sorted(TOOL_PARSERS)],
                       default=argparse.SUPPRESS, help=f"{fields['tool_call_parser'].description} (default: auto)")
    group.add_argument("--enable-auto-tool-choice", dest="chat__enable_auto_tool_choice",
                       action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                       help=f"{fields['enable_auto_tool_choice'].description} (default: on)")
    group.add_argument("--reasoning-parser", dest="chat__reasoning_parser", choices=sorted(REASONING_PARSERS),
                       default=argparse.SUPPRESS, help=f"{fields['reasoning_parser'].description} (default: none)")


def chat_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The chat flags the user gave, as ChatConfig fields."""
    return {k.removeprefix("chat__"): v for k, v in vars(args).items() if k.startswith("chat__")}


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    """--tls-cert / --tls-key / --tls-client-ca, also under vLLM's --ssl-* names."""
    parser.add_argument("--tls-cert", "--ssl-certfile", dest="tls_cert", default=None,
                        help="PEM certificate: serve HTTP (and gRPC) over TLS (with --tls-key / --ssl-keyfile)")
    parser.add_argument("--tls-key", "--ssl-keyfile", dest="tls_key", default=None,
                        help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", "--ssl-ca-certs", dest="tls_client_ca", default=None,
                        help="PEM CA: require client certificates it signed (mutual TLS)")
