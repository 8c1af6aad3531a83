"""The operator stays light: it imports kvmesh's config models only, never grpc or torch."""

from __future__ import annotations

import ast
import subprocess
import sys

from k8s_helpers import ROOT

# The data-plane modules the operator may import: the typed config the CRD mirrors.
ALLOWED = {"kvmesh.config", "kvmesh.router.config", "kvmesh.router.plugins", "kvmesh.serve.config"}


def _kvmesh_imports(path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n == "kvmesh" or n.startswith("kvmesh.")}


def test_operator_source_imports_only_kvmesh_config_models():
    used = {f.name: _kvmesh_imports(f) for f in sorted((ROOT / "operator" / "kvmesh_operator").glob("*.py"))}
    assert used["spec.py"], "the spec mirrors kvmesh's config: it must import it"
    bad = {name: sorted(mods - ALLOWED) for name, mods in used.items() if mods - ALLOWED}
    assert not bad, f"the operator imports the data plane beyond its config models: {bad}"


def test_operator_imports_no_grpc_or_torch():
    code = ("import kvmesh_operator.spec, kvmesh_operator.render, kvmesh_operator.handlers; import sys; "
            "heavy = sorted(m for m in ('grpc', 'torch') if m in sys.modules); "
            "assert not heavy, f'importing the operator loaded {heavy}'")
    env = {"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'platform'}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
