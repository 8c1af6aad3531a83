"""The chart's monitoring (ServiceMonitors, PodMonitor, PrometheusRule, Grafana dashboard) and
Gateway API Inference Extension objects (InferencePool, endpoint picker, model servers), with
the real `helm` binary; their selectors are checked against what the operator renders."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from k8s_helpers import ROOT, find_tool, validate_builtin
from pod_security import restricted_violations

from kvmesh_operator.render import Target, render_all
from kvmesh_operator.spec import parse_spec

CHART = ROOT / "helm" / "kvmesh"
DASHBOARD = CHART / "dashboards" / "kvmesh.json"
MONITORING = ["--set", "monitoring.enabled=true", "--set", "monitoring.labels.release=prom"]
POOL = ["--set", "inferencePool.enabled=true", "--set", "inferencePool.modelName=chat"]


@pytest.fixture(scope="module")
def helm() -> str:
    path = find_tool("helm")
    if path is None:
        pytest.fail("helm not found on PATH or in .tools/bin: run scripts/install_helm.sh")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120)


def _template(helm: str, *extra: str) -> dict[str, dict]:
    proc = _run(helm, "template", "kvmesh", str(CHART), "--namespace", "kvmesh-system", *extra)
    assert proc.returncode == 0, proc.stderr
    objs = [o for o in yaml.safe_load_all(proc.stdout) if o]
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


@pytest.mark.parametrize("values", [[], MONITORING, POOL, MONITORING + POOL,
                                    MONITORING + ["--set", "watchNamespaces={team-a}"]],
                         ids=["default", "monitoring", "inference_pool", "both", "namespaced"])
def test_helm_lint_strict_with_and_without_monitoring(helm, values):
    proc = _run(helm, "lint", "--strict", str(CHART), *values)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_nothing_extra_renders_by_default(helm):
    kinds = {k.split("/")[0] for k in _template(helm)}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule", "InferencePool"}
    assert "ConfigMap/kvmesh-dashboard" not in _template(helm)


def test_monitoring_renders_monitors_rules_and_dashboard(helm):
    objs = _template(helm, *MONITORING)
    validate_builtin(o for o in objs.values() if o["apiVersion"] in ("v1", "apps/v1")
                     or o["apiVersion"].startswith("rbac."))
    routers = objs["ServiceMonitor/kvmesh-llmservices"]
    assert routers["apiVersion"] == "monitoring.coreos.com/v1"
    assert routers["metadata"]["labels"]["release"] == "prom"
    assert routers["spec"]["namespaceSelector"] == {"any": True}
    [endpoint] = routers["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    # It selects the router Services the operator renders for an LLMService, by a port they have.
    rendered = render_all(Target("chat", "ml", parse_spec({})))
    http = next(o for o in rendered if o["kind"] == "Service" and o["metadata"]["name"] == "chat-http")
    assert routers["spec"]["selector"]["matchLabels"].items() <= http["metadata"]["labels"].items()
    assert endpoint["port"] in {p["name"] for p in http["spec"]["ports"]}
    assert not any(routers["spec"]["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()
                   for o in rendered if o["kind"] == "Service" and o is not http)
    # The operator's own metrics Service.
    operator = objs["ServiceMonitor/kvmesh-operator"]
    svc = objs["Service/kvmesh-metrics"]
    assert operator["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert operator["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    # Ray's metrics on the router pods (the NetworkPolicies admit outsiders there only).
    pods = objs["PodMonitor/kvmesh-ray"]["spec"]
    cluster = next(o for o in rendered if o["kind"] == "RayService")["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g["template"]["metadata"]["labels"] for g in cluster["workerGroupSpecs"]}
    selected = [name for name, labels in groups.items() if _selects(pods["selector"], labels)]
    assert selected == ["router"]
    assert pods["podMetricsEndpoints"][0]["port"] == "metrics"
    # SLO alerts, thresholds from values.
    rule = objs["PrometheusRule/kvmesh-slo"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"KvmeshTimeToFirstTokenHigh", "KvmeshTimePerOutputTokenHigh", "KvmeshErrorRateHigh",
                           "KvmeshKVCacheNearlyFull", "KvmeshQueueGrowing", "KvmeshNoHealthyWorker"}
    assert alerts["KvmeshTimeToFirstTokenHigh"]["expr"].endswith("> 2")
    assert "{{ $labels.model }}" in alerts["KvmeshTimeToFirstTokenHigh"]["annotations"]["summary"]
    tuned = _template(helm, *MONITORING, "--set", "monitoring.rules.ttftP90Seconds=0.5",
                      "--set", "monitoring.rules.kvCacheUsage=0.9")["PrometheusRule/kvmesh-slo"]
    tuned_alerts = {r["alert"]: r["expr"] for g in tuned["spec"]["groups"] for r in g["rules"]}
    assert tuned_alerts["KvmeshTimeToFirstTokenHigh"].endswith("> 0.5")
    assert tuned_alerts["KvmeshKVCacheNearlyFull"].endswith("> 0.9")
    # The dashboard: the chart's JSON file, labelled for Grafana's sidecar.
    dash = objs["ConfigMap/kvmesh-dashboard"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["kvmesh.json"]) == json.loads(DASHBOARD.read_text())


def test_namespaced_operator_monitors_only_its_namespaces(helm):
    objs = _template(helm, *MONITORING, "--set", "watchNamespaces={team-a,team-b}")
    for key in ("ServiceMonitor/kvmesh-llmservices", "PodMonitor/kvmesh-ray"):
        assert objs[key]["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_inference_pool_renders_pool_picker_and_model_servers(helm):
    objs = _template(helm, *POOL, *MONITORING)
    validate_builtin(o for o in objs.values() if o["kind"] in ("Service", "Deployment", "ConfigMap"))
    pool = objs["InferencePool/kvmesh-pool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert spec["targetPorts"] == [{"number": 8000}]
    ref = spec["endpointPickerRef"]
    assert ref == {"kind": "Service", "name": "kvmesh-pool-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    # The picker's Service reaches the picker pods on its ext_proc port.
    epp_svc, epp = objs["Service/kvmesh-pool-epp"], objs["Deployment/kvmesh-pool-epp"]
    epp_pod = epp["spec"]["template"]
    assert epp_svc["spec"]["selector"].items() <= epp_pod["metadata"]["labels"].items()
    [container] = epp_pod["spec"]["containers"]
    assert container["command"] == ["kvmesh", "epp"]
    args = dict(a.lstrip("-").split("=", 1) for a in container["args"])
    assert args["worker-dns"] == "kvmesh-pool-workers.kvmesh-system.svc" and args["target-port"] == "8000"
    assert args["model-id"] == "chat" and args["port"] == "9002" and args["body-mode"] == "full-duplex"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert next(p for p in epp_svc["spec"]["ports"] if p["port"] == ref["port"]["number"])["targetPort"] in ports
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    # The pool selects the model server pods; the headless Service lists their worker ports.
    servers = objs["Deployment/kvmesh-pool-servers"]["spec"]["template"]
    assert spec["selector"]["matchLabels"].items() <= servers["metadata"]["labels"].items()
    assert not _selects(spec["selector"], epp_pod["metadata"]["labels"])
    workers = objs["Service/kvmesh-pool-workers"]["spec"]
    assert workers["clusterIP"] == "None" and workers["selector"] == spec["selector"]["matchLabels"]
    assert workers["ports"][0]["port"] == 50061
    worker, http = servers["spec"]["containers"]
    assert worker["command"] == ["kvmesh", "worker"] and "--port=50061" in worker["args"]
    assert http["command"] == ["kvmesh", "router"] and "--worker=127.0.0.1:50061" in http["args"]
    assert "--http-port=8000" in http["args"] and http["ports"] == [{"name": "http", "containerPort": 8000}]
    for pod in (epp_pod["spec"], servers["spec"]):
        assert restricted_violations(pod) == []
    assert objs["PodMonitor/kvmesh-pool"]["apiVersion"] == "monitoring.coreos.com/v1"


def test_inference_pool_of_your_own_pods(helm):
    objs = _template(helm, "--set", "inferencePool.enabled=true", "--set", "inferencePool.modelServers.enabled=false",
                     "--set", "inferencePool.selector.app=my-kvmesh", "--set", "inferencePool.failureMode=FailOpen")
    assert "Deployment/kvmesh-pool-servers" not in objs
    pool = objs["InferencePool/kvmesh-pool"]["spec"]
    assert pool["selector"] == {"matchLabels": {"app": "my-kvmesh"}}
    assert pool["endpointPickerRef"]["failureMode"] == "FailOpen"
    # No pods of its own and no selector: the render says what to set.
    proc = _run(helm, "template", "kvmesh", str(CHART), "--set", "inferencePool.enabled=true",
                "--set", "inferencePool.modelServers.enabled=false")
    assert proc.returncode != 0 and "inferencePool.selector" in proc.stderr


def _selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions with In / Exists) on `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
    return True
