"""Validation helpers shared by the operator tests."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterable

import jsonschema
import kubernetes_validate

ROOT = Path(__file__).resolve().parents[2]
SHARED_K8S = ROOT.parent / "shared" / "k8s"
CRD_FILE = ROOT / "helm" / "kvmesh" / "crds" / "llmservices.yaml"


def find_tool(name: str) -> str | None:
    """helm / kubectl: PATH, then scripts/install_helm.sh's .tools/bin."""
    return shutil.which(name) or next(
        (str(p) for p in [ROOT / ".tools" / "bin" / name] if p.exists()), None)


K8S_VERSION = "1.35.0"  # the kubectl the tests install is v1.35
BUILTIN_KINDS = {"ConfigMap", "Service", "Deployment", "Secret", "NetworkPolicy", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                 "Role", "RoleBinding", "CustomResourceDefinition"}


def validate_builtin(objs: Iterable[dict[str, Any]]) -> int:
    """What `kubernetes-validate --strict` does, per object; returns how many were checked."""
    n = 0
    for obj in objs:
        assert obj["kind"] in BUILTIN_KINDS, f"not a built-in kind: {obj['kind']}"
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            raise AssertionError(f"{obj['kind']}/{obj['metadata'].get('name')}: {path}: {e.message}") from None
        n += 1
    return n


def validate_schema(obj: dict[str, Any], schema: dict[str, Any]) -> None:
    """jsonschema validation against a CRD's openAPIV3Schema, with the failing path in the message."""
    try:
        # CRD schemas are OpenAPI v3.0: draft-4 semantics (boolean exclusiveMinimum).
        jsonschema.Draft4Validator(schema).validate(obj)
    except jsonschema.ValidationError as e:
        path = ".".join(str(p) for p in e.absolute_path)
        raise AssertionError(f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}: {path}: {e.message}") from None
