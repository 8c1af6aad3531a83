"""What counts as drift: a rendered field missing or changed in the live object; what others add does not."""

from __future__ import annotations

import copy

import pytest

from kvmesh_operator.drift import MISSING, drifted
from kvmesh_operator.render import Target, render_all
from kvmesh_operator.spec import parse_spec

OWNER = [{"apiVersion": "kvmesh.dev/v1alpha1", "kind": "LLMService", "name": "chat", "uid": "u-1",
          "controller": True, "blockOwnerDeletion": True}]


def _objs() -> dict[str, dict]:
    objs = render_all(Target("chat", "ml", parse_spec({"cache": {"redis": {"managed": True}}})))
    for o in objs:
        o["metadata"]["ownerReferences"] = copy.deepcopy(OWNER)
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def _live(obj: dict) -> dict:
    """What an API server returns for `obj`: its fields plus the ones the server and others add."""
    live = copy.deepcopy(obj)
    live["metadata"].update(uid="x", resourceVersion="7", managedFields=[{"manager": "kvmesh-operator"}])
    live["metadata"]["labels"]["added-by"] = "kustomize"
    live["metadata"]["ownerReferences"].append({"kind": "Other", "uid": "u-2"})
    live["status"] = {"anything": True}
    if obj["kind"] == "Service":
        live["spec"].update(clusterIP="10.0.0.1", sessionAffinity="None")
        live["spec"]["ports"][0]["nodePort"] = None
    if obj["kind"] == "Deployment":
        pod = live["spec"]["template"]["spec"]
        pod["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
        pod["containers"].append({"name": "istio-proxy", "image": "istio"})  # a mutating webhook's sidecar
        pod["dnsPolicy"] = "ClusterFirst"
    return live


def test_drift_none_when_live_holds_everything_rendered_plus_defaults():
    for key, obj in _objs().items():
        assert drifted(obj, _live(obj)) is None, key


def test_drift_deleted_object():
    assert drifted(_objs()["RayService/chat"], None) == MISSING


@pytest.mark.parametrize("key, edit, where", [
    ("Service/chat-grpc", lambda o: o["spec"]["selector"].update({"ray.io/group": "decode"}), "spec.selector"),
    # selectors are compared whole: an extra key narrows what the Service selects
    ("Service/chat-http", lambda o: o["spec"]["selector"].update({"extra": "x"}), "spec.selector"),
    ("Service/chat-grpc", lambda o: o["spec"]["ports"][0].update(port=1), "spec.ports[0].port"),
    ("NetworkPolicy/chat-head", lambda o: o["spec"].update(ingress=[{}]), "spec.ingress"),
    ("NetworkPolicy/chat-head", lambda o: o["spec"]["ingress"][1].pop("ports"), "spec.ingress[1].ports"),
    ("NetworkPolicy/chat-workers", lambda o: o["spec"]["podSelector"].pop("matchExpressions"), "spec.podSelector"),
    ("RayService/chat", lambda o: o["spec"]["rayClusterConfig"]["workerGroupSpecs"][1].update(replicas=0),
     "spec.rayClusterConfig.workerGroupSpecs[1].replicas"),
    ("RayService/chat", lambda o: o["spec"]["rayClusterConfig"]["workerGroupSpecs"].pop(),
     "spec.rayClusterConfig.workerGroupSpecs"),
    ("RayService/chat", lambda o: o["spec"].update(serveConfigV2="applications: []"), "spec.serveConfigV2"),
    ("ConfigMap/chat-config", lambda o: o["data"].pop("serving.yaml"), "data.serving.yaml"),
    ("Deployment/chat-redis", lambda o: o["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(
        privileged=True, allowPrivilegeEscalation=True),
     "spec.template.spec.containers[redis].securityContext.allowPrivilegeEscalation"),
    ("Deployment/chat-redis", lambda o: o["metadata"]["labels"].pop("kvmesh.dev/llmservice"),
     "metadata.labels.kvmesh.dev/llmservice"),
    ("Deployment/chat-redis", lambda o: o["metadata"].update(ownerReferences=[]), "metadata.ownerReferences"),
])
def test_drift_names_the_edited_field(key, edit, where):
    obj = _objs()[key]
    live = _live(obj)
    edit(live)
    assert drifted(obj, live) == where
