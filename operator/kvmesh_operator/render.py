"""Pure rendering: an `LLMService` spec -> the Kubernetes objects that serve it.

No I/O and no kopf here: every function maps typed input to plain manifests (dicts), so
the output is tested by schema validation alone. Owner references are added by the
handlers (`kopf.adopt`). Objects, all named after the LLMService `<name>`:

    RayService  <name>          head group + one worker group per role (router, [prefill], decode);
                                serveConfigV2 runs kvmesh.serve.app:build with the ServingConfig;
                                spec.adapters go to the router deployment's user_config only
                                (reconfigured in place: no worker template or config changes)
    ConfigMap   <name>-config   the ServingConfig as YAML (what the app runs; for people and tools)
    Service     <name>-grpc     :50051 -> router pods (kvmesh.v1.LLM gRPC)
    Service     <name>-http     :8000  -> router pods (Ray Serve's HTTP proxy, OpenAI API)
    Deployment  <name>-redis    only with spec.cache.redis.managed (with --requirepass)
    Service     <name>-redis    only with spec.cache.redis.managed
    NetworkPolicy <name>-workers, <name>-head, <name>-redis   see `security` (which also names
                                the generated Secrets and the secrets every Ray pod gets)

Every pod meets the restricted Pod Security profile (`pods`); a role's pod options
(`podspec.PodOptions`) and its template patch, merged last, shape its pods.

The Services select router pods the way KubeRay's own serve Service does: `ray.io/serve:
"true"` (KubeRay sets it on the worker pods of a RayService; readiness then gates traffic)
and, once KubeRay names the cluster that serves (`Target.active_cluster`, from the
RayService status), `ray.io/cluster: <that cluster>`. During a zero-downtime upgrade
KubeRay runs a second RayCluster; the Services keep selecting the active one and move when
KubeRay switches, so traffic never spreads over two clusters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvmesh.serve.config import ServingConfig
from kvmesh_operator import GROUP, pods, security
from kvmesh_operator.mapping import (
    REDIS_PORT,
    pvc_claims,
    ray_resource,
    redis_service_name,
    router_user_config,
    to_serving_config,
)
from kvmesh_operator.podspec import PodOptions, ResourcesSpec
from kvmesh_operator.quantity import parse_quantity, ray_cpus
from kvmesh_operator.security import KubeRayPeer
from kvmesh_operator.spec import MODEL_MOUNT, LLMServiceSpec, ParallelismSpec, WorkerSpec, WorkloadSpec

APP_IMPORT_PATH = "kvmesh.serve.app:build"
GRPC_PORT = 50051
HTTP_PORT = 8000
LABEL_SERVICE = f"{GROUP}/llmservice"
LABEL_ROLE = f"{GROUP}/role"
LABEL_TENSOR = f"{GROUP}/tensor-parallel"
LABEL_PIPELINE = f"{GROUP}/pipeline-parallel"
"""On a worker role's pods (and its Ray worker group): the replica's parallelism, so
`kubectl get pods -l kvmesh.dev/tensor-parallel=2` finds the TP groups."""
# Labels KubeRay sets on every Ray pod: its worker group, its RayCluster (a RayService names
# it `<name>-<random>` and replaces it on upgrades) and, on a RayService's worker pods,
# ray.io/serve=true (the head's follows its proxy's health).
RAY_GROUP_LABEL = "ray.io/group"
RAY_CLUSTER_LABEL = "ray.io/cluster"
RAY_SERVE_LABEL = "ray.io/serve"
API_KEY_ENV = pods.API_KEY_ENV
REDIS_UID = 999
"""The `redis` user of the official Redis images."""


@dataclass(frozen=True)
class Defaults:
    """Operator-wide settings (Helm values -> operator env), used where the spec is silent."""

    image: str = "ghcr.io/kvmesh/kvmesh:0.1.0"
    redis_image: str = "redis:7.4-alpine"
    ray_version: str = "2.60.0"
    image_pull_secrets: tuple[str, ...] = ()
    """Secret names every pod pulls its image with, unless spec.imagePullSecrets says otherwise."""
    kuberay: KubeRayPeer = field(default_factory=KubeRayPeer)
    """Where the KubeRay operator runs (the head NetworkPolicy admits it)."""


@dataclass(frozen=True)
class Target:
    """One validated LLMService: what every render function takes."""

    name: str
    namespace: str
    spec: LLMServiceSpec
    defaults: Defaults = field(default_factory=Defaults)
    active_cluster: str | None = None
    """The RayCluster KubeRay serves from (RayService status.activeServiceStatus.rayClusterName);
    None until KubeRay names one. The Services select its pods."""

    @property
    def image(self) -> str:
        return self.spec.image or self.defaults.image

    @property
    def model_id(self) -> str:
        """The model name clients send (spec.model.name, else the LLMService name)."""
        return self.spec.model.name or self.name

    def image_pull_secrets(self) -> list[dict[str, str]]:
        refs = self.spec.image_pull_secrets
        names = [r.name for r in refs] if refs is not None else list(self.defaults.image_pull_secrets)
        return [{"name": n} for n in names]

    def serving_config(self) -> ServingConfig:
        return to_serving_config(self.spec, name=self.name, namespace=self.namespace)


def labels(t: Target, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/instance": t.name,
            "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": "kvmesh-operator",
            LABEL_SERVICE: t.name}


def _meta(t: Target, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": t.namespace, "labels": labels(t, component)}


def child_names(name: str) -> dict[str, str]:
    """The name of every object the operator may own for LLMService `name`, by what it is."""
    return {"rayservice": name, "configmap": f"{name}-config", "grpc": f"{name}-grpc",
            "http": f"{name}-http", "redis": redis_service_name(name), "workers-policy": f"{name}-workers",
            "head-policy": f"{name}-head", "redis-policy": f"{name}-redis"}


def endpoints(t: Target) -> dict[str, str]:
    """In-cluster addresses clients use once the service is Ready."""
    names = child_names(t.name)
    return {"grpc": f"{names['grpc']}.{t.namespace}.svc:{GRPC_PORT}",
            "http": f"http://{names['http']}.{t.namespace}.svc:{HTTP_PORT}"}


# --- pods -----------------------------------------------------------------------------------

def _container_resources(r: ResourcesSpec) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": str(r.cpu), "memory": str(r.memory)}
    if r.gpu:
        amounts["nvidia.com/gpu"] = str(r.gpu)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _api_key_env(t: Target) -> list[dict[str, Any]]:
    ref = t.spec.auth.api_key_secret_ref
    if ref is None:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _model_volumes(t: Target) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for the pvc:// model URIs, read-only at MODEL_MOUNT/<claim>."""
    claims = pvc_claims(t.spec)
    volumes = [{"name": f"model-{i}", "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
               for i, c in enumerate(claims)]
    mounts = [{"name": f"model-{i}", "mountPath": f"{MODEL_MOUNT}/{c}", "readOnly": True}
              for i, c in enumerate(claims)]
    return volumes, mounts


def pod_template(t: Target, group: str, opts: PodOptions, *, ports: list[dict[str, Any]] | None = None,
                 env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A Ray pod: KubeRay injects `ray start`; we give image, resources, placement, volumes, the
    restricted security contexts, then merge the role's template patch over all of it."""
    container: dict[str, Any] = {
        "name": "ray-head" if group == "head" else "ray-worker", "image": t.image,
        "resources": _container_resources(opts.resources),
        # Let in-flight requests drain from the node before the pod goes away.
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
        "securityContext": pods.container_security_context(),
    }
    if ports:
        container["ports"] = ports
    container["env"] = [*(env or []), *security.pod_env(t.name, t.spec),
                        *(e.model_dump(by_alias=True, exclude_none=True) for e in opts.env)]
    spec: dict[str, Any] = {"securityContext": pods.pod_security_context(), "containers": [container]}
    volumes, mounts = security.tls_volume(t.spec)
    if group != "head" and group != "router":
        model_volumes, model_mounts = _model_volumes(t)
        volumes, mounts = [*volumes, *model_volumes], [*mounts, *model_mounts]
    if opts.shm_size is not None:
        shm, shm_mount = pods.shm_volume(str(opts.shm_size))
        volumes, mounts = [*volumes, shm], [*mounts, shm_mount]
    if volumes:
        spec["volumes"], container["volumeMounts"] = volumes, mounts
    spec.update(_placement(opts))
    if t.image_pull_secrets():
        spec["imagePullSecrets"] = t.image_pull_secrets()
    meta: dict[str, Any] = {"labels": {**opts.labels, **labels(t, group), LABEL_ROLE: group,
                                       **parallel_labels(opts)}}
    if opts.annotations:
        meta["annotations"] = dict(opts.annotations)
    template = {"metadata": meta, "spec": spec}
    return pods.merge_template(template, opts.template) if opts.template else template


def parallel_labels(opts: PodOptions) -> dict[str, str]:
    """kvmesh.dev/tensor-parallel and pipeline-parallel of a worker role's pods; none elsewhere."""
    if not isinstance(opts, WorkerSpec):
        return {}
    p = opts.parallelism or ParallelismSpec()
    return {LABEL_TENSOR: str(p.tensor), LABEL_PIPELINE: str(p.pipeline)}


def _placement(opts: PodOptions) -> dict[str, Any]:
    """nodeSelector, tolerations, affinity and the pod's class / account names, where given."""
    out: dict[str, Any] = {}
    if opts.node_selector:
        out["nodeSelector"] = dict(opts.node_selector)
    if opts.tolerations:
        out["tolerations"] = [x.model_dump(by_alias=True, exclude_none=True) for x in opts.tolerations]
    if opts.affinity:
        out["affinity"] = dict(opts.affinity)
    for key, value in (("serviceAccountName", opts.service_account_name),
                       ("priorityClassName", opts.priority_class_name),
                       ("runtimeClassName", opts.runtime_class_name)):
        if value:
            out[key] = value
    return out


def head_group(t: Target) -> dict[str, Any]:
    ports = [{"name": "gcs-server", "containerPort": 6379}, {"name": "dashboard", "containerPort": 8265},
             {"name": "client", "containerPort": 10001}, {"name": "serve", "containerPort": HTTP_PORT}]
    return {
        # num-cpus 0: no kvmesh replica is ever placed on the head (they ask for group resources anyway).
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
        "template": pod_template(t, "head", t.spec.head, ports=ports, env=_api_key_env(t)),
    }


def ray_resources_param(group: str) -> str:
    """rayStartParams.resources: a quoted JSON map, as KubeRay passes it to `ray start --resources`."""
    return '"' + json.dumps({ray_resource(group): 1}).replace('"', '\\"') + '"'


def worker_group(t: Target, group: str, w: WorkloadSpec) -> dict[str, Any]:
    """One role's Ray worker group: one pod per replica, its Ray node offering exactly the
    pod's CPUs and GPUs. A worker replica with tensor x pipeline ranks takes the whole pod
    (resources.gpu = its rank count, validated in spec.WorkerSpec), so its STRICT_PACK
    placement group (mapping._workload) fits the pod and a TP group never crosses nodes."""
    lo, hi = w.bounds()
    params = {"resources": ray_resources_param(group), "num-cpus": str(ray_cpus(w.resources.cpu))}
    if w.resources.gpu:
        params["num-gpus"] = str(w.resources.gpu)
    ports = [{"name": "serve", "containerPort": HTTP_PORT}]
    env: list[dict[str, Any]] = []
    if group == "router":
        ports.insert(0, {"name": "grpc", "containerPort": GRPC_PORT})
        env = _api_key_env(t)
    return {"groupName": group, "replicas": lo, "minReplicas": lo, "maxReplicas": hi, "rayStartParams": params,
            "template": pod_template(t, group, w, ports=ports, env=env)}


# --- objects ----------------------------------------------------------------------------------

def serve_config(cfg: ServingConfig, router_user_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ray Serve's config (serveConfigV2): one application built from the ServingConfig.

    `args` carries the config without placement and `deployments` the per-role replica
    counts / autoscaling / resources (ServingConfig.ray_serve_application), so a changed
    replica count scales in place instead of replacing every replica. `router_user_config`
    (the LoRA adapters, mapping.router_user_config) goes on the router deployment only: a
    change reconfigures the router replicas in place and touches no worker deployment."""
    app = cfg.ray_serve_application(APP_IMPORT_PATH)
    if router_user_config is not None:
        for d in app["deployments"]:
            if d["name"] == "router":
                d["user_config"] = router_user_config
    return {
        # The -http Service selects the router pods. The operator's configs use http_ingress
        # 'ray_proxy' (see mapping.to_serving_config): a proxy on every pod forwards to the
        # router replicas. With 'router' each router replica would listen itself, no proxies.
        "proxy_location": cfg.proxy_location,
        "http_options": {"host": "0.0.0.0", "port": cfg.http_port, **_proxy_tls(cfg)},
        "applications": [app],
    }


def _proxy_tls(cfg: ServingConfig) -> dict[str, str]:
    sec = cfg.security
    if not sec.tls:
        return {}
    out = {"ssl_certfile": sec.tls_cert_file, "ssl_keyfile": sec.tls_key_file}
    if sec.tls_client_ca_file:
        out["ssl_ca_certs"] = sec.tls_client_ca_file
    return out


def rayservice(t: Target, cfg: ServingConfig) -> dict[str, Any]:
    workloads = t.spec.workloads()
    autoscaling = any(w.scaling is not None for w in workloads.values())
    cluster: dict[str, Any] = {
        "rayVersion": t.defaults.ray_version,
        "enableInTreeAutoscaling": autoscaling,
        "headGroupSpec": head_group(t),
        "workerGroupSpecs": [worker_group(t, g, w) for g, w in workloads.items()],
    }
    if autoscaling:  # KubeRay's autoscaler sidecar in the head pod gets only this securityContext
        cluster["autoscalerOptions"] = {"securityContext": pods.container_security_context()}
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": _meta(t, child_names(t.name)["rayservice"], "rayservice"),
        "spec": {"serveConfigV2": yaml.safe_dump(serve_config(cfg, router_user_config(t.spec)), sort_keys=False),
                 "rayClusterConfig": cluster},
    }


def configmap(t: Target, cfg: ServingConfig) -> dict[str, Any]:
    data = {"serving.yaml": yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)}
    user_config = router_user_config(t.spec)
    if user_config is not None:  # the router's user_config (for people and tools; no pod mounts it)
        data["router-user-config.yaml"] = yaml.safe_dump(user_config, sort_keys=False)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(t, child_names(t.name)["configmap"], "config"),
            "data": data}


def router_selector(t: Target) -> dict[str, str]:
    """The router pods of the RayCluster that serves (see the module docstring)."""
    selector = {LABEL_SERVICE: t.name, RAY_GROUP_LABEL: "router", RAY_SERVE_LABEL: "true"}
    if t.active_cluster:
        selector[RAY_CLUSTER_LABEL] = t.active_cluster
    return selector


def _router_service(t: Target, key: str, port: dict[str, Any]) -> dict[str, Any]:
    selector = router_selector(t)
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(t, child_names(t.name)[key], key),
            "spec": {"type": "ClusterIP", "selector": selector, "ports": [port]}}


def grpc_service(t: Target) -> dict[str, Any]:
    return _router_service(t, "grpc", {"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT,
                                       "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"})


def http_service(t: Target) -> dict[str, Any]:
    return _router_service(t, "http", {"name": "http", "port": HTTP_PORT, "targetPort": HTTP_PORT,
                                       "protocol": "TCP"})


def redis(t: Target) -> list[dict[str, Any]]:
    """Managed Redis: LRU under maxMemory, no persistence (a cache: losing it means misses)."""
    spec = t.spec.cache.redis
    if spec is None or not spec.managed:
        return []
    name = child_names(t.name)["redis"]
    cap = int(parse_quantity(spec.max_memory))
    limit = f"{(cap + cap // 4 + (64 << 20)) >> 20}Mi"  # headroom for fragmentation and buffers
    selector = {LABEL_SERVICE: t.name, "app.kubernetes.io/component": "redis"}
    auth_env, auth_args = security.redis_auth(t.name)
    container = {
        "name": "redis", "image": t.defaults.redis_image, "env": auth_env,
        "args": ["--maxmemory", str(cap), "--maxmemory-policy", "allkeys-lru", "--save", "", "--appendonly", "no",
                 *auth_args],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "resources": {"requests": {"cpu": "100m", "memory": limit}, "limits": {"memory": limit}},
        "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 5},
        "securityContext": pods.container_security_context(REDIS_UID),
    }
    pod: dict[str, Any] = {"securityContext": pods.pod_security_context(REDIS_UID), "containers": [container]}
    if t.image_pull_secrets():
        pod["imagePullSecrets"] = t.image_pull_secrets()
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(t, name, "redis"),
        "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": selector},
                 "template": {"metadata": {"labels": labels(t, "redis")}, "spec": pod}},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(t, name, "redis"),
               "spec": {"type": "ClusterIP", "selector": selector,
                        "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": REDIS_PORT}]}}
    return [deployment, service]


def render_all(t: Target) -> list[dict[str, Any]]:
    """Every object this LLMService needs, in apply order (Redis and config before Ray)."""
    cfg = t.serving_config()
    policies = security.network_policies(t.name, t.namespace, t.spec, labels(t, "network-policy"),
                                         t.defaults.kuberay)
    return [configmap(t, cfg), *redis(t), *policies, rayservice(t, cfg), grpc_service(t), http_service(t)]

