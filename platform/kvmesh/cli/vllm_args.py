"""vLLM's spellings of kvmesh's options, so `kvmesh serve` reads as `vllm serve` does.

- `kvmesh serve MODEL`: the positional model is `--model` (both given and different: an error).
- `--served-model-name NAME`: the name `/v1/models` lists and requests' `model` must match
  (ServingConfig.model_id; kvmesh serves one name per model, LoRA adapters their own).
- `--api-key KEY`: `KVMESH_API_KEY` for the processes this command starts.
- `--speculative-config JSON`: vLLM's speculative config onto kvmesh's SpeculativeConfig
  (`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}` or
  `{"model": PATH, "num_speculative_tokens": N}`).
- `--ssl-certfile` / `--ssl-keyfile` / `--ssl-ca-certs` are kvmesh's `--tls-*` flags
  (declared with them, in serve.py and processes.py); `--gpu-memory-utilization` is an
  EngineConfig field (config.py CacheConfig, where its mapping is documented).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from kvmesh.config import SpeculativeConfig
from kvmesh.rpc.auth import ENV_VAR as API_KEY_ENV

# vLLM's speculative_config keys -> SpeculativeConfig fields.
_SPEC_KEYS = {"num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_max": "ngram_max",
              "prompt_lookup_min": "ngram_min", "quantization": "quantization",
              "disable_by_batch_size": "max_batch_size"}
# Keys vLLM takes that change nothing here at their value (a one-GPU draft).
_INERT = {"draft_tensor_parallel_size": (1, None)}


def speculative_config_arg(text: str) -> dict[str, Any]:
    """`--speculative-config`: vLLM's JSON, as SpeculativeConfig fields (validated)."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--speculative-config: not JSON ({e}); e.g. "
                                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError("--speculative-config: expected a JSON object")
    try:
        return speculative_from_vllm(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--speculative-config: {e}") from None


def speculative_from_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's speculative config as SpeculativeConfig fields: `method` ngram (prompt
    lookup), or a draft `model` (method unset, `draft_model` or `draft`). Keys not given
    keep kvmesh's defaults; keys kvmesh does not serve are an error naming them."""
    method, model = spec.get("method"), spec.get("model")
    if method == "ngram":
        if model is not None:
            raise ValueError("the ngram method drafts from the prompt and takes no model; drop model")
        out: dict[str, Any] = {"method": "ngram"}
    elif method in (None, "draft_model", "draft"):
        if not model:
            raise ValueError('give "method": "ngram" or a draft "model" (a checkpoint folder sharing the '
                             "target's tokenizer, or 'self')")
        out = {"method": "draft", "model": str(model)}
    else:
        raise ValueError(f"method {method!r} is not served by kvmesh; use ngram (prompt lookup) or a draft model "
                         '({"model": PATH})')
    unknown = sorted(set(spec) - {"method", "model"} - set(_SPEC_KEYS) - set(_INERT))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a kvmesh speculative option; kvmesh reads method, model, "
                         f"{', '.join(_SPEC_KEYS)}")
    for key, inert in _INERT.items():
        if spec.get(key) not in inert:
            raise ValueError(f"{key}={spec[key]!r}: the draft runs on the target's device; leave it unset")
    out.update({field: spec[key] for key, field in _SPEC_KEYS.items() if key in spec})
    if "ngram_min" in out and "ngram_max" not in out:  # vLLM's min alone: kvmesh's default max, or min
        out["ngram_max"] = max(out["ngram_min"], SpeculativeConfig.model_fields["ngram_max"].default)
    SpeculativeConfig(**out)  # validated now: the error names the field
    return out


def add_serve_aliases(parser: argparse.ArgumentParser) -> None:
    """The positional MODEL, --served-model-name and --api-key (vLLM's names)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as --model (vLLM's `serve MODEL`): a checkpoint folder, a *.gguf "
                             "or a packaged model's name; default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model's name in the API: /v1/models lists it and a request's `model` must match "
                             "it (default: kvmesh; the config's model_id). LoRA adapters keep their own names")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"require `Authorization: Bearer KEY` on /v1/* and the gRPC API: sets {API_KEY_ENV} for "
                             f"the processes this command starts (the value shows in the process list; prefer "
                             f"{API_KEY_ENV} in the environment, or KVMESH_API_KEYS_FILE for several keys)")


def merged_model(args: argparse.Namespace, dest: str = "engine__model__model") -> None:
    """Fold the positional MODEL into `--model` (its namespace entry `dest`); both given
    and different is an error that says so."""
    tag, flag = getattr(args, "model_tag", None), getattr(args, dest, None)
    if tag is None:
        return
    if flag is not None and not _same_model(tag, flag):
        raise ValueError(f"the model is given twice and the two differ: {tag!r} (positional) and --model {flag!r}; "
                         "give one of them")
    setattr(args, dest, tag)


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def served_model_name(args: argparse.Namespace) -> str | None:
    names = getattr(args, "served_model_name", None)
    if not names:
        return None
    if len(names) > 1:
        raise ValueError(f"--served-model-name: kvmesh serves a model under one name, got {len(names)} "
                         f"({', '.join(names)}); give one (serve LoRA adapters under their own names with "
                         "--lora-modules)")
    return names[0]


def apply_api_key(args: argparse.Namespace, remote: bool = False) -> None:
    """--api-key: the key the processes started from here check (KVMESH_API_KEY)."""
    key = getattr(args, "api_key", None)
    if key is None:
        return
    if not key.strip():
        raise ValueError("--api-key: the key is empty")
    if remote:
        raise ValueError(f"--api-key sets {API_KEY_ENV} for processes started here, but --address joins a running "
                         f"Ray cluster: set {API_KEY_ENV} on the cluster (on Kubernetes: spec.auth.apiKeySecretRef)")
    os.environ[API_KEY_ENV] = key
