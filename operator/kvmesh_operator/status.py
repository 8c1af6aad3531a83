"""`LLMService.status`: conditions (Ready / Progressing / Degraded, and AdaptersReady while
spec.lora is set), endpoints, per-role replicas and per-adapter state, computed purely from
the spec, the previous status, the RayService's status and the router's `/v1/models`
(`probe` fetches it).

Two writers, one owner per reason: the reconcile handler reports spec and apply problems
(`RECONCILE_REASONS`); the status timer reports serving health from KubeRay and leaves
the status alone while a reconcile-owned problem stands (the next reconcile clears it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from kvmesh_operator.mapping import adapters as spec_adapters
from kvmesh_operator.render import Target, endpoints

RECONCILE_REASONS = frozenset({"InvalidSpec", "ApplyFailed", "ApplyRejected", "KubeRayMissing"})
UNHEALTHY = frozenset({"UNHEALTHY", "DEPLOY_FAILED"})


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class Condition(_Status):
    type: Literal["Ready", "Progressing", "Degraded", "AdaptersReady"]
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
    ranks: int | None = Field(None, description="Worker roles: ranks (= GPUs or CPU processes) per replica, "
                              "tensor x pipeline; the router sees one worker per replica.")


class Endpoints(_Status):
    grpc: str | None = Field(None, description="host:port of the kvmesh.v1.LLM gRPC API.")
    http: str | None = Field(None, description="Base URL of the OpenAI-compatible HTTP API.")


class Roles(_Status):
    router: RoleStatus | None = None
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None


class AdapterStatus(_Status):
    name: str
    loaded: bool = Field(description="The router lists the adapter in /v1/models, from the spec's source, "
                         "on at least one worker.")
    workers: int | None = Field(None, description="Workers holding the adapter, as the router reports it; "
                                "unset: the router does not say.")


class LLMServiceStatus(_Status):
    """Observed state of an LLMService."""

    observed_generation: int | None = Field(None, description="metadata.generation the status reflects.")
    mode: Literal["unified", "disaggregated"] | None = None
    model: str | None = Field(None, description="The model name clients send (OpenAI `model`).")
    url: str | None = Field(None, description="Base URL of the OpenAI-compatible HTTP API; set while Ready.")
    ray_service: str | None = Field(None, description="Name of the KubeRay RayService.")
    ray_cluster: str | None = Field(None, description="The RayCluster that serves (KubeRay's active cluster); "
                                    "the Services select its router pods.")
    replicas: int | None = Field(None, description="Ray worker pods KubeRay wants (every role), as it reports.")
    ready_replicas: int | None = Field(None, description="Ray worker pods ready (every role), as KubeRay "
                                       "observes them.")
    pods: str | None = Field(None, description="readyReplicas/replicas, for kubectl get.")
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    endpoints: Endpoints | None = Field(None, description="Set while Ready.")
    roles: Roles | None = None
    adapters: list[AdapterStatus] | None = Field(None, description="spec.adapters as the router serves them "
                                                 "(set while spec.lora is).")


def _cond(kind: str, ok: bool | None, reason: str, message: str, generation: int | None,
          old: list[dict[str, Any]], now: str) -> dict[str, Any]:
    status = "Unknown" if ok is None else "True" if ok else "False"
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
    return {"observedGeneration": generation, "conditions": conditions, "endpoints": None, "url": None}


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
    if t.spec.lora is not None:
        kept = _old_condition(old, "AdaptersReady")
        same = [a.get("name") for a in (old or {}).get("adapters") or []] == [a.name for a in t.spec.adapters]
        value = (True, kept["reason"], kept.get("message", "")) if same and kept.get("status") == "True" else \
            (False, "Syncing", "the router loads the adapters of this generation")
        conditions.append(_cond("AdaptersReady", *value, generation, (old or {}).get("conditions") or [], now))
    return {"observedGeneration": generation, "mode": t.spec.mode, "model": t.model_id, "rayService": t.name,
            "conditions": conditions}


def _old_condition(old: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    return next((c for c in (old or {}).get("conditions") or [] if c.get("type") == kind), {})


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
        ranks = getattr(workload, "world_size", None)  # worker roles only (spec.WorkerSpec)
        out[group] = RoleStatus(deployment=deployment, state=state, replicas=lo, max_replicas=hi,
                                ready_replicas=ready, ready=f"{ready}/{lo}" if lo == hi else f"{ready}/{lo}-{hi}",
                                ranks=ranks).model_dump(by_alias=True, exclude_none=True)
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
    ends = endpoints(t) if ready else None
    return {"mode": t.spec.mode, "model": t.model_id, "rayService": t.name, "rayCluster": active_cluster(rayservice),
            **_pods(rs), "conditions": conditions, "endpoints": ends, "url": ends["http"] if ends else None,
            "roles": roles(t, deployments)}


def active_cluster(rayservice: dict[str, Any] | None) -> str | None:
    """The RayCluster KubeRay serves from, once it names one."""
    active = ((rayservice or {}).get("status") or {}).get("activeServiceStatus") or {}
    return active.get("rayClusterName") or None


def _pods(rs_status: dict[str, Any]) -> dict[str, Any]:
    """replicas / readyReplicas / pods from the active RayCluster's status (None: not reported)."""
    cluster = (rs_status.get("activeServiceStatus") or {}).get("rayClusterStatus") or {}
    want, ready = cluster.get("desiredWorkerReplicas"), cluster.get("readyWorkerReplicas")
    if not isinstance(want, int):
        return {"replicas": None, "readyReplicas": None, "pods": None}
    ready = ready if isinstance(ready, int) else 0
    return {"replicas": want, "readyReplicas": ready, "pods": f"{ready}/{want}"}


# --- adapters ------------------------------------------------------------------------------

def _workers(entry: dict[str, Any]) -> int | None:
    """An adapter's worker count from its /v1/models entry: `workers` as a count or a list of addresses."""
    value = entry.get("workers")
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        return len(value)
    return None


def with_adapters(t: Target, patch: dict[str, Any], models: dict[str, Any] | None,
                  problem: tuple[bool | None, str, str] | None, old: dict[str, Any] | None,
                  now: str) -> dict[str, Any]:
    """`patch` (from from_rayservice) plus status.adapters and the AdaptersReady condition.

    `models`: the router's /v1/models body (OpenAI list; an adapter's entry has its name as
    `id`, vLLM's `parent` / `root` = the base model / the adapter's source, and optionally
    `workers`, a count or a list); None with `problem` = (status, reason, message) when it
    could not be read. Without spec.lora: no adapters and no AdaptersReady."""
    out = dict(patch)
    if t.spec.lora is None:
        out["adapters"] = None
        return out
    wanted = spec_adapters(t.spec)
    generation = (old or {}).get("observedGeneration")
    if models is None:
        previous = {a.get("name"): a for a in (old or {}).get("adapters") or []}
        rows = [AdapterStatus.model_validate(previous[n]) if n in previous else AdapterStatus(name=n, loaded=False)
                for n, _ in wanted]
        value = problem or (False, "ServiceNotReady", "the router does not serve yet")
    else:
        entries = {e["id"]: e for e in models.get("data") or [] if isinstance(e, dict) and isinstance(e.get("id"), str)}
        rows = []
        for name, path in wanted:
            e = entries.get(name)
            workers = _workers(e) if e is not None else 0
            root = (e or {}).get("root")
            loaded = e is not None and (not root or root == path) and workers != 0
            rows.append(AdapterStatus(name=name, loaded=loaded, workers=workers))
        missing = [r.name for r in rows if not r.loaded]
        extra = sorted(n for n, e in entries.items() if e.get("parent") and n not in dict(wanted))
        if missing:
            msg = f"not loaded yet: {', '.join(missing)}"
            if extra:
                msg += f"; still served, being unloaded: {', '.join(extra)}"
            value = (False, "Loading", msg)
        elif extra:
            value = (False, "Unloading", f"still served, being unloaded: {', '.join(extra)}")
        else:
            value = (True, "Loaded" if rows else "NoAdapters",
                     f"{len(rows)} adapter(s) loaded" if rows else "LoRA on, no adapters in spec.adapters")
    conditions = [c for c in out.get("conditions") or [] if c.get("type") != "AdaptersReady"]
    out["conditions"] = [*conditions, _cond("AdaptersReady", *value, generation,
                                             (old or {}).get("conditions") or [], now)]
    out["adapters"] = [r.model_dump(by_alias=True) for r in rows]
    return out


def changed(old: dict[str, Any] | None, patch: dict[str, Any]) -> bool:
    """Whether applying `patch` would change `old` (avoids a write every timer tick)."""
    old = old or {}
    return any(_strip_none(old.get(k)) != _strip_none(v) for k, v in patch.items())


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None} or None
    return value
