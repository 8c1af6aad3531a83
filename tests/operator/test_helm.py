"""The Helm chart with the real `helm` binary: lint, template, validate every object.

helm and kubectl come from scripts/install_helm.sh (.tools/bin) or PATH.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml
from k8s_helpers import CRD_FILE, ROOT, find_tool, validate_builtin, validate_schema
from pod_security import restricted_violations

from kvmesh_operator.handlers import defaults_from_env
from kvmesh_operator.render import Target, render_all
from kvmesh_operator.spec import parse_spec

CHART = ROOT / "helm" / "kvmesh"
OPERATOR_RULES = {
    ("kvmesh.dev", "llmservices"): {"get", "list", "watch", "patch"},
    ("kvmesh.dev", "llmservices/status"): {"get", "patch"},
    ("ray.io", "rayservices"): {"get", "create", "patch", "delete"},
    ("", "services"): {"get", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "create", "patch", "delete"},
    ("apps", "deployments"): {"get", "create", "patch", "delete"},
    ("", "secrets"): {"get", "create", "delete"},  # generated once (internal token, Redis password), never patched
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch", "delete"},
    ("", "events"): {"create"},
}
CUSTOM = ["--set", "watchNamespaces={team-a,team-b}", "--set", "metrics.enabled=false",
          "--set", "image.tag=1.2.3", "--set", "serviceAccount.name=llm-operator", "--set", "verbose=true",
          "--set", "nodeSelector.pool=system", "--set", "managedRedis.image=redis:7.2",
          "--set", "runtimeImage.repository=registry.local/kvmesh"]


@pytest.fixture(scope="module")
def helm() -> str:
    path = find_tool("helm")
    if path is None:
        pytest.fail("helm not found on PATH or in .tools/bin: run scripts/install_helm.sh")
    return path


def _run(*args: str) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _template(helm: str, *extra: str) -> dict[str, dict]:
    out = _run(helm, "template", "kvmesh", str(CHART), "--namespace", "kvmesh-system", "--include-crds", *extra)
    objs = [o for o in yaml.safe_load_all(out) if o]
    return {f"{o['kind']}/{o['metadata'].get('namespace', '')}/{o['metadata']['name']}": o for o in objs}


@pytest.mark.parametrize("values", [[], CUSTOM], ids=["default", "custom"])
def test_helm_lint_strict(helm, values):
    _run(helm, "lint", "--strict", str(CHART), *values)


def test_default_values_render_valid_cluster_wide_operator(helm):
    objs = _template(helm)
    validate_builtin(objs.values())
    crd = objs["CustomResourceDefinition//llmservices.kvmesh.dev"]
    assert crd == yaml.safe_load(CRD_FILE.read_text())
    role = objs["ClusterRole//kvmesh"]
    assert {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"]} == OPERATOR_RULES
    deployment = objs["Deployment/kvmesh-system/kvmesh"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "--all-namespaces" and container["command"] == ["kvmesh-operator"]
    assert container["image"] == "ghcr.io/kvmesh/kvmesh-operator:0.1.0"
    assert {e["name"]: e["value"] for e in container["env"]}["KVMESH_IMAGE"] == "ghcr.io/kvmesh/kvmesh:0.1.0"
    assert deployment["spec"]["strategy"] == {"type": "Recreate"} and deployment["spec"]["replicas"] == 1
    assert objs["Service/kvmesh-system/kvmesh-metrics"]["spec"]["ports"][0]["port"] == 9090
    binding = objs["ClusterRoleBinding//kvmesh"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvmesh", "namespace": "kvmesh-system"}]


def test_custom_values_render_namespaced_operator(helm):
    objs = _template(helm, *CUSTOM)
    validate_builtin(objs.values())
    assert not any(k.startswith(("ClusterRole", "Service/kvmesh-system/kvmesh-metrics")) for k in objs)
    for ns in ("team-a", "team-b"):
        assert objs[f"Role/{ns}/kvmesh"]["rules"] == objs["Role/team-a/kvmesh"]["rules"]
        assert objs[f"RoleBinding/{ns}/kvmesh"]["subjects"][0]["name"] == "llm-operator"
    spec = objs["Deployment/kvmesh-system/kvmesh"]["spec"]["template"]["spec"]
    [container] = spec["containers"]
    assert container["image"] == "ghcr.io/kvmesh/kvmesh-operator:1.2.3"
    assert "--namespace=team-a" in container["args"] and "--metrics-port=0" in container["args"]
    assert "--verbose" in container["args"] and spec["nodeSelector"] == {"pool": "system"}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["KVMESH_REDIS_IMAGE"] == "redis:7.2" and env["KVMESH_IMAGE"] == "registry.local/kvmesh:0.1.0"
    assert objs["ServiceAccount/kvmesh-system/llm-operator"]


def test_kustomize_base_builds(helm):
    kubectl = find_tool("kubectl")
    if kubectl is None:
        pytest.fail("kubectl not found on PATH or in .tools/bin: run scripts/install_helm.sh")
    objs = [o for o in yaml.safe_load_all(_run(kubectl, "kustomize", str(ROOT / "deploy"))) if o]
    assert sorted(o["kind"] for o in objs) == ["LLMService", "LLMService", "Namespace"]
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] == "LLMService"} == {"kvmesh-serving"}
    [namespace] = [o for o in objs if o["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


LORA_VALUES = {"llmService": {
    "enabled": True, "name": "chat",
    "spec": {"model": {"uri": "pvc://models/llama-3-8b", "name": "llama"}, "decode": {"replicas": 2}},
    "lora": {"enabled": True, "maxLoras": 8, "maxLoraRank": 32, "maxCpuLoras": 16},
    "adapters": [{"name": "sql", "source": "pvc://models/adapters/sql"},
                 {"name": "support", "source": "/models/adapters/support"}],
}}


def test_llmservice_with_lora_adapters(helm, tmp_path, llmservice_schema):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(LORA_VALUES))
    _run(helm, "lint", "--strict", str(CHART), "-f", str(values))
    objs = _template(helm, "-f", str(values))
    llms = objs.pop("LLMService/kvmesh-system/chat")
    validate_builtin(objs.values())
    validate_schema(llms, llmservice_schema)
    assert llms["spec"]["lora"] == {"maxLoras": 8, "maxLoraRank": 32, "maxCpuLoras": 16}
    assert llms["spec"]["adapters"] == LORA_VALUES["llmService"]["adapters"]
    spec = parse_spec(llms["spec"])
    assert [a.name for a in spec.adapters] == ["sql", "support"]
    assert Target("chat", "kvmesh-system", spec).serving_config().engine.lora.max_loras == 8
    # Off by default; adapters without lora fail the render with what to set.
    assert not any(k.startswith("LLMService/") for k in _template(helm))
    proc = subprocess.run([helm, "template", "kvmesh", str(CHART), "--set", "llmService.enabled=true",
                           "--set", "llmService.adapters[0].name=sql", "--set", "llmService.adapters[0].source=/a"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "llmService.lora.enabled=true" in proc.stderr


@pytest.mark.parametrize("values", [[], CUSTOM], ids=["default", "custom"])
def test_operator_pod_meets_the_restricted_profile(helm, values):
    pod = _template(helm, *values)["Deployment/kvmesh-system/kvmesh"]["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []


def test_pull_secrets_and_kuberay_location_reach_the_operator_and_its_pods(helm, monkeypatch):
    objs = _template(helm, "--set", "image.pullSecrets[0]=ghcr", "--set", "image.pullSecrets[1].name=mirror",
                     "--set", "kuberay.namespaceSelector.kubernetes\\.io/metadata\\.name=ray-system",
                     "--set", "driftIntervalSeconds=45")
    validate_builtin(objs.values())
    pod = objs["Deployment/kvmesh-system/kvmesh"]["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "ghcr"}, {"name": "mirror"}]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["KVMESH_DRIFT_INTERVAL_S"] == "45"
    # The operator reads what the chart sets: every Ray pod pulls with the chart's secrets and the
    # head admits KubeRay from the configured namespace.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    objs = render_all(Target("chat", "ml", parse_spec({}), defaults_from_env()))
    cluster = next(o for o in objs if o["kind"] == "RayService")["spec"]["rayClusterConfig"]
    for group in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):
        assert group["template"]["spec"]["imagePullSecrets"] == [{"name": "ghcr"}, {"name": "mirror"}]
    [_, kuberay] = next(o for o in objs if o["metadata"]["name"] == "chat-head")["spec"]["ingress"]
    assert kuberay["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}},
                                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}]
    # The old top-level key fails the render with where it went.
    proc = subprocess.run([helm, "template", "kvmesh", str(CHART), "--set", "imagePullSecrets[0].name=x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "imagePullSecrets moved to image.pullSecrets" in proc.stderr


TP_VALUES = CHART / "ci" / "tensor-parallel-values.yaml"


def test_tensor_parallel_values_render_a_tp2_llmservice(helm, llmservice_schema):
    _run(helm, "lint", "--strict", str(CHART), "-f", str(TP_VALUES))
    objs = _template(helm, "-f", str(TP_VALUES))
    llms = objs.pop("LLMService/kvmesh-serving/llama-70b")
    validate_builtin(objs.values())
    validate_schema(llms, llmservice_schema)
    decode = llms["spec"]["decode"]
    assert decode["parallelism"] == {"tensor": 2, "pipeline": 1} and decode["resources"]["gpu"] == 2
    # What the operator makes of it: the engine's TP size, a 2-GPU pod per replica, STRICT_PACK bundles.
    t = Target("llama-70b", "kvmesh-serving", parse_spec(llms["spec"]))
    assert t.serving_config().engine.parallel.tensor_parallel_size == 2
    rs = next(o for o in render_all(t) if o["kind"] == "RayService")
    [group] = [g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "decode"]
    assert group["rayStartParams"]["num-gpus"] == "2"
    [app] = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    [unified] = [d for d in app["deployments"] if d["name"] == "unified"]
    assert unified["placement_group_strategy"] == "STRICT_PACK" and len(unified["placement_group_bundles"]) == 2


def test_parallelism_values_fill_worker_roles_and_refuse_bad_gpu_counts(helm):
    base = ["--set", "llmService.enabled=true", "--set", "llmService.spec.prefill.replicas=1"]
    objs = _template(helm, *base, "--set", "llmService.parallelism.pipeline=2")
    spec = objs["LLMService/kvmesh-system/kvmesh"]["spec"]
    assert spec["prefill"]["parallelism"] == spec["decode"]["parallelism"] == {"tensor": 1, "pipeline": 2}
    assert "resources" not in spec["decode"]  # gpu: false leaves CPU ranks
    # A role's own parallelism wins over the chart-wide one.
    objs = _template(helm, *base, "--set", "llmService.parallelism.tensor=2",
                     "--set", "llmService.spec.prefill.parallelism.tensor=1")
    spec = objs["LLMService/kvmesh-system/kvmesh"]["spec"]
    assert (spec["prefill"]["parallelism"], spec["decode"]["parallelism"]) == ({"tensor": 1}, {"tensor": 2, "pipeline": 1})
    assert "parallelism" not in _template(helm, "--set", "llmService.enabled=true")[
        "LLMService/kvmesh-system/kvmesh"]["spec"].get("decode", {})
    for extra, message in ((["--set", "llmService.parallelism.gpu=true", "--set", "llmService.parallelism.tensor=2",
                             "--set", "llmService.spec.decode.resources.gpu=1"],
                            "llmService.spec.decode.resources.gpu is 1 but its parallelism runs 2 ranks"),
                           (["--set", "llmService.parallelism.tensor=0"], "must be >= 1")):
        proc = subprocess.run([helm, "template", "kvmesh", str(CHART), *base, *extra],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
