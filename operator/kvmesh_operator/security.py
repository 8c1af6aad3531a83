"""Security objects of an `LLMService`, rendered purely from its spec: the Secrets the
operator generates once, the environment and volumes that hand secrets to the Ray pods,
and the NetworkPolicies.

    Secret         <name>-internal     generated unless spec.auth.internalTokenSecretRef is given:
                                       `token` (KVMESH_INTERNAL_TOKEN: every worker RPC must carry it)
                                       and `kvHmacKey` (KVMESH_KV_HMAC_KEY: KV blocks in Redis are signed)
    Secret         <name>-redis-auth   generated with a managed Redis: `password` (--requirepass;
                                       KVMESH_REDIS_PASSWORD in the Ray pods)
    NetworkPolicy  <name>-workers      prefill / decode pods admit only this LLMService's pods
    NetworkPolicy  <name>-head         the Ray head admits this LLMService's pods (GCS 6379, dashboard /
                                       Jobs API 8265, client 10001, and Ray's other ports) and the KubeRay
                                       operator on the dashboard and Serve ports (8265, 8000) only
    NetworkPolicy  <name>-redis        the managed Redis admits only this LLMService's pods, on 6379

Generated Secrets hold random values, so they are not part of `render_all` (an apply
would rotate them on every reconcile): `generated_secrets` names them and the handler
creates the missing ones (`secret_manifest`), once. Secrets the user gives
(apiKeySecretRef, internalTokenSecretRef, tls.secretName) are only referenced.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvmesh_operator import GROUP
from kvmesh_operator.mapping import REDIS_PORT, TLS_MOUNT
from kvmesh_operator.pods import INTERNAL_TOKEN_ENV, KV_HMAC_ENV, REDIS_PASSWORD_ENV
from kvmesh_operator.spec import LLMServiceSpec

LABEL_SERVICE = f"{GROUP}/llmservice"
LABEL_ROLE = f"{GROUP}/role"
WORKER_ROLES = ("prefill", "decode")
KUBERAY_PORTS = (8265, 8000)
"""What the KubeRay operator calls on a head: the dashboard (Serve REST API, Jobs) and the Serve
proxy's health check (it labels the head ray.io/serve from it). It never calls GCS or the client port."""


@dataclass(frozen=True)
class KubeRayPeer:
    """Where the KubeRay operator runs: a NetworkPolicy peer (namespace and pod label selectors)."""

    namespace_selector: dict[str, str] = field(
        default_factory=lambda: {"kubernetes.io/metadata.name": "kuberay-system"})
    pod_selector: dict[str, str] = field(default_factory=lambda: {"app.kubernetes.io/name": "kuberay-operator"})

    def peer(self) -> dict[str, Any]:
        return {"namespaceSelector": {"matchLabels": dict(self.namespace_selector)},
                "podSelector": {"matchLabels": dict(self.pod_selector)}}


@dataclass(frozen=True)
class GeneratedSecret:
    name: str
    keys: tuple[str, ...]


def internal_secret_name(name: str) -> str:
    return f"{name}-internal"


def redis_secret_name(name: str) -> str:
    return f"{name}-redis-auth"


def generated_secrets(name: str, spec: LLMServiceSpec) -> list[GeneratedSecret]:
    """The Secrets the operator creates (once, with random values) for this spec."""
    out = [GeneratedSecret(internal_secret_name(name), ("token", "kvHmacKey"))]
    if spec.cache.redis is not None and spec.cache.redis.managed:
        out.append(GeneratedSecret(redis_secret_name(name), ("password",)))
    return out


def secret_manifest(gen: GeneratedSecret, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """A new Secret with a fresh random value (32 bytes, URL-safe) under each key."""
    data = {k: base64.b64encode(secrets.token_urlsafe(32).encode()).decode() for k in gen.keys}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": gen.name, "namespace": namespace, "labels": labels}, "data": data}


def _from_secret(env: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def pod_env(name: str, spec: LLMServiceSpec) -> list[dict[str, Any]]:
    """Secrets every kvmesh Ray pod gets: the internal token, the KV HMAC key, the Redis password."""
    ref = spec.auth.internal_token_secret_ref
    token = _from_secret(INTERNAL_TOKEN_ENV, ref.name, ref.key) if ref is not None else \
        _from_secret(INTERNAL_TOKEN_ENV, internal_secret_name(name), "token")
    env = [token, _from_secret(KV_HMAC_ENV, internal_secret_name(name), "kvHmacKey")]
    if spec.cache.redis is not None and spec.cache.redis.managed:
        env.append(_from_secret(REDIS_PASSWORD_ENV, redis_secret_name(name), "password"))
    return env


def tls_volume(spec: LLMServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of spec.tls.secretName at TLS_MOUNT (Ray Serve's HTTP proxy runs on every pod)."""
    if spec.tls is None:
        return [], []
    return ([{"name": "kvmesh-tls", "secret": {"secretName": spec.tls.secret_name, "defaultMode": 0o440}}],
            [{"name": "kvmesh-tls", "mountPath": TLS_MOUNT, "readOnly": True}])


def redis_auth(name: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(env, extra args) of the managed Redis container: `--requirepass` from the generated Secret."""
    return ([_from_secret("REDIS_PASSWORD", redis_secret_name(name), "password")],
            ["--requirepass", "$(REDIS_PASSWORD)"])


def _policy(name: str, namespace: str, labels: dict[str, str], selector: dict[str, Any],
            ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress}}


def network_policies(name: str, namespace: str, spec: LLMServiceSpec, labels: dict[str, str],
                     kuberay: KubeRayPeer | None = None) -> list[dict[str, Any]]:
    """Worker pods, the Ray head (and a managed Redis) accept traffic only from this LLMService's pods;
    the head also from the KubeRay operator, on KUBERAY_PORTS.

    The head admits its own cluster on every port: besides GCS (6379), the dashboard (8265) and
    the client server (10001), workers reach the head's raylet, object manager and the Serve
    controller's worker ports, which Ray picks at start. Router pods stay reachable: they serve
    the public gRPC / HTTP endpoints."""
    own = {"podSelector": {"matchLabels": {LABEL_SERVICE: name}}}
    kuberay = kuberay or KubeRayPeer()
    workers = _policy(f"{name}-workers", namespace, labels,
                      {"matchLabels": {LABEL_SERVICE: name},
                       "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(WORKER_ROLES)}]},
                      [{"from": [own]}])
    head = _policy(f"{name}-head", namespace, labels, {"matchLabels": {LABEL_SERVICE: name, LABEL_ROLE: "head"}},
                   [{"from": [own]},
                    {"from": [kuberay.peer()], "ports": [{"protocol": "TCP", "port": p} for p in KUBERAY_PORTS]}])
    out = [workers, head]
    if spec.cache.redis is not None and spec.cache.redis.managed:
        out.append(_policy(f"{name}-redis", namespace, labels,
                           {"matchLabels": {LABEL_SERVICE: name, "app.kubernetes.io/component": "redis"}},
                           [{"from": [own], "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}]))
    return out
