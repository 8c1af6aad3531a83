"""The `LLMService` CustomResourceDefinition, generated from the pydantic spec and status.

    python -m kvmesh_operator.crd > helm/kvmesh/crds/llmservices.yaml

pydantic emits JSON Schema (2020-12: `$ref`, `anyOf` with null, numeric
`exclusiveMinimum`); Kubernetes wants a structural OpenAPI v3 schema (everything inlined,
optional = not required, boolean `exclusiveMinimum`). `structural()` converts one to the
other; a test regenerates the CRD and compares it with the checked-in file.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from kvmesh_operator import GROUP, KIND, PLURAL, VERSION
from kvmesh_operator.spec import LLMServiceSpec
from kvmesh_operator.status import LLMServiceStatus

SHORT_NAMES = ["llms"]
_DROP = {"title", "$defs"}


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One JSON Schema node -> a structural OpenAPI v3 node (recursively)."""
    if "$ref" in node:
        target = structural(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        extra = structural({k: v for k, v in node.items() if k != "$ref"}, defs)
        return _ordered({**target, **extra})
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        options = [o for o in node["anyOf"] if o != {"type": "null"}]
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {node['anyOf']} in a structural schema")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        return _ordered({**structural(options[0], defs), **structural(rest, defs)})
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or (key == "default" and value is None):
            continue
        if key == "additionalProperties" and value is False:
            continue  # forbidden in structural schemas: the API server prunes unknown fields instead
        if key == "additionalProperties" and value is True:  # dict[str, Any]: a free-form object
            out["x-kubernetes-preserve-unknown-fields"] = True
            continue
        if key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    return _ordered(out)


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """type and description first, the rest sorted: a stable, readable file."""
    first = [k for k in ("type", "description") if k in node]
    return {k: node[k] for k in [*first, *sorted(set(node) - set(first))]}


def _schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)  # type: ignore[attr-defined]
    return structural(raw, raw.get("$defs", {}))


def _columns() -> list[dict[str, Any]]:
    ready = '.status.conditions[?(@.type=="Ready")]'
    return [
        {"name": "Ready", "type": "string", "jsonPath": f"{ready}.status"},
        {"name": "Model", "type": "string", "jsonPath": ".status.model",
         "description": "The model name clients send"},
        {"name": "Mode", "type": "string", "jsonPath": ".status.mode"},
        {"name": "Prefill", "type": "string", "jsonPath": ".status.roles.prefill.ready",
         "description": "Ready/desired prefill replicas"},
        {"name": "Decode", "type": "string", "jsonPath": ".status.roles.decode.ready",
         "description": "Ready/desired decode (or unified) replicas"},
        {"name": "Pods", "type": "string", "jsonPath": ".status.pods",
         "description": "Ready/desired Ray worker pods, as KubeRay observes them"},
        {"name": "URL", "type": "string", "jsonPath": ".status.url",
         "description": "OpenAI-compatible HTTP endpoint (while Ready)"},
        {"name": "Reason", "type": "string", "jsonPath": f"{ready}.reason", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition as a manifest."""
    schema = {
        "type": "object",
        "description": "An LLM served by kvmesh: the operator renders a KubeRay RayService, Services and "
                       "optionally a Redis for it.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _schema(LLMServiceSpec),
            "status": _schema(LLMServiceStatus),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/name": "kvmesh"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": KIND.lower(),
                      "shortNames": SHORT_NAMES, "categories": ["kvmesh"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": _columns(),
                "schema": {"openAPIV3Schema": schema},
            }],
        },
    }


HEADER = "# Generated by `python -m kvmesh_operator.crd` from operator/kvmesh_operator/spec.py. Do not edit.\n"


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_yaml() -> str:
    return HEADER + yaml.dump(crd(), Dumper=_NoAliases, sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render_yaml())
