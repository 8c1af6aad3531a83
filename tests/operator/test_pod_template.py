"""The pod surface of each role: pod options, the template patch merged last, image pull
secrets, and the limits the spec refuses with a message that says what to change."""

from __future__ import annotations

import pytest
import yaml
from k8s_helpers import CRD_FILE, validate_builtin, validate_schema
from pod_security import kuberay_pod, restricted_violations

from kvmesh_operator.pods import merge_template
from kvmesh_operator.render import Defaults, Target, render_all
from kvmesh_operator.spec import SpecError, parse_spec

TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["head"]}]}]}}}


def _cluster(spec: dict, defaults: Defaults | None = None) -> tuple[dict, dict[str, dict]]:
    """(rayClusterConfig, {role: pod template}) of the rendered RayService."""
    t = Target("chat", "ml", parse_spec(spec), defaults or Defaults())
    cluster = next(o for o in render_all(t) if o["kind"] == "RayService")["spec"]["rayClusterConfig"]
    templates = {g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}
    templates["head"] = cluster["headGroupSpec"]["template"]
    return cluster, templates


def test_pod_template_patch_lands_in_rendered_pods(rayservice_schema):
    spec = {"decode": {"replicas": 2, "template": {
        "metadata": {"annotations": {"prometheus.io/scrape": "true"}, "labels": {"team": "ml"}},
        "spec": {
            "containers": [
                # merged into kvmesh's container by name: a new env var, the preStop hook removed
                {"name": "ray-worker", "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}], "lifecycle": None,
                 "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]},
                # a new container is appended after the Ray container (KubeRay wants it first)
                {"name": "log-shipper", "image": "fluent-bit:3", "securityContext": {
                    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}}],
            "tolerations": [TOLERATION],
            "terminationGracePeriodSeconds": 120}}},
        "head": {"template": {"spec": {"containers": [{"name": "ray-head", "imagePullPolicy": "Always"}]}}}}
    cluster, pods = _cluster(spec)
    decode = pods["decode"]
    assert decode["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    assert decode["metadata"]["labels"]["team"] == "ml" and decode["metadata"]["labels"]["kvmesh.dev/role"] == "decode"
    ray, shipper = decode["spec"]["containers"]
    assert (ray["name"], shipper["name"]) == ("ray-worker", "log-shipper")
    env = {e["name"]: e for e in ray["env"]}
    assert env["HF_HUB_OFFLINE"] == {"name": "HF_HUB_OFFLINE", "value": "1"}
    assert "KVMESH_INTERNAL_TOKEN" in env  # the operator's env is kept
    assert "lifecycle" not in ray and ray["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "cache", "mountPath": "/cache"} in ray["volumeMounts"]
    assert decode["spec"]["volumes"][-1] == {"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}}
    assert decode["spec"]["tolerations"] == [TOLERATION] and decode["spec"]["terminationGracePeriodSeconds"] == 120
    assert pods["head"]["spec"]["containers"][0]["imagePullPolicy"] == "Always"
    assert "imagePullPolicy" not in pods["router"]["spec"]["containers"][0]  # a role's patch is its own
    validate_schema(next(o for o in render_all(Target("chat", "ml", parse_spec(spec))) if o["kind"] == "RayService"),
                    rayservice_schema)
    assert restricted_violations(kuberay_pod(decode, head=False, cluster=cluster)) == []


def test_pod_options_render_on_every_role(rayservice_schema):
    spec = {
        "imagePullSecrets": [{"name": "registry"}],
        "head": {"nodeSelector": {"pool": "head"}, "tolerations": [TOLERATION], "affinity": AFFINITY,
                 "shmSize": "2Gi", "priorityClassName": "system-cluster-critical"},
        "decode": {"resources": {"memory": "16Gi", "gpu": 1}, "shmSize": "4Gi", "serviceAccountName": "workers",
                   "runtimeClassName": "nvidia", "env": [{"name": "NCCL_DEBUG", "value": "INFO"},
                                                         {"name": "POD_IP", "valueFrom": {"fieldRef": {
                                                             "fieldPath": "status.podIP"}}}],
                   "labels": {"cost-center": "llm"}, "annotations": {"owner": "ml-platform"}},
        "cache": {"redis": {"managed": True}},
    }
    cluster, pods = _cluster(spec)
    head, decode = pods["head"]["spec"], pods["decode"]["spec"]
    assert (head["nodeSelector"], head["tolerations"], head["affinity"]) == ({"pool": "head"}, [TOLERATION], AFFINITY)
    assert head["priorityClassName"] == "system-cluster-critical"
    for pod, size in ((head, "2Gi"), (decode, "4Gi")):
        assert {"name": "shared-mem", "emptyDir": {"medium": "Memory", "sizeLimit": size}} in pod["volumes"]
        assert {"name": "shared-mem", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    # KubeRay adds no second /dev/shm where the pod mounts one.
    built = kuberay_pod(pods["decode"], head=False, cluster=cluster)
    assert [v["name"] for v in built["volumes"]].count("shared-mem") == 1
    assert (decode["serviceAccountName"], decode["runtimeClassName"]) == ("workers", "nvidia")
    env = decode["containers"][0]["env"]
    assert env[-2:] == [{"name": "NCCL_DEBUG", "value": "INFO"},
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert pods["decode"]["metadata"]["labels"]["cost-center"] == "llm"
    assert pods["decode"]["metadata"]["annotations"] == {"owner": "ml-platform"}
    assert "serviceAccountName" not in pods["router"]["spec"] and "affinity" not in pods["router"]["spec"]
    objs = render_all(Target("chat", "ml", parse_spec(spec)))
    redis = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    for pod in (*(p["spec"] for p in pods.values()), redis):
        assert pod["imagePullSecrets"] == [{"name": "registry"}]
    validate_schema(next(o for o in objs if o["kind"] == "RayService"), rayservice_schema)
    validate_builtin(o for o in objs if o["kind"] != "RayService")


def test_image_pull_secrets_default_to_the_operators():
    defaults = Defaults(image_pull_secrets=("ghcr", "mirror"))
    _, pods = _cluster({}, defaults)
    assert all(p["spec"]["imagePullSecrets"] == [{"name": "ghcr"}, {"name": "mirror"}] for p in pods.values())
    _, pods = _cluster({"imagePullSecrets": [{"name": "own"}]}, defaults)
    assert all(p["spec"]["imagePullSecrets"] == [{"name": "own"}] for p in pods.values())
    _, pods = _cluster({})
    assert all("imagePullSecrets" not in p["spec"] for p in pods.values())


def test_merge_template_merges_like_a_strategic_merge_patch():
    base = {"metadata": {"labels": {"a": "1"}},
            "spec": {"containers": [{"name": "ray", "image": "x", "ports": [{"containerPort": 8000, "name": "serve"}],
                                     "env": [{"name": "A", "value": "1"}]}],
                     "tolerations": [{"key": "old"}], "nodeSelector": {"pool": "a"}}}
    patch = {"metadata": {"labels": {"b": "2"}},
             "spec": {"containers": [{"name": "ray", "ports": [{"containerPort": 8000, "protocol": "TCP"}],
                                      "env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]}],
                      "tolerations": [{"key": "new"}], "nodeSelector": None}}
    merged = merge_template(base, patch)
    assert merged == {"metadata": {"labels": {"a": "1", "b": "2"}},
                      "spec": {"containers": [{"name": "ray", "image": "x",
                                               "ports": [{"containerPort": 8000, "name": "serve", "protocol": "TCP"}],
                                               "env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]}],
                               "tolerations": [{"key": "new"}]}}
    assert base["spec"]["nodeSelector"] == {"pool": "a"}  # inputs are not modified


@pytest.mark.parametrize("raw, message", [
    ({"decode": {"resources": {"gpu": 2}}},
     "spec.decode: resources.gpu 2 with parallelism tensor 1 x pipeline 1: each replica runs 1 rank, one GPU each"),
    ({"prefill": {"resources": {"gpu": 16}}}, "spec.prefill.resources.gpu: 16 GPUs: at most 8 GPUs per pod"),
    ({"decode": {"parallelism": {"tensor": 2}, "resources": {"gpu": 1}}},
     "give resources.gpu: 2 (or 0 for CPU ranks), or set parallelism so that tensor x pipeline = 1"),
    ({"decode": {"parallelism": {"tensor": 0}}}, "spec.decode.parallelism.tensor: Input should be greater than or equal to 1"),
    ({"decode": {"parallelism": {"pipeline": "two"}}}, "spec.decode.parallelism.pipeline: Input should be a valid integer"),
    ({"router": {"parallelism": {"tensor": 2}}}, "spec.router.parallelism: Extra inputs are not permitted"),
    ({"decode": {"shmSize": "8Gi"}}, "spec.decode: shmSize 8Gi is more than resources.memory 4Gi"),
    ({"head": {"labels": {"kvmesh.dev/role": "x"}}}, "spec.head.labels: kvmesh.dev/role: set by the operator"),
    ({"router": {"labels": {"app.kubernetes.io/instance": "x"}}}, "spec.router.labels: app.kubernetes.io/instance"),
    ({"decode": {"env": [{"name": "KVMESH_INTERNAL_TOKEN", "value": "x"}]}},
     "spec.decode.env: KVMESH_INTERNAL_TOKEN: set by the operator"),
    ({"decode": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}}, "repeated: A"),
    ({"decode": {"env": [{"name": "A", "value": "1", "valueFrom": {}}]}}, "give value or valueFrom, not both"),
    ({"decode": {"template": {"spec": {"containers": [{"image": "x"}]}}}},
     "spec.decode.template: spec.containers[0]: give its name"),
    ({"decode": {"template": {"spec": {"containers": [{"name": "ray-worker", "volumeMounts": [{"name": "v"}]}]}}}},
     "spec.containers[0].volumeMounts[0]: give its mountPath"),
    ({"head": {"template": {"kind": "Pod"}}}, "spec.head.template: kind: a pod template has only metadata and spec"),
    ({"head": {"template": {"metadata": {"name": "x"}}}}, "metadata.name: a pod template's metadata takes only"),
    ({"decode": {"template": {"metadata": {"labels": {"ray.io/group": "x"}}}}},
     "spec.decode.template: metadata.labels.ray.io/group: set by the operator or KubeRay"),
    ({"imagePullSecrets": [{"name": ""}]}, "spec.imagePullSecrets.0.name"),
])
def test_pod_template_and_options_errors_name_the_field(raw, message):
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert message in str(err.value)


def test_crd_gpus_and_parallelism(llmservice_schema):
    def obj(decode):
        return {"apiVersion": "kvmesh.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "x"},
                "spec": {"decode": decode}}

    validate_schema(obj({"resources": {"gpu": 8}}), llmservice_schema)
    validate_schema(obj({"parallelism": {"tensor": 2, "pipeline": 2}, "resources": {"gpu": 4}}), llmservice_schema)
    with pytest.raises(AssertionError, match="spec.decode.resources.gpu"):
        validate_schema(obj({"resources": {"gpu": 9}}), llmservice_schema)
    for bad in (0, -1, "2", 1.5):
        with pytest.raises(AssertionError, match="spec.decode.parallelism.tensor"):
            validate_schema(obj({"parallelism": {"tensor": bad}}), llmservice_schema)
    with pytest.raises(AssertionError, match="spec.decode.parallelism"):
        validate_schema(obj({"parallelism": {"pipeline": 0}}), llmservice_schema)
    decode = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"]["spec"]["properties"]["decode"]
    assert decode["properties"]["resources"]["properties"]["gpu"]["maximum"] == 8
    assert decode["properties"]["parallelism"]["properties"]["tensor"]["minimum"] == 1
    # The API server (CEL) refuses a GPU count that is not the replica's rank count, saying why.
    rules = {r["rule"]: r["message"] for r in decode["x-kubernetes-validations"]}
    [gpu_rule] = [r for r in rules if "parallelism.tensor * self.parallelism.pipeline" in r]
    assert "each rank of a replica runs on its own GPU" in rules[gpu_rule]
    assert "parallelism" not in yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]["properties"]
