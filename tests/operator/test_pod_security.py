"""Every pod the operator renders meets the restricted Pod Security profile: as rendered, and
as KubeRay builds it (its init container, autoscaler sidecar and /dev/shm volume included)."""

from __future__ import annotations

import pytest
from pod_security import kuberay_pod, restricted_violations

from kvmesh_operator.render import Target, render_all
from kvmesh_operator.spec import parse_spec

SPECS = {
    "minimal": {},
    "disaggregated-gpu-redis-tls": {
        "model": {"uri": "pvc://models/llama", "dtype": "bfloat16"},
        "prefill": {"replicas": 2, "resources": {"cpu": "8", "memory": "48Gi", "gpu": 1}, "shmSize": "8Gi"},
        "decode": {"replicas": 4, "resources": {"cpu": "8", "memory": "48Gi", "gpu": 1}},
        "cache": {"redis": {"managed": True}},
        "tls": {"secretName": "tls"},
        "auth": {"apiKeySecretRef": {"name": "key", "key": "api-key"}},
    },
    "autoscaling-pod-options": {
        "router": {"scaling": {"minReplicas": 1, "maxReplicas": 3}},
        "decode": {"scaling": {"minReplicas": 1, "maxReplicas": 8}, "env": [{"name": "LOG", "value": "debug"}],
                   "serviceAccountName": "ray", "runtimeClassName": "gvisor", "labels": {"team": "ml"},
                   "template": {"spec": {"containers": [{"name": "ray-worker", "stdin": False}]}}},
        "head": {"nodeSelector": {"pool": "system"}, "shmSize": "1Gi"},
    },
}


def _pods(case: str) -> dict[str, tuple[dict, dict]]:
    """{role: (rendered PodSpec, the PodSpec KubeRay builds)} for every pod of the case."""
    objs = render_all(Target("chat", "ml", parse_spec(SPECS[case])))
    cluster = next(o for o in objs if o["kind"] == "RayService")["spec"]["rayClusterConfig"]
    out = {"head": (cluster["headGroupSpec"]["template"]["spec"],
                    kuberay_pod(cluster["headGroupSpec"]["template"], head=True, cluster=cluster))}
    for g in cluster["workerGroupSpecs"]:
        out[g["groupName"]] = (g["template"]["spec"], kuberay_pod(g["template"], head=False, cluster=cluster))
    for o in objs:
        if o["kind"] == "Deployment":
            out[o["metadata"]["name"]] = (o["spec"]["template"]["spec"],) * 2
    return out


@pytest.mark.parametrize("case", SPECS)
def test_every_rendered_pod_meets_the_restricted_profile(case):
    pods = _pods(case)
    assert {"head", "router", "decode"} <= pods.keys()
    for role, (rendered, built) in pods.items():
        assert restricted_violations(rendered) == [], role
        assert restricted_violations(built) == [], f"{role} as KubeRay builds it"
        sc = rendered["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0 and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in rendered["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    if case == "autoscaling-pod-options":  # the sidecar KubeRay adds is covered by autoscalerOptions
        assert [c["name"] for c in pods["head"][1]["containers"]] == ["ray-head", "autoscaler"]
    if case == "disaggregated-gpu-redis-tls":
        assert "chat-redis" in pods and [c["name"] for c in pods["decode"][1]["initContainers"]] == ["wait-gcs-ready"]


def _pod(**spec) -> dict:
    ok = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
          "containers": [{"name": "c", "image": "i", "securityContext": {
              "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}
    for key, value in spec.items():
        if key == "container":
            ok["containers"][0]["securityContext"].update(value)
        elif key == "pod":
            ok["securityContext"].update(value)
        else:
            ok[key] = value
    return ok


@pytest.mark.parametrize("pod, rule", [
    (_pod(hostNetwork=True), "hostNetwork is true"),
    (_pod(hostPID=True), "hostPID is true"),
    (_pod(hostIPC=True), "hostIPC is true"),
    (_pod(volumes=[{"name": "h", "hostPath": {"path": "/"}}]), "volume h: hostPath"),
    (_pod(volumes=[{"name": "n", "nfs": {"server": "x", "path": "/"}}]), "volume n: type ['nfs'] is not allowed"),
    (_pod(container={"privileged": True}), "containers[c]: privileged"),
    (_pod(container={"capabilities": {"drop": ["NET_RAW"]}}), "capabilities.drop does not include ALL"),
    (_pod(container={"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}), "adds capabilities ['SYS_ADMIN']"),
    (_pod(container={"allowPrivilegeEscalation": True}), "allowPrivilegeEscalation is not false"),
    (_pod(pod={"runAsNonRoot": False}), "runAsNonRoot is not true"),
    (_pod(pod={"runAsUser": 0}), "securityContext.runAsUser is 0"),
    (_pod(container={"seccompProfile": {"type": "Unconfined"}}), "seccompProfile.type is Unconfined"),
    (_pod(pod={"seccompProfile": None}), "seccompProfile.type is None"),
    (_pod(containers=[{"name": "c", "ports": [{"containerPort": 80, "hostPort": 80}], "securityContext": {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]), "hostPort 80"),
    (_pod(pod={"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}), "sysctl kernel.msgmax"),
])
def test_restricted_checker_flags_each_rule(pod, rule):
    assert restricted_violations(_pod()) == []
    problems = restricted_violations(pod)
    assert any(rule in p for p in problems), problems


def test_restricted_profile_reaches_kuberays_init_container_through_the_ray_container():
    """KubeRay's init container copies the Ray container's securityContext: drop it and both fail."""
    objs = render_all(Target("chat", "ml", parse_spec({})))
    cluster = next(o for o in objs if o["kind"] == "RayService")["spec"]["rayClusterConfig"]
    template = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}["decode"]["template"]
    del template["spec"]["containers"][0]["securityContext"]
    problems = restricted_violations(kuberay_pod(template, head=False, cluster=cluster))
    assert any(p.startswith("initContainers[wait-gcs-ready]") for p in problems)
    assert any(p.startswith("containers[ray-worker]") for p in problems)
