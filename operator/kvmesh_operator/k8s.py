"""The operator's only Kubernetes API I/O: get, apply (server-side apply) and delete.

A small aiohttp client built from the same `kopf.ConnectionInfo` kopf logs in with (the
login handler hands it over), so kopf and this client always use one identity. Errors
are `ApiError`s carrying the HTTP status; `handlers` maps them to kopf's retry policy.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

FIELD_MANAGER = "kvmesh-operator"

# (apiVersion, kind) -> plural, for every kind the operator writes.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("apps/v1", "Deployment"): "deployments",
    ("ray.io/v1", "RayService"): "rayservices",
}


@dataclass
class ApiError(Exception):
    """A failed API call: `status` is the HTTP status (0 when the server was unreachable)."""

    status: int
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.status} {self.reason}: {self.message}"


def resource_path(api_version: str, plural: str, namespace: str, name: str | None = None) -> str:
    root = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    path = f"{root}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def object_path(obj: dict[str, Any], *, named: bool = True) -> str:
    key = (obj["apiVersion"], obj["kind"])
    if key not in PLURALS:
        raise ValueError(f"the operator does not manage {key[1]} ({key[0]})")
    meta = obj["metadata"]
    return resource_path(key[0], PLURALS[key], meta["namespace"], meta["name"] if named else None)


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    cadata = base64.b64decode(info.ca_data).decode() if info.ca_data else None
    ctx = ssl.create_default_context(cafile=info.ca_path or None, cadata=cadata)  # type: ignore[arg-type]
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        # ssl loads client certificates from files only.
        cert, key = (_tempfile(base64.b64decode(d)) for d in (info.certificate_data, info.private_key_data))
    if cert:
        ctx.load_cert_chain(cert, key)  # type: ignore[arg-type]
    return ctx


def _tempfile(data: bytes) -> str:
    with tempfile.NamedTemporaryFile(delete=False, prefix="kvmesh-operator-") as f:
        f.write(data)
    return f.name


class Api:
    """Kubernetes API client; `use()` (re)points it at a cluster, e.g. after kopf re-logins."""

    def __init__(self, info: kopf.ConnectionInfo | None = None, timeout_s: float = 30.0) -> None:
        self._info = info
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._stale: list[aiohttp.ClientSession] = []

    def use(self, info: kopf.ConnectionInfo) -> None:
        self._info = info
        if self._session is not None:
            self._stale.append(self._session)
            self._session = None

    def _open(self) -> aiohttp.ClientSession:
        if self._info is None:
            raise ApiError(0, "NotLoggedIn", "no cluster credentials yet (kopf login has not run)")
        if self._session is None:
            info = self._info
            headers = {"Accept": "application/json", "User-Agent": FIELD_MANAGER}
            auth = None
            if info.token:
                headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
            elif info.username and info.password:
                auth = aiohttp.BasicAuth(info.username, info.password)
            self._session = aiohttp.ClientSession(
                base_url=info.server.rstrip("/") + "/", headers=headers, auth=auth, timeout=self._timeout,
                connector=aiohttp.TCPConnector(ssl=_ssl_context(info)), trust_env=info.trust_env)
        return self._session

    async def close(self) -> None:
        for s in [*self._stale, *([self._session] if self._session else [])]:
            await s.close()
        self._stale, self._session = [], None

    async def request(self, method: str, path: str, *, body: Any = None, params: dict[str, str] | None = None,
                      content_type: str = "application/json") -> dict[str, Any]:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        try:
            async with self._open().request(method, path.lstrip("/"), data=data, params=params,
                                            headers=headers) as resp:
                text = await resp.text()
                payload = json.loads(text) if text else {}
                if resp.status >= 400:
                    raise ApiError(resp.status, str(payload.get("reason") or resp.reason),
                                   str(payload.get("message") or text[:500]))
                return payload
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
            raise ApiError(0, type(e).__name__, f"{method} {path}: {e}") from e

    async def get(self, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", resource_path(api_version, plural, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or update `obj` in place (server-side apply: same object, same uid)."""
        params = {"fieldManager": FIELD_MANAGER, "force": "true"}
        try:
            return await self.request("PATCH", object_path(obj), body=obj, params=params,
                                      content_type="application/apply-patch+yaml")
        except ApiError as e:
            if e.status != 404:
                raise
        # Servers without create-on-apply (API emulators) answer 404 for a new object: create it.
        try:
            return await self.request("POST", object_path(obj, named=False), body=obj,
                                      params={"fieldManager": FIELD_MANAGER})
        except ApiError as e:
            if e.status == 404:
                raise ApiError(404, "ResourceNotServed",
                               f"the API server does not serve {obj['kind']} ({obj['apiVersion']})"
                               + ("; install KubeRay first" if obj["apiVersion"].startswith("ray.io/") else "")
                               ) from e
            raise

    async def delete(self, api_version: str, plural: str, namespace: str, name: str) -> bool:
        """Delete (owned objects go with it); False when it did not exist."""
        try:
            await self.request("DELETE", resource_path(api_version, plural, namespace, name),
                               body={"propagationPolicy": "Background"})
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return True
