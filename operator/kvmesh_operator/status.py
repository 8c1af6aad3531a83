"""`LLMService.status`: conditions (Ready / Progressing / Degraded), endpoints and per-role
replicas, computed purely from the spec, the previous status and the RayService's status.

Two writers, one owner per reason: the reconcile handler reports spec and apply problems
(`RECONCILE_REASONS`); the status timer reports serving health from KubeRay and leaves
the status alone while a reconcile-owned problem stands (the next reconcile clears it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from kvmesh_operator.render import Target, endpoints

RECONCILE_REASONS = frozenset({"InvalidSpec", "ApplyFailed", "ApplyRejected", "KubeRayMissing"})
UNHEALTHY = frozenset({"UNHEALTHY", "DEPLOY_FAILED"})


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class Condition(_Status):
    type: Literal["Ready", "Progressing", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase cause, e.g. Serving, Deploying, InvalidSpec.")
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class RoleStatus(_Status):
    deployment: str = Field(description="Ray Serve deployment: router, prefill, decode or unified.")
    state: str = Field(description="Ray Serve deployment status (HEALTHY, UPDATING, ...) or Unknown.")
    replicas: int = Field(description="Desired replicas (the minimum when autoscaling).")
    max_replicas: int
    ready_replicas: int = Field(description="Replicas serving: all desired ones once Serve reports the "
                                "deployment HEALTHY (a lower bound when autoscaling), else 0.")
    ready: str = Field(description="readyReplicas/replicas, for kubectl get.")


class Endpoints(_Status):
    grpc: str | None = Field(None, description="host:port of the kvmesh.v1.LLM gRPC API.")
    http: str | None = Field(None, description="Base URL of the OpenAI-compatible HTTP API.")


class Roles(_Status):
    router: RoleStatus | None = None
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None


class LLMServiceStatus(_Status):
    """Observed state of an LLMService."""

    observed_generation: int | None = Field(None, description="metadata.generation the status reflects.")
    mode: Literal["unified", "disaggregated"] | None = None
    ray_service: str | None = Field(None, description="Name of the KubeRay RayService.")
    conditions: list[Condition] = Field(default_factory=list)
    endpoints: Endpoints | None = Field(None, description="Set while Ready.")
    roles: Roles | None = None


def _cond(kind: str, ok: bool, reason: str, message: str, generation: int | None,
          old: list[dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    prev = next((c for c in old if c.get("type") == kind), None)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == status else None
    return Condition(type=kind, status=status, reason=reason, message=message, observed_generation=generation,
                     last_transition_time=since or now).model_dump(by_alias=True, exclude_none=True)


def _conditions(old_status: dict[str, Any] | None, generation: int | None, now: str,
                ready: tuple[bool, str, str], progressing: tuple[bool, str, str],
                degraded: tuple[bool, str, str]) -> list[dict[str, Any]]:
    old = list((old_status or {}).get("conditions") or [])
    return [_cond(kind, *value, generation, old, now)
            for kind, value in (("Ready", ready), ("Progressing", progressing), ("Degraded", degraded))]


def reconcile_failed(reason: str, message: str, generation: int | None, old: dict[str, Any] | None,
                     now: str) -> dict[str, Any]:
    """Status patch for a spec or apply problem (reason in RECONCILE_REASONS)."""
    conditions = _conditions(old, generation, now, (False, reason, message), (False, reason, message),
                             (True, reason, message))
    return {"observedGeneration": generation, "conditions": conditions, "endpoints": None}


def is_reconcile_failure(status: dict[str, Any] | None) -> bool:
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == "Degraded" and c.get("status") == "True" and c.get("reason") in RECONCILE_REASONS:
            return True
    return False


def applied(t: Target, generation: int | None, old: dict[str, Any] | None, now: str) -> dict[str, Any]:
    """Status patch once every object is applied: serving (if it was) and progressing."""
    was_ready = any(c.get("type") == "Ready" and c.get("status") == "True" and c.get("reason") == "Serving"
                    for c in (old or {}).get("conditions") or [])
    msg = "objects applied; waiting for the RayService to serve this generation"
    ready = (True, "Serving", "the previous generation serves") if was_ready else (False, "Deploying", msg)
    conditions = _conditions(old, generation, now, ready, (True, "Deploying", msg), (False, "AsExpected", ""))
    return {"observedGeneration": generation, "mode": t.spec.mode, "rayService": t.name, "conditions": conditions}


def _deployments(rs_status: dict[str, Any], app: str) -> tuple[str | None, dict[str, dict[str, Any]]]:
    apps = (rs_status.get("activeServiceStatus") or {}).get("applicationStatuses") or {}
    entry = apps.get(app) or {}
    return entry.get("status"), entry.get("serveDeploymentStatuses") or {}


def _is_true(rs_status: dict[str, Any], kind: str) -> bool | None:
    for c in rs_status.get("conditions") or []:
        if c.get("type") == kind:
            return c.get("status") == "True"
    return None


def roles(t: Target, deployments: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per worker group: Serve deployment state and replica counts (None removes a role)."""
    out: dict[str, Any] = {"router": None, "prefill": None, "decode": None}
    for group, workload in t.spec.workloads().items():
        deployment = "unified" if group == "decode" and t.spec.prefill is None else group
        state = str((deployments.get(deployment) or {}).get("status") or "Unknown")
        lo, hi = workload.bounds()
        ready = lo if state == "HEALTHY" else 0
        out[group] = RoleStatus(deployment=deployment, state=state, replicas=lo, max_replicas=hi,
                                ready_replicas=ready, ready=f"{ready}/{lo}" if lo == hi else f"{ready}/{lo}-{hi}",
                                ).model_dump(by_alias=True)
    return out


def from_rayservice(t: Target, rayservice: dict[str, Any] | None, old: dict[str, Any] | None,
                    now: str) -> dict[str, Any]:
    """Status patch from the RayService KubeRay maintains (None: not created yet)."""
    generation = (old or {}).get("observedGeneration")
    rs = (rayservice or {}).get("status") or {}
    app_state, deployments = _deployments(rs, t.name)
    cluster_ready = _is_true(rs, "Ready")
    if cluster_ready is None:  # KubeRay before the Ready condition
        cluster_ready = rs.get("serviceStatus") == "Running"
    broken = {d: s for d, s in deployments.items() if s.get("status") in UNHEALTHY}
    degraded = app_state in UNHEALTHY or bool(broken)
    ready = bool(cluster_ready) and app_state == "RUNNING" and not degraded
    upgrading = bool(_is_true(rs, "UpgradeInProgress")) or bool(
        (rs.get("pendingServiceStatus") or {}).get("rayClusterName"))
    if degraded:
        detail = "; ".join(f"{d}: {s.get('status')} {s.get('message', '')}".strip() for d, s in broken.items())
        why = (True, "DeploymentUnhealthy", detail or f"application {app_state}")
    else:
        why = (False, "AsExpected", "")
    if rayservice is None:
        waiting = (False, "RayServiceMissing", "the RayService does not exist yet")
    else:
        waiting = (False, "Deploying", f"RayService not ready (application {app_state or 'not deployed'})")
    conditions = _conditions(
        old, generation, now,
        ready=(True, "Serving", "all deployments healthy") if ready else (why if degraded else waiting),
        progressing=(True, "Upgrading", "KubeRay is rolling a new Ray cluster") if upgrading else
        ((False, "Serving", "") if ready else (not degraded, "Deploying" if not degraded else "Stalled", "")),
        degraded=why)
    return {"mode": t.spec.mode, "rayService": t.name, "conditions": conditions,
            "endpoints": endpoints(t) if ready else None, "roles": roles(t, deployments)}


def changed(old: dict[str, Any] | None, patch: dict[str, Any]) -> bool:
    """Whether applying `patch` would change `old` (avoids a write every timer tick)."""
    old = old or {}
    return any(_strip_none(old.get(k)) != _strip_none(v) for k, v in patch.items())


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None} or None
    return value
