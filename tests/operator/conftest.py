"""Shared fixtures for the operator tests: import path, schemas, tool lookup."""

from __future__ import annotations

import os
import sys

import pytest
import yaml

from k8s_helpers import CRD_FILE, ROOT, SHARED_K8S, find_tool  # noqa: F401

# The status and drift timers' intervals are read when kvmesh_operator.handlers is imported.
os.environ.setdefault("KVMESH_STATUS_INTERVAL_S", "0.3")
os.environ.setdefault("KVMESH_DRIFT_INTERVAL_S", "0.3")
try:
    import kvmesh_operator  # noqa: F401  (installed: pyproject finds packages in operator/)
except ImportError:  # an install that predates operator/ in packages.find
    sys.path.insert(0, str(ROOT / "operator"))


@pytest.fixture(scope="session")
def rayservice_schema() -> dict:
    path = SHARED_K8S / "ray.io_rayservices.yaml"
    if not path.exists():
        pytest.fail(f"KubeRay's RayService CRD is missing: expected {path} (the shared/k8s folder next to "
                    "the repository; see shared/k8s/README.md)")
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 2 MB of YAML
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="session")
def llmservice_schema() -> dict:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
