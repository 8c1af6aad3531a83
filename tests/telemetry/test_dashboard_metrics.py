"""Every metric the Grafana dashboard (helm/kvmesh/dashboards/kvmesh.json) and the
PrometheusRule (rendered by the real `helm`) query is really exported: found in a real
/metrics scrape after real requests (unified and P/D) through the in-process cluster, or,
for the few series only some deployments have (LoRA workers, retries), defined by
kvmesh's exporters in the same registry."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import MAX_TOKENS, _run

from kvmesh._proto import worker_pb2
from kvmesh.telemetry.metrics import REGISTRY
from kvmesh.telemetry.workers import stats_families

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvmesh"
# Queried series a healthy test cluster need not have samples of (defined, but no LoRA workers, no retries).
SOMETIMES = {"kvmesh_router_retries_total", "kvmesh_lora_adapters", "kvmesh_lora_slots", "kvmesh_lora_requests"}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
             "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not functions, keywords or label names)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges and subqueries
    expr = re.sub(r"\s*\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    out = set()
    for m in re.finditer(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if m.group(0) in _KEYWORDS or expr[m.end():].lstrip().startswith("("):
            continue
        out.add(m.group(0))
    return out


def test_metric_names_parser():
    e = ('sum by (source) (rate(kvmesh_a_total{ns=~"$x", y="1e5"}[$__rate_interval])) / ignoring (source) '
         'group_left sum(rate(kvmesh_b_total[5m])) > 1e-9 and deriv(sum(kvmesh_c)[5m:30s]) > 0.5')
    assert metric_names(e) == {"kvmesh_a_total", "kvmesh_b_total", "kvmesh_c"}
    assert metric_names("histogram_quantile(0.9, sum by (le, model) (rate(x_bucket[5m])))") == {"x_bucket"}


def _dashboard_exprs() -> list[str]:
    dash = json.loads((CHART / "dashboards" / "kvmesh.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):  # label_values(metric{...}, label)
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", q["query"]))
    return exprs


def _rule_exprs() -> list[str]:
    helm = shutil.which("helm") or next((str(p) for p in [ROOT / ".tools" / "bin" / "helm"] if p.exists()), None)
    if helm is None:
        pytest.fail("helm not found on PATH or in .tools/bin: run scripts/install_helm.sh")
    out = subprocess.run([helm, "template", "kvmesh", str(CHART), "--set", "monitoring.enabled=true",
                          "-s", "templates/monitoring.yaml"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    [rule] = [o for o in yaml.safe_load_all(out.stdout) if o and o["kind"] == "PrometheusRule"]
    return [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]


def _defined() -> set[str]:
    """Sample names kvmesh's registry defines (families with or without samples), and the
    per-worker families of a LoRA worker's Stats."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names = set()
    for fam in [*REGISTRY.collect(), *stats_families([(worker_pb2.StatsResponse(
            address="10.0.0.9:1", role="unified", lora_enabled=True, max_loras=2,
            loras=[worker_pb2.LoRAInfo(name="sql", num_requests=1)]), True)])]:
        names |= {fam.name + s for s in suffixes.get(fam.type, ("",))}
        names |= {s.name for s in fam.samples}
    return names


def test_dashboard_and_alert_metrics_are_exported(cluster):
    async def traffic():
        assert await _run(cluster.uni_router.address, list(range(60, 80))) == MAX_TOKENS
        assert await _run(cluster.pd_router.address, list(range(80, 112))) == MAX_TOKENS

    cluster.loop.run(traffic())
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.decode_metrics_port}/metrics", timeout=10).read()
    live = {s.name for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    dashboard = set().union(*map(metric_names, _dashboard_exprs()))
    rules = set().union(*map(metric_names, _rule_exprs()))
    assert len(dashboard) >= 25 and len(rules) >= 5
    queried = dashboard | rules
    assert all(n.startswith("kvmesh_") for n in queried), queried  # kvmesh's own signals
    missing = queried - live - _defined()
    assert not missing, f"queried but never exported: {sorted(missing)}"
    # Nearly everything is in the live scrape; only the known sometimes-series may be absent.
    assert {n for n in queried - live} <= SOMETIMES, sorted(queried - live)
    # The dashboard covers every signal family the issue names.
    for needed in ("kvmesh_time_to_first_token_seconds_bucket", "kvmesh_time_per_output_token_seconds_bucket",
                   "kvmesh_requests_waiting", "kvmesh_kv_blocks_used", "kvmesh_worker_cached_prompt_tokens_total",
                   "kvmesh_kv_transfer_bytes_total", "kvmesh_router_scorer_score_bucket",
                   "kvmesh_spec_decode_accepted_tokens_total", "kvmesh_lora_adapters"):
        assert needed in dashboard, needed
