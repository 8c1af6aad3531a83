"""The operator's API client against kmock: server-side apply on the wire, get, delete, errors."""

from __future__ import annotations

import socket

import kmock
import kopf
import pytest
import pytest_asyncio

from kvmesh_operator import k8s

pytestmark = pytest.mark.asyncio
NS = "ml"


def _configmap(data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "namespace": NS}, "data": data}


@pytest_asyncio.fixture
async def server():
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):
        verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
        emulator.resources["v1/configmaps"] = kmock.ResourceInfo(
            kind="ConfigMap", singular="configmap", namespaced=True, verbs=verbs)
        yield emulator


@pytest_asyncio.fixture
async def api(server):
    api = k8s.Api(kopf.ConnectionInfo(server=str(server.url)))
    yield api
    await api.close()


async def test_apply_is_server_side_apply_then_patches_in_place(server, api):
    await api.apply(_configmap({"a": "1"}))
    patch, create = [r for r in server if r.method in ("PATCH", "POST")]
    assert patch.method == "PATCH" and patch.url.path == f"/api/v1/namespaces/{NS}/configmaps/cm"
    assert patch.headers["Content-Type"] == "application/apply-patch+yaml"
    assert patch.params["fieldManager"] == "kvmesh-operator" and patch.params["force"].lower() == "true"
    assert patch.data["data"] == {"a": "1"}
    # The emulator has no create-on-apply: 404, then a create of the same object.
    assert create.method == "POST" and create.url.path == f"/api/v1/namespaces/{NS}/configmaps"

    await api.apply(_configmap({"a": "2"}))
    writes = [r.method for r in server if r.method in ("PATCH", "POST")]
    assert writes == ["PATCH", "POST", "PATCH"]
    obj = await api.get("v1", "configmaps", NS, "cm")
    assert obj["data"] == {"a": "2"} and obj["metadata"]["name"] == "cm"
    assert len(server.objects["v1/configmaps", NS, "cm"].history) == 2


async def test_get_and_delete_report_absence(api):
    assert await api.get("v1", "configmaps", NS, "cm") is None
    assert await api.delete("v1", "configmaps", NS, "cm") is False
    await api.apply(_configmap({"a": "1"}))
    assert await api.delete("v1", "configmaps", NS, "cm") is True
    assert await api.get("v1", "configmaps", NS, "cm") is None


async def test_unserved_kind_and_unreachable_server_are_api_errors(server, api):
    rayservice = {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": "rs", "namespace": NS}}
    # A cluster without KubeRay: 404 for the object and for its collection.
    server[f"patch /apis/ray.io/v1/namespaces/{NS}/rayservices/rs"] << 404
    server[f"post /apis/ray.io/v1/namespaces/{NS}/rayservices"] << 404
    with pytest.raises(k8s.ApiError) as e:
        await api.apply(rayservice)
    assert (e.value.status, e.value.reason) == (404, "ResourceNotServed") and "KubeRay" in e.value.message

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api.use(kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}"))
    with pytest.raises(k8s.ApiError) as e:
        await api.get("v1", "configmaps", NS, "cm")
    assert e.value.status == 0


async def test_no_credentials_yet():
    with pytest.raises(k8s.ApiError) as e:
        await k8s.Api().get("v1", "configmaps", NS, "cm")
    assert e.value.reason == "NotLoggedIn"
