"""The LLMService CRD: generated from spec.py (no drift), valid, and the deploy/ examples fit it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from k8s_helpers import CRD_FILE, ROOT
from k8s_helpers import validate_builtin, validate_schema
from kvmesh_operator.crd import render_yaml
from kvmesh_operator.mapping import to_serving_config
from kvmesh_operator.spec import parse_spec

EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


def test_checked_in_crd_is_generated_from_spec():
    assert CRD_FILE.read_text() == render_yaml(), (
        f"{CRD_FILE} is stale: run `python -m kvmesh_operator.crd > {CRD_FILE.relative_to(ROOT)}`")


def test_crd_module_prints_the_crd():
    env_path = str(ROOT / "operator")
    out = subprocess.run([sys.executable, "-m", "kvmesh_operator.crd"], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, timeout=60).stdout
    assert out == CRD_FILE.read_text()


def test_crd_is_valid_and_structural():
    crd = yaml.safe_load(CRD_FILE.read_text())
    validate_builtin([crd])
    [version] = crd["spec"]["versions"]
    assert version["subresources"] == {"status": {}} and crd["spec"]["names"]["shortNames"] == ["llms"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready", "Model", "Mode", "Prefill", "Decode", "Pods", "URL", "Reason", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for column in version["additionalPrinterColumns"]:  # every column reads a status field the CRD declares
        path = column["jsonPath"].split("[")[0].removeprefix(".status.").split(".")
        if column["jsonPath"].startswith(".status."):
            node = status[path[0]]
            for part in path[1:]:
                node = node["properties"][part]
    conditions = status["conditions"]
    assert (conditions["x-kubernetes-list-type"], conditions["x-kubernetes-list-map-keys"]) == ("map", ["type"])
    assert "type" in conditions["items"]["required"]  # a map key must be required

    def walk(node, path):
        assert "$ref" not in node and node.get("additionalProperties") is not False, path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"
        else:
            assert "type" in node, f"{path}: structural schemas need a type"
        for name, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{name}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], f"{path}[]")

    walk(version["schema"]["openAPIV3Schema"], "")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd(path: Path, llmservice_schema):
    [obj] = list(yaml.safe_load_all(path.read_text()))
    validate_schema(obj, llmservice_schema)
    to_serving_config(parse_spec(obj["spec"]), name=obj["metadata"]["name"])


def test_examples_cover_both_modes():
    modes = {parse_spec(yaml.safe_load(p.read_text())["spec"]).mode for p in EXAMPLES}
    assert modes == {"unified", "disaggregated"}


def test_schema_rejects_bad_values(llmservice_schema):
    bad = {"apiVersion": "kvmesh.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "x"},
           "spec": {"engine": {"blockSize": 0}, "model": {"dtype": "int3"}}}
    with pytest.raises(AssertionError):
        validate_schema(bad, llmservice_schema)
