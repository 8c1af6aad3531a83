"""Thin, idempotent kopf handlers: parse -> render -> apply, a status timer and a drift timer.

Every decision lives in `spec` (validation), `render` (manifests), `status` (conditions)
and `drift` (what to repair); every API call in `k8s`. Retry policy by cause: an invalid
spec is permanent (fixed by editing the spec, which triggers `update`); API trouble is
temporary.

Owned objects come back on their own: `repair_drift` re-renders an LLMService whose current
generation is applied and re-applies each owned object that was deleted or whose rendered
fields were edited, without touching the LLMService. The status timer moves the Services to
the RayCluster KubeRay serves from as soon as KubeRay switches (`render.router_selector`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime
import json
import logging
import os
from dataclasses import replace
from typing import Any

import kopf

from kvmesh_operator import GROUP, PLURAL, VERSION, drift, k8s, metrics, probe, render, security
from kvmesh_operator import status as st
from kvmesh_operator.spec import SpecError, check_name, parse_spec

RESOURCE = (GROUP, VERSION, PLURAL)
STATUS_INTERVAL_S = float(os.environ.get("KVMESH_STATUS_INTERVAL_S", "15"))
"""How often the status timer reads the RayService (read once, at import)."""
DRIFT_INTERVAL_S = float(os.environ.get("KVMESH_DRIFT_INTERVAL_S", "30"))
"""How often the owned objects are compared with what the operator renders (read once, at import)."""
log = logging.getLogger(__name__)


def _selector_env(name: str, default: dict[str, str]) -> dict[str, str]:
    """A label selector from a JSON object in `name` (Helm passes values as `toJson`)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return dict(default)
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{name}: expected a JSON object of label keys to values, got {raw!r} ({e})") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{name}: expected a JSON object of label keys to string values, got {raw!r}")
    return value


def defaults_from_env() -> render.Defaults:
    """Operator-wide settings from the environment the Helm chart sets (values.yaml documents them)."""
    d = render.Defaults()
    secrets = tuple(n.strip() for n in os.environ.get("KVMESH_IMAGE_PULL_SECRETS", "").split(",") if n.strip())
    kuberay = security.KubeRayPeer(
        namespace_selector=_selector_env("KVMESH_KUBERAY_NAMESPACE_SELECTOR", d.kuberay.namespace_selector),
        pod_selector=_selector_env("KVMESH_KUBERAY_POD_SELECTOR", d.kuberay.pod_selector))
    return render.Defaults(image=os.environ.get("KVMESH_IMAGE", d.image),
                           redis_image=os.environ.get("KVMESH_REDIS_IMAGE", d.redis_image),
                           ray_version=os.environ.get("KVMESH_RAY_VERSION", d.ray_version),
                           image_pull_secrets=secrets, kuberay=kuberay)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _api(memo: Any) -> k8s.Api:
    return memo.setdefault("k8s", k8s.Api())


def _target(name: str, namespace: str, spec: Any, memo: Any) -> render.Target:
    check_name(name)
    parsed = parse_spec(dict(spec) if spec is not None else None)
    t = render.Target(name=name, namespace=namespace, spec=parsed,
                      defaults=memo.setdefault("defaults", defaults_from_env()))
    t.serving_config()  # raises SpecError when kvmesh's own config rejects the combination
    return t


def _failure(e: k8s.ApiError) -> tuple[str, bool, float]:
    """(condition reason, permanent?, retry delay) for an API error."""
    if e.status == 404 and e.reason == "ResourceNotServed":
        return "KubeRayMissing", False, 60.0
    if e.status in (400, 404, 422):
        return "ApplyRejected", True, 0.0
    return "ApplyFailed", False, 30.0 if e.status in (401, 403) else 10.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # Events for problems only, not every success
    # Watch exactly the namespaces given (or all): no namespace / CRD scanning, so no RBAC for them.
    settings.scanning.disabled = True
    # A timer caught mid-run by a deletion stops at its next check of `stopped` (repair_drift checks
    # before every write); look again soon instead of kopf's default minute, so finalizers go promptly.
    settings.background.instant_exit_timeout = 0.5
    settings.background.cancellation_polling = 2.0
    memo.setdefault("defaults", defaults_from_env())
    _api(memo)


@kopf.on.login()
def login(memo: Any, **kwargs: Any) -> kopf.ConnectionInfo:
    """kopf's own in-cluster / kubeconfig login, shared with our API client."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig: cannot reach the cluster")
    _api(memo).use(info)
    return info


@kopf.on.cleanup()
async def close(memo: Any, **_: Any) -> None:
    await _api(memo).close()


async def _delete_owned(api: k8s.Api, api_version: str, plural: str, namespace: str, name: str,
                        uid: str) -> None:
    """Delete an object only if this LLMService (uid) owns it: never a user's look-alike."""
    obj = await api.get(api_version, plural, namespace, name)
    refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
    if any(r.get("uid") == uid for r in refs):
        await api.delete(api_version, plural, namespace, name)


def _children(name: str) -> list[tuple[str, str, str]]:
    names = render.child_names(name)
    return [("ray.io/v1", "rayservices", names["rayservice"]), ("v1", "services", names["grpc"]),
            ("v1", "services", names["http"]), ("v1", "services", names["redis"]),
            ("apps/v1", "deployments", names["redis"]), ("v1", "configmaps", names["configmap"]),
            ("networking.k8s.io/v1", "networkpolicies", names["workers-policy"]),
            ("networking.k8s.io/v1", "networkpolicies", names["head-policy"]),
            ("networking.k8s.io/v1", "networkpolicies", names["redis-policy"]),
            ("v1", "secrets", security.internal_secret_name(name)), ("v1", "secrets", security.redis_secret_name(name))]


async def _prune(api: k8s.Api, t: render.Target, uid: str) -> None:
    """Delete a managed Redis the spec no longer asks for."""
    if render.redis(t):
        return
    name = render.child_names(t.name)["redis"]
    for api_version, plural in (("apps/v1", "deployments"), ("v1", "services")):
        await _delete_owned(api, api_version, plural, t.namespace, name, uid)
    await _delete_owned(api, "networking.k8s.io/v1", "networkpolicies", t.namespace,
                        render.child_names(t.name)["redis-policy"], uid)
    await _delete_owned(api, "v1", "secrets", t.namespace, security.redis_secret_name(t.name), uid)


async def _ensure_secrets(api: k8s.Api, t: render.Target, body: kopf.Body) -> None:
    """Create the generated Secrets that do not exist yet (random values, made once)."""
    for gen in security.generated_secrets(t.name, t.spec):
        if await api.get("v1", "secrets", t.namespace, gen.name) is None:
            obj = security.secret_manifest(gen, t.namespace, render.labels(t, "secret"))
            kopf.adopt(obj, owner=body)
            await api.create(obj)


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
async def reconcile(body: kopf.Body, name: str, namespace: str, spec: kopf.Spec, meta: kopf.Meta,
                    status: kopf.Status, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    generation = meta.get("generation")
    old = dict(status)
    try:
        t = _target(name, namespace, spec, memo)
    except SpecError as e:
        metrics.RECONCILES.labels("invalid").inc()
        patch.status.update(st.reconcile_failed("InvalidSpec", str(e), generation, old, _now()))
        kopf.warn(body, reason="InvalidSpec", message=str(e))
        raise kopf.PermanentError(f"invalid spec: {e}") from None
    api = _api(memo)
    try:
        t = replace(t, active_cluster=st.active_cluster(await _rayservice(api, t)))
        objects = render.render_all(t)
        kopf.adopt(objects, owner=body)
        await _ensure_secrets(api, t, body)
        for obj in objects:
            await api.apply(obj)
        await _prune(api, t, meta["uid"])
    except k8s.ApiError as e:
        reason, permanent, delay = _failure(e)
        metrics.RECONCILES.labels("error").inc()
        patch.status.update(st.reconcile_failed(reason, str(e), generation, old, _now()))
        if permanent:
            kopf.warn(body, reason=reason, message=str(e))
            raise kopf.PermanentError(str(e)) from None
        raise kopf.TemporaryError(str(e), delay=delay) from None
    metrics.RECONCILES.labels("applied").inc()
    patch.status.update(st.applied(t, generation, old, _now()))


async def _rayservice(api: k8s.Api, t: render.Target) -> dict[str, Any] | None:
    return await api.get("ray.io/v1", "rayservices", t.namespace, render.child_names(t.name)["rayservice"])


def _applied(status: dict[str, Any], meta: kopf.Meta) -> bool:
    """Reconcile has applied the current generation (until then the objects are its to write)."""
    return not st.is_reconcile_failure(status) and status.get("observedGeneration") == meta.get("generation")


@kopf.timer(*RESOURCE, interval=STATUS_INTERVAL_S)
async def refresh_status(body: kopf.Body, name: str, namespace: str, spec: kopf.Spec, meta: kopf.Meta,
                         status: kopf.Status, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    """Serving health from the RayService KubeRay maintains; writes only on change. When KubeRay
    switches to another RayCluster, the Services follow it first."""
    old = dict(status)
    if st.is_reconcile_failure(old):
        return
    try:
        t = _target(name, namespace, spec, memo)
    except SpecError:
        return  # reconcile reports it
    api = _api(memo)
    try:
        rayservice = await _rayservice(api, t)
        active = st.active_cluster(rayservice)
        if active is not None and active != old.get("rayCluster") and _applied(old, meta):
            services = [render.grpc_service(replace(t, active_cluster=active)),
                        render.http_service(replace(t, active_cluster=active))]
            kopf.adopt(services, owner=body)
            for obj in services:
                await api.apply(obj)
    except k8s.ApiError as e:
        raise kopf.TemporaryError(f"reading the RayService: {e}", delay=STATUS_INTERVAL_S) from None
    new = st.from_rayservice(t, rayservice, old, _now())
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in new["conditions"])
    if t.spec.lora is not None:
        models, problem = await _models(t, ready, _api(memo))
        new = st.with_adapters(t, new, models, problem, old, _now())
    else:
        new = st.with_adapters(t, new, None, None, old, _now())
    metrics.READY.labels(namespace, name).set(1 if ready else 0)
    if st.changed(old, new):
        patch.status.update(new)


@kopf.timer(*RESOURCE, interval=DRIFT_INTERVAL_S)
async def repair_drift(body: kopf.Body, name: str, namespace: str, spec: kopf.Spec, meta: kopf.Meta,
                       status: kopf.Status, memo: Any, stopped: kopf.DaemonStopped, **_: Any) -> None:
    """Re-apply every owned object that was deleted or edited since reconcile applied it."""
    if not _applied(dict(status), meta) or meta.get("deletionTimestamp"):
        return  # reconcile owns this generation (or reports why it cannot apply it); or it is going away
    try:
        t = _target(name, namespace, spec, memo)
    except SpecError:
        return
    api = _api(memo)
    repaired: list[str] = []
    try:
        rayservice = await _rayservice(api, t)
        t = replace(t, active_cluster=st.active_cluster(rayservice))
        objects = render.render_all(t)
        kopf.adopt(objects, owner=body)
        for obj in objects:
            kind, obj_name = k8s.kind_of(obj), obj["metadata"]["name"]
            live = rayservice if obj["kind"] == "RayService" else \
                await api.get(kind.api_version, kind.plural, namespace, obj_name)
            where = drift.drifted(obj, live)
            if stopped:  # being deleted (or the operator stops): never re-create what the delete handler removes
                return
            if where is not None:
                await api.apply(obj)
                metrics.DRIFT_REPAIRS.labels(obj["kind"]).inc()
                repaired.append(f"{obj['kind']}/{obj_name} ({where})")
        if not stopped:
            await _ensure_secrets(api, t, body)
    except k8s.ApiError as e:
        raise kopf.TemporaryError(f"repairing owned objects: {e}", delay=DRIFT_INTERVAL_S) from None
    if repaired:
        log.warning("LLMService %s/%s: re-applied %s", namespace, name, ", ".join(repaired))


async def _models(t: render.Target, ready: bool, api: k8s.Api
                  ) -> tuple[dict[str, Any] | None, tuple[bool | None, str, str] | None]:
    """(the router's /v1/models, None) or (None, AdaptersReady's (status, reason, message))."""
    if not ready:
        return None, (False, "ServiceNotReady", "the router does not serve yet")
    if t.spec.tls is not None:
        return None, (None, "NotProbed", "the operator does not probe TLS endpoints (it holds no client "
                      "certificate or CA for them); GET /v1/models lists the adapters the router serves")
    key = None
    ref = t.spec.auth.api_key_secret_ref
    if ref is not None:
        try:
            secret = await api.get("v1", "secrets", t.namespace, ref.name)
            key = base64.b64decode(((secret or {}).get("data") or {})[ref.key]).decode()
        except (k8s.ApiError, KeyError, binascii.Error, UnicodeDecodeError) as e:
            return None, (False, "ProbeFailed", f"reading the API key {ref.name}/{ref.key}: {e!r}")
    try:
        return await probe.list_models(probe.base_url(t), key), None
    except probe.ProbeError as e:
        return None, (False, "ProbeFailed", str(e))


@kopf.on.delete(*RESOURCE)
async def delete(name: str, namespace: str, meta: kopf.Meta, memo: Any, **_: Any) -> None:
    """Delete the children now; owner references make Kubernetes do it too, this makes it prompt."""
    api = _api(memo)
    try:
        for api_version, plural, child in _children(name):
            await _delete_owned(api, api_version, plural, namespace, child, meta["uid"])
    except k8s.ApiError as e:
        raise kopf.TemporaryError(f"deleting children: {e}", delay=10) from None
    with contextlib.suppress(KeyError):
        metrics.READY.remove(namespace, name)
