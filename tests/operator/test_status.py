"""Status conditions from KubeRay's RayService status, and the retry policy by cause."""

from __future__ import annotations

from kvmesh_operator import status as st
from kvmesh_operator.handlers import _failure
from kvmesh_operator.k8s import ApiError
from kvmesh_operator.render import Target
from kvmesh_operator.spec import parse_spec

T = Target("chat", "ml", parse_spec({"decode": {"scaling": {"minReplicas": 2, "maxReplicas": 5}}}))
NOW = "2026-01-01T00:00:00Z"


def _conds(patch):
    return {c["type"]: (c["status"], c["reason"]) for c in patch["conditions"]}


def test_missing_and_deploying_rayservice():
    assert _conds(st.from_rayservice(T, None, None, NOW))["Ready"] == ("False", "RayServiceMissing")
    patch = st.from_rayservice(T, {"status": {"serviceStatus": "WaitForServeDeploymentReady"}}, None, NOW)
    assert _conds(patch) == {"Ready": ("False", "Deploying"), "Progressing": ("True", "Deploying"),
                             "Degraded": ("False", "AsExpected")}
    assert patch["endpoints"] is None and patch["roles"]["prefill"] is None


def test_ready_with_upgrade_in_progress_keeps_transition_times():
    rs = {"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "UpgradeInProgress",
                                                                          "status": "True"}],
                     "activeServiceStatus": {"applicationStatuses": {"chat": {"status": "RUNNING",
                         "serveDeploymentStatuses": {"unified": {"status": "HEALTHY"}}}}}}}
    patch = st.from_rayservice(T, rs, None, NOW)
    assert _conds(patch) == {"Ready": ("True", "Serving"), "Progressing": ("True", "Upgrading"),
                             "Degraded": ("False", "AsExpected")}
    assert patch["roles"]["decode"]["ready"] == "2/2-5" and patch["roles"]["decode"]["deployment"] == "unified"
    later = st.from_rayservice(T, rs, patch, "2026-01-02T00:00:00Z")
    assert [c["lastTransitionTime"] for c in later["conditions"]] == [NOW] * 3
    assert not st.changed(patch, later)


def test_reconcile_failure_is_left_to_reconcile():
    failed = st.reconcile_failed("InvalidSpec", "spec.x: bad", 3, None, NOW)
    assert st.is_reconcile_failure(failed) and failed["observedGeneration"] == 3
    assert not st.is_reconcile_failure(st.applied(T, 3, failed, NOW))


def test_retry_policy_by_cause():
    assert _failure(ApiError(404, "ResourceNotServed", "install KubeRay")) == ("KubeRayMissing", False, 60.0)
    assert _failure(ApiError(422, "Invalid", "bad"))[:2] == ("ApplyRejected", True)
    assert _failure(ApiError(503, "ServiceUnavailable", ""))[:2] == ("ApplyFailed", False)
    assert _failure(ApiError(0, "ClientConnectorError", ""))[:2] == ("ApplyFailed", False)
    assert _failure(ApiError(403, "Forbidden", "")) == ("ApplyFailed", False, 30.0)


def test_observed_pods_model_url_and_serving_cluster():
    rs = {"status": {"conditions": [{"type": "Ready", "status": "True"}],
                     "activeServiceStatus": {"rayClusterName": "chat-x7k2p",
                                             "rayClusterStatus": {"desiredWorkerReplicas": 4, "readyWorkerReplicas": 3},
                                             "applicationStatuses": {"chat": {"status": "RUNNING",
                                                 "serveDeploymentStatuses": {"unified": {"status": "HEALTHY"}}}}}}}
    patch = st.from_rayservice(T, rs, None, NOW)
    assert (patch["replicas"], patch["readyReplicas"], patch["pods"]) == (4, 3, "3/4")
    assert (patch["model"], patch["rayCluster"], patch["url"]) == ("chat", "chat-x7k2p", "http://chat-http.ml.svc:8000")
    # Not ready: no URL; KubeRay not reporting pods yet: no counts.
    waiting = st.from_rayservice(T, {"status": {"serviceStatus": "WaitForServeDeploymentReady"}}, patch, NOW)
    assert (waiting["url"], waiting["pods"], waiting["rayCluster"]) == (None, None, None)
    named = Target("chat", "ml", parse_spec({"model": {"name": "llama-3"}}))
    assert st.applied(named, 1, None, NOW)["model"] == "llama-3"
    assert st.reconcile_failed("InvalidSpec", "x", 1, patch, NOW)["url"] is None
