"""The operator's only Kubernetes API I/O: get, apply (server-side apply) and delete.

Built on `kubernetes_asyncio`, the official Kubernetes client generated for asyncio (on
aiohttp): kopf's handlers are coroutines, so an API call never blocks kopf's event loop
or holds a thread, as the synchronous `kubernetes` client would. kopf's own API client
is private (`kopf._cogs`), so it is not used.

Server-side apply needs no hand-built request: the typed `patch_namespaced_*` calls take
`_content_type="application/apply-patch+yaml"` with `field_manager` and `force`, and the
client sends the body as JSON (valid YAML) for that content type. Built-in kinds go
through their typed APIs (CoreV1Api, AppsV1Api) and come back as plain dicts with the
API's camelCase keys; the RayService goes through CustomObjectsApi. `KINDS` lists every
kind the operator writes.

The client is configured from the same `kopf.ConnectionInfo` kopf logs in with (the
login handler hands it over), so kopf and this client always use one identity. Errors
are `ApiError`s carrying the HTTP status; `handlers` maps them to kopf's retry policy.
"""

from __future__ import annotations

import base64
import json
import tempfile
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf
from kubernetes_asyncio import client

FIELD_MANAGER = "kvmesh-operator"
APPLY_PATCH = "application/apply-patch+yaml"


@dataclass(frozen=True)
class Kind:
    """A kind the operator writes. Built-in kinds name their typed API and the resource
    in its method names (`patch_namespaced_<method_suffix>`); custom kinds have neither
    and go through CustomObjectsApi by group, version and plural."""

    api_version: str
    kind: str
    plural: str
    api: type | None = None
    method_suffix: str = ""


KINDS = (
    Kind("v1", "ConfigMap", "configmaps", client.CoreV1Api, "config_map"),
    Kind("v1", "Service", "services", client.CoreV1Api, "service"),
    Kind("apps/v1", "Deployment", "deployments", client.AppsV1Api, "deployment"),
    Kind("v1", "Secret", "secrets", client.CoreV1Api, "secret"),
    Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies", client.NetworkingV1Api, "network_policy"),
    Kind("ray.io/v1", "RayService", "rayservices"),
)
_BY_KIND = {(k.api_version, k.kind): k for k in KINDS}
_BY_PLURAL = {(k.api_version, k.plural): k for k in KINDS}


@dataclass
class ApiError(Exception):
    """A failed API call: `status` is the HTTP status (0 when the server was unreachable)."""

    status: int
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.status} {self.reason}: {self.message}"


def kind_of(obj: dict[str, Any]) -> Kind:
    key = (obj["apiVersion"], obj["kind"])
    if key not in _BY_KIND:
        raise ValueError(f"the operator does not manage {key[1]} ({key[0]})")
    return _BY_KIND[key]


def _kind_by_plural(api_version: str, plural: str) -> Kind:
    if (api_version, plural) not in _BY_PLURAL:
        raise ValueError(f"the operator does not manage {plural} ({api_version})")
    return _BY_PLURAL[api_version, plural]


_TEMPFILES: dict[bytes, str] = {}


def _tempfile(data: str) -> str:
    """A file holding base64 `data` (the client loads CA and client certificates from files only)."""
    raw = base64.b64decode(data)
    if raw not in _TEMPFILES:
        with tempfile.NamedTemporaryFile(delete=False, prefix="kvmesh-operator-") as f:
            f.write(raw)
        _TEMPFILES[raw] = f.name
    return _TEMPFILES[raw]


def configuration(info: kopf.ConnectionInfo) -> client.Configuration:
    """The client's configuration for kopf's credentials.

    One difference from kopf's own client: kubernetes_asyncio always honours the
    HTTP(S)_PROXY / NO_PROXY environment variables (kopf only with `trust_env`)."""
    cfg = client.Configuration(host=info.server.rstrip("/"))
    # Responses are deserialized into typed models only to be turned back into dicts:
    # a field the model calls required but a server (or emulator) omits must not fail the call.
    cfg.client_side_validation = False
    cfg.verify_ssl = not info.insecure
    cfg.ssl_ca_cert = info.ca_path or (_tempfile(info.ca_data) if info.ca_data else None)
    if info.certificate_data and info.private_key_data:
        cfg.cert_file, cfg.key_file = _tempfile(info.certificate_data), _tempfile(info.private_key_data)
    else:
        cfg.cert_file, cfg.key_file = info.certificate_path, info.private_key_path
    if info.token:
        cfg.api_key["BearerToken"] = f"{info.scheme or 'Bearer'} {info.token}"
    elif info.username and info.password:
        basic = base64.b64encode(f"{info.username}:{info.password}".encode()).decode()
        cfg.api_key["BearerToken"] = f"Basic {basic}"  # the client's only auth header slot
    cfg.proxy = info.proxy_url
    return cfg


def _error(e: client.ApiException) -> ApiError:
    text = e.body.decode(errors="replace") if isinstance(e.body, bytes) else str(e.body or "")
    try:
        payload = json.loads(text) if text else {}
    except ValueError:
        payload = {}
    if not isinstance(payload, dict):
        payload = {}
    return ApiError(e.status or 0, str(payload.get("reason") or e.reason),
                    str(payload.get("message") or text[:500]))


class Api:
    """Kubernetes API client; `use()` (re)points it at a cluster, e.g. after kopf re-logins."""

    def __init__(self, info: kopf.ConnectionInfo | None = None, timeout_s: float = 30.0) -> None:
        self._info = info
        self._timeout_s = timeout_s
        self._client: client.ApiClient | None = None
        self._stale: list[client.ApiClient] = []

    def use(self, info: kopf.ConnectionInfo) -> None:
        # Called from kopf's login handler, which may run outside the event loop: the
        # client (an aiohttp session) is opened lazily, inside a coroutine.
        self._info = info
        if self._client is not None:
            self._stale.append(self._client)
            self._client = None

    def _open(self) -> client.ApiClient:
        if self._info is None:
            raise ApiError(0, "NotLoggedIn", "no cluster credentials yet (kopf login has not run)")
        if self._client is None:
            self._client = client.ApiClient(configuration(self._info))
            self._client.user_agent = FIELD_MANAGER
        return self._client

    async def close(self) -> None:
        for c in [*self._stale, *([self._client] if self._client else [])]:
            await c.close()
        self._stale, self._client = [], None

    async def _call(self, kind: Kind, verb: str, namespace: str, **kwargs: Any) -> dict[str, Any]:
        """`verb` (read, patch, create, delete) on `kind` with the method's keyword arguments;
        the response as a plain dict."""
        api_client = self._open()
        if kind.api is None:
            group, version = kind.api_version.split("/")
            custom_verb = "get" if verb == "read" else verb
            method = getattr(client.CustomObjectsApi(api_client), f"{custom_verb}_namespaced_custom_object")
            kwargs.update(group=group, version=version, plural=kind.plural)
        else:
            method = getattr(kind.api(api_client), f"{verb}_namespaced_{kind.method_suffix}")
        where = f"{verb} {kind.kind} {namespace}/{kwargs.get('name', '')}"
        try:
            out = await method(namespace=namespace, _request_timeout=self._timeout_s, **kwargs)
        except client.ApiException as e:
            raise _error(e) from e
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ApiError(0, type(e).__name__, f"{where}: {e}") from e
        return api_client.sanitize_for_serialization(out) or {}

    async def get(self, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self._call(_kind_by_plural(api_version, plural), "read", namespace, name=name)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or update `obj` in place (server-side apply: same object, same uid)."""
        kind, meta = kind_of(obj), obj["metadata"]
        try:
            return await self._call(kind, "patch", meta["namespace"], name=meta["name"], body=obj,
                                    field_manager=FIELD_MANAGER, force=True, _content_type=APPLY_PATCH)
        except ApiError as e:
            if e.status != 404:
                raise
        # Servers without create-on-apply (API emulators) answer 404 for a new object: create it.
        try:
            return await self._call(kind, "create", meta["namespace"], body=obj, field_manager=FIELD_MANAGER)
        except ApiError as e:
            if e.status == 404:
                raise ApiError(404, "ResourceNotServed",
                               f"the API server does not serve {obj['kind']} ({obj['apiVersion']})"
                               + ("; install KubeRay first" if obj["apiVersion"].startswith("ray.io/") else "")
                               ) from e
            raise

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless an object of that name exists (never overwrites: generated
        Secrets keep their first value). True when created."""
        kind, meta = kind_of(obj), obj["metadata"]
        try:
            await self._call(kind, "create", meta["namespace"], body=obj, field_manager=FIELD_MANAGER)
        except ApiError as e:
            if e.status == 409:  # AlreadyExists
                return False
            raise
        return True

    async def delete(self, api_version: str, plural: str, namespace: str, name: str) -> bool:
        """Delete (owned objects go with it); False when it did not exist."""
        try:
            await self._call(_kind_by_plural(api_version, plural), "delete", namespace, name=name,
                             propagation_policy="Background")
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return True
