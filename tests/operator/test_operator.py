"""The operator end to end: kopf in-process against kmock's in-memory Kubernetes API.

kmock stores, patches, lists and watches objects; `ApiServer` adds what a real API server
stamps on every write (uid, generation, resourceVersion, names from generateName), so
"patched, not recreated" is checked the way it is on a cluster: the uid stays the same.
The test plays KubeRay by writing the RayService status.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import itertools
import threading
import uuid
from typing import Any, Awaitable, Callable

import attrs
import kmock
import kopf
import pytest
import pytest_asyncio
import yaml
from aiohttp import web

NS = "ml"
LLMS = "/apis/kvmesh.dev/v1alpha1/namespaces/ml/llmservices"
RAYSERVICES = "/apis/ray.io/v1/namespaces/ml/rayservices"
SERVICES = "/api/v1/namespaces/ml/services"
CONFIGMAPS = "/api/v1/namespaces/ml/configmaps"
DEPLOYMENTS = "/apis/apps/v1/namespaces/ml/deployments"
SECRETS = "/api/v1/namespaces/ml/secrets"
POLICIES = "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies"
EVENTS = "/api/v1/namespaces/ml/events"

pytestmark = pytest.mark.asyncio


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = str(next(self._versions))
            if request.action == kmock.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.update(uid=str(uuid.uuid4()), generation=1,
                            creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            elif request.action == kmock.action.UPDATE and "spec" in data and request.subresource is None:
                key = (request.resource, request.namespace, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    current = self.objects[key].raw
                    if current.get("spec") != {**current.get("spec", {}), **data["spec"]}:
                        meta["generation"] = current.get("metadata", {}).get("generation", 1) + 1
        return await super()._handle(request)


def _declare(server: ApiServer) -> None:
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    server.resources["kvmesh.dev/v1alpha1/llmservices"] = kmock.ResourceInfo(
        kind="LLMService", singular="llmservice", namespaced=True, verbs=verbs, shortnames={"llms"},
        subresources={"status"})
    server.resources["ray.io/v1/rayservices"] = kmock.ResourceInfo(
        kind="RayService", singular="rayservice", namespaced=True, verbs=verbs, subresources={"status"})
    server.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", singular="namespace",
                                                           namespaced=False, verbs=verbs)
    server.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False, verbs=verbs)
    for key, kind in [("v1/services", "Service"), ("v1/configmaps", "ConfigMap"), ("v1/events", "Event"),
                      ("apps/v1/deployments", "Deployment"), ("v1/secrets", "Secret"),
                      ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy")]:
        server.resources[key] = kmock.ResourceInfo(kind=kind, singular=kind.lower(), namespaced=True, verbs=verbs)


@pytest_asyncio.fixture
async def api(tmp_path, monkeypatch):
    async with ApiServer() as server, kmock.Server(server):
        _declare(server)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
            f"clusters: [{{name: kmock, cluster: {{server: '{server.url}'}}}}]\n"
            "users: [{name: test, user: {}}]\n"
            f"contexts: [{{name: kmock, context: {{cluster: kmock, user: test, namespace: {NS}}}}}]\n")
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        yield server


@pytest_asyncio.fixture
async def operator(api):
    """kopf in its own thread and event loop (it cancels every task of its loop when it stops),
    talking to kmock over loopback HTTP like to a real API server."""
    import kvmesh_operator.handlers  # noqa: F401  (registers the handlers in kopf's default registry)

    settings = kopf.OperatorSettings()
    settings.queueing.idle_timeout = 0.5
    settings.watching.reconnect_backoff = 0.1
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(standalone=True, namespaces=[NS], settings=settings, stop_flag=stop,
                                      ready_flag=ready, memo=kopf.Memo()))
        except BaseException as e:  # noqa: BLE001  (reported by the assertion below)
            errors.append(e)

    thread = threading.Thread(target=run, name="kopf", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 15), "the operator did not start"
    yield thread
    assert thread.is_alive() and not errors, f"the operator stopped on its own: {errors}"
    stop.set()
    await asyncio.to_thread(thread.join, 20)
    assert not thread.is_alive(), "the operator did not stop within 20s"
    assert not errors, errors


async def get(api: ApiServer, path: str) -> dict[str, Any] | None:
    async with api.get(path) as resp:
        if resp.status == 404:
            return None
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def write(api: ApiServer, method: str, path: str, body: Any) -> dict[str, Any]:
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
    async with api.request(method, path, json=body, headers=headers) as resp:
        assert resp.status < 300, await resp.text()
        return await resp.json()


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 20.0) -> Any:
    """Poll `check` until it returns something truthy (the operator is asynchronous)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await check()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {check.__name__}; last: {value!r}")
        await asyncio.sleep(0.05)


def llmservice(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvmesh.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c
    return {}


HEALTHY = {
    "serviceStatus": "Running",
    "conditions": [{"type": "Ready", "status": "True", "reason": "NonZeroServeEndpoints",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"}],
    "activeServiceStatus": {"rayClusterName": "chat-x7k2p",
                            "rayClusterStatus": {"desiredWorkerReplicas": 7, "readyWorkerReplicas": 7},
                            "applicationStatuses": {"chat": {
                                "status": "RUNNING",
                                "serveDeploymentStatuses": {d: {"status": "HEALTHY"}
                                                            for d in ("router", "prefill", "decode")}}}},
}


async def test_lifecycle_create_update_ready_delete(api, operator):
    spec = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}, "cache": {"redis": {"managed": True}}}
    owner = await write(api, "POST", LLMS, llmservice("chat", spec))
    uid = owner["metadata"]["uid"]

    async def children():
        objs = [await get(api, p) for p in (f"{RAYSERVICES}/chat", f"{SERVICES}/chat-grpc", f"{SERVICES}/chat-http",
                                            f"{CONFIGMAPS}/chat-config", f"{DEPLOYMENTS}/chat-redis",
                                            f"{SERVICES}/chat-redis")]
        return objs if all(objs) else None

    objs = await eventually(children)
    secured = [await get(api, p) for p in (f"{SECRETS}/chat-internal", f"{SECRETS}/chat-redis-auth",
                                           f"{POLICIES}/chat-workers", f"{POLICIES}/chat-redis",
                                           f"{POLICIES}/chat-head")]
    assert all(secured), "generated Secrets and NetworkPolicies"
    token = secured[0]["data"]["token"]
    assert len(token) > 40 and secured[1]["data"]["password"] != token
    objs += secured
    for obj in objs:
        refs = obj["metadata"]["ownerReferences"]
        assert [(r["kind"], r["name"], r["uid"], r["controller"]) for r in refs] == [("LLMService", "chat", uid, True)]
    rayservice = objs[0]
    groups = {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert (groups["prefill"]["replicas"], groups["decode"]["replicas"]) == (1, 2)
    assert "redis://chat-redis.ml.svc:6379/0" in objs[3]["data"]["serving.yaml"]
    progressing = await eventually(lambda: _cond(api, "Progressing", "True"))
    assert progressing["reason"] == "Deploying"

    # Update: scale decode -> the RayService is patched in place (same uid), Redis dropped.
    rs_uid = rayservice["metadata"]["uid"]
    await write(api, "PATCH", f"{LLMS}/chat", {"spec": {"decode": {"replicas": 4}, "cache": None}})

    async def scaled():
        rs = await get(api, f"{RAYSERVICES}/chat")
        groups = {g["groupName"]: g["replicas"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
        return rs if groups["decode"] == 4 else None

    rayservice = await eventually(scaled)
    assert rayservice["metadata"]["uid"] == rs_uid
    assert (await get(api, f"{SECRETS}/chat-internal"))["data"]["token"] == token  # generated once, never rotated
    assert len(api.objects["ray.io/v1/rayservices", NS, "chat"].history) >= 2  # patched, never deleted
    assert not api.objects["ray.io/v1/rayservices", NS, "chat"].deleted
    await eventually(lambda: _absent(api, f"{DEPLOYMENTS}/chat-redis"))
    await eventually(lambda: _absent(api, f"{POLICIES}/chat-redis"))

    # KubeRay reports the service healthy -> Ready with endpoints and per-role replicas.
    await write(api, "PATCH", f"{RAYSERVICES}/chat/status", {"status": HEALTHY})
    ready = await eventually(lambda: _cond(api, "Ready", "True"))
    assert ready["reason"] == "Serving"
    status = (await get(api, f"{LLMS}/chat"))["status"]
    assert status["endpoints"] == {"grpc": "chat-grpc.ml.svc:50051", "http": "http://chat-http.ml.svc:8000"}
    assert status["mode"] == "disaggregated"
    assert status["roles"]["decode"] == {"deployment": "decode", "state": "HEALTHY", "replicas": 4,
                                         "maxReplicas": 4, "readyReplicas": 4, "ready": "4/4", "ranks": 1}
    assert status["observedGeneration"] == 2
    assert condition({"status": status}, "Degraded")["status"] == "False"
    assert (status["model"], status["url"], status["pods"], status["readyReplicas"]) == (
        "chat", "http://chat-http.ml.svc:8000", "7/7", 7)

    # The Services select the router pods of the RayCluster KubeRay serves from, and follow it when
    # an upgrade switches traffic to a new cluster.
    async def services_on(cluster):
        selectors = [(await get(api, f"{SERVICES}/chat-{k}"))["spec"]["selector"] for k in ("grpc", "http")]
        return all(sel.get("ray.io/cluster") == cluster and sel["ray.io/serve"] == "true" for sel in selectors)

    await eventually(lambda: services_on("chat-x7k2p"))
    assert (await get(api, f"{LLMS}/chat"))["status"]["rayCluster"] == "chat-x7k2p"
    await write(api, "PATCH", f"{RAYSERVICES}/chat/status", {"status": {"activeServiceStatus": {
        "rayClusterName": "chat-q9w3z"}}})
    await eventually(lambda: services_on("chat-q9w3z"))

    # A deployment turns unhealthy -> Degraded with the reason and KubeRay's message.
    broken = {"activeServiceStatus": {"applicationStatuses": {"chat": {"status": "DEPLOY_FAILED",
              "serveDeploymentStatuses": {"decode": {"status": "DEPLOY_FAILED", "message": "OOM"}}}}}}
    await write(api, "PATCH", f"{RAYSERVICES}/chat/status", {"status": broken})
    degraded = await eventually(lambda: _cond(api, "Degraded", "True"))
    assert degraded["reason"] == "DeploymentUnhealthy" and "OOM" in degraded["message"]

    # Delete -> the delete handler runs, removes the finalizer and the children.
    async with api.request("DELETE", f"{LLMS}/chat") as resp:
        assert resp.status == 200, await resp.text()
    await eventually(lambda: _absent(api, f"{LLMS}/chat"))
    for path in (f"{RAYSERVICES}/chat", f"{SERVICES}/chat-grpc", f"{SERVICES}/chat-http", f"{CONFIGMAPS}/chat-config"):
        assert await get(api, path) is None, path


async def _cond(api: ApiServer, kind: str, status: str, name: str = "chat") -> dict[str, Any] | None:
    c = condition(await get(api, f"{LLMS}/{name}"), kind)
    return c if c.get("status") == status else None


async def _absent(api: ApiServer, path: str) -> bool:
    return await get(api, path) is None


async def test_invalid_spec_degrades_with_event_and_recovers(api, operator):
    bad = {"decode": {"replicas": 2, "scaling": {"minReplicas": 1, "maxReplicas": 3}}, "model": {"uri": "s3://b/m"}}
    await write(api, "POST", LLMS, llmservice("broken", bad))
    degraded = await eventually(lambda: _cond(api, "Degraded", "True", "broken"))
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.decode" in degraded["message"] and "either replicas or scaling" in degraded["message"]
    assert condition(await get(api, f"{LLMS}/broken"), "Ready")["status"] == "False"

    async def warning():
        events = (await get(api, EVENTS))["items"]
        return [e for e in events if e.get("reason") == "InvalidSpec" and e["involvedObject"]["name"] == "broken"]

    [event] = await eventually(warning)
    assert event["type"] == "Warning" and "either replicas or scaling" in event["message"]
    assert await get(api, f"{RAYSERVICES}/broken") is None
    assert operator.is_alive()

    # The error names the field; the next problem is reported the same way, then a fix recovers.
    await write(api, "PATCH", f"{LLMS}/broken", {"spec": {"decode": {"scaling": None}}})
    uri = await eventually(lambda: _uri_error(api))
    assert "never downloads weights" in uri["message"]
    await write(api, "PATCH", f"{LLMS}/broken", {"spec": {"model": {"uri": "/models/m"}}})
    await eventually(lambda: get(api, f"{RAYSERVICES}/broken"))
    fixed = await eventually(lambda: _cond(api, "Degraded", "False", "broken"))
    assert fixed["reason"] == "AsExpected"


async def test_tensor_parallel_service_renders_gpu_pods_placement_and_engine(api, operator):
    spec = {"model": {"uri": "/models/llama-70b", "dtype": "bfloat16"},
            "decode": {"replicas": 2, "parallelism": {"tensor": 2},
                       "resources": {"cpu": "16", "memory": "160Gi", "gpu": 2}}}
    await write(api, "POST", LLMS, llmservice("tp", spec))
    rs = await eventually(lambda: get(api, f"{RAYSERVICES}/tp"))
    decode = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}["decode"]
    # One pod per replica holds the whole TP group: 2 GPUs in the container and offered to Ray.
    assert (decode["replicas"], decode["rayStartParams"]["num-gpus"]) == (2, "2")
    [container] = decode["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert decode["template"]["metadata"]["labels"]["kvmesh.dev/tensor-parallel"] == "2"
    [unified] = [d for d in _serve_app(rs)["deployments"] if d["name"] == "unified"]
    assert unified["placement_group_strategy"] == "STRICT_PACK"
    assert unified["placement_group_bundles"] == [{"CPU": 8.0, "GPU": 2.0, "kvmesh-decode": 0.5}, {"CPU": 8.0, "kvmesh-decode": 0.5}]
    engine = _serve_app(rs)["args"]["config"]["engine"]
    assert engine["parallel"]["tensor_parallel_size"] == 2 and engine["model"]["device"] == "cuda"
    serving = yaml.safe_load((await get(api, f"{CONFIGMAPS}/tp-config"))["data"]["serving.yaml"])
    assert serving["engine"]["parallel"]["tensor_parallel_size"] == 2

    await write(api, "PATCH", f"{RAYSERVICES}/tp/status", {"status": {"activeServiceStatus": {
        "applicationStatuses": {"tp": {"status": "RUNNING", "serveDeploymentStatuses": {
            d: {"status": "HEALTHY"} for d in ("router", "unified")}}}}}})

    async def ranks():
        roles = ((await get(api, f"{LLMS}/tp")).get("status") or {}).get("roles") or {}
        return roles if roles.get("decode", {}).get("readyReplicas") == 2 else None

    roles = await eventually(ranks)
    assert roles["decode"]["ranks"] == 2 and "ranks" not in roles["router"]

    # A GPU count that is not the rank count is refused on the LLMService, saying what to give;
    # the running RayService is left as it was.
    await write(api, "PATCH", f"{LLMS}/tp", {"spec": {"decode": {"resources": {"gpu": 1}}}})
    degraded = await eventually(lambda: _cond(api, "Degraded", "True", "tp"))
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.decode: resources.gpu 1 with parallelism tensor 2 x pipeline 1" in degraded["message"]
    assert "give resources.gpu: 2" in degraded["message"]
    assert (await get(api, f"{RAYSERVICES}/tp"))["metadata"]["uid"] == rs["metadata"]["uid"]


async def _uri_error(api: ApiServer) -> dict[str, Any] | None:
    c = await _cond(api, "Degraded", "True", "broken")
    return c if c and "spec.model.uri" in c["message"] else None


# --- LoRA adapters: the router's user_config, status from a real /v1/models on loopback --------

class ModelsServer:
    """The router's OpenAI HTTP API as far as the operator asks it: GET /v1/models, behind an API key."""

    def __init__(self, api_key: str):
        self.api_key = api_key
        self.adapters: list[dict[str, Any]] = []
        self.calls = 0

    async def models(self, request: web.Request) -> web.Response:
        self.calls += 1
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "missing or wrong API key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "llama", "object": "model"}, *self.adapters]})


@pytest_asyncio.fixture
async def models_server(monkeypatch):
    server = ModelsServer(api_key="k-123")
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    monkeypatch.setenv("KVMESH_ROUTER_URL", f"http://127.0.0.1:{port}")  # instead of the -http Service's DNS name
    yield server
    await runner.cleanup()


def _serve_app(rs: dict[str, Any]) -> dict[str, Any]:
    [app] = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    return app


async def test_adapters_reconfigure_the_router_only_and_report_status(api, operator, models_server):
    await write(api, "POST", SECRETS, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "key", "namespace": NS},
                                       "data": {"api-key": base64.b64encode(b"k-123").decode()}})
    spec = {"model": {"name": "llama"}, "decode": {"replicas": 2}, "lora": {"maxLoras": 4},
            "auth": {"apiKeySecretRef": {"name": "key", "key": "api-key"}},
            "adapters": [{"name": "sql", "source": "/models/adapters/sql"},
                         {"name": "chat", "source": "file:///models/adapters/chat"}]}
    await write(api, "POST", LLMS, llmservice("chat", spec))
    rs = await eventually(lambda: get(api, f"{RAYSERVICES}/chat"))
    app = _serve_app(rs)
    router = {d["name"]: d for d in app["deployments"]}["router"]
    assert router["user_config"] == {"adapters": [{"name": "sql", "path": "/models/adapters/sql"},
                                                  {"name": "chat", "path": "/models/adapters/chat"}]}
    assert app["args"]["config"]["engine"]["lora"]["max_loras"] == 4

    # Not serving yet: AdaptersReady waits, the router is not asked.
    waiting = await eventually(lambda: _cond(api, "AdaptersReady", "False"))
    assert waiting["reason"] in ("Syncing", "ServiceNotReady") and models_server.calls == 0

    # Serving, the router has loaded one of the two.
    models_server.adapters = [{"id": "sql", "parent": "llama", "root": "/models/adapters/sql", "workers": 2}]
    healthy = {**HEALTHY, "activeServiceStatus": {"applicationStatuses": {"chat": {
        "status": "RUNNING", "serveDeploymentStatuses": {"router": {"status": "HEALTHY"},
                                                         "unified": {"status": "HEALTHY"}}}}}}
    await write(api, "PATCH", f"{RAYSERVICES}/chat/status", {"status": healthy})

    async def loading():
        c = condition(await get(api, f"{LLMS}/chat"), "AdaptersReady")
        return c if c.get("reason") == "Loading" else None

    assert (await eventually(loading))["message"] == "not loaded yet: chat"
    status = (await get(api, f"{LLMS}/chat"))["status"]
    assert status["adapters"] == [{"name": "sql", "loaded": True, "workers": 2},
                                  {"name": "chat", "loaded": False, "workers": 0}]
    assert condition({"status": status}, "Ready")["status"] == "True"

    models_server.adapters.append({"id": "chat", "parent": "llama", "root": "/models/adapters/chat", "workers": 2})
    ready = await eventually(lambda: _cond(api, "AdaptersReady", "True"))
    assert ready["reason"] == "Loaded"

    # Swap one adapter: the RayService is patched in place, its Ray cluster (worker pod templates,
    # what KubeRay hashes) and the app's args (what the workers are built from) stay as they were.
    before = await get(api, f"{RAYSERVICES}/chat")
    await write(api, "PATCH", f"{LLMS}/chat", {"spec": {"adapters": [
        {"name": "sql", "source": "/models/adapters/sql"}, {"name": "docs", "source": "/models/adapters/docs"}]}})

    async def swapped():
        rs = await get(api, f"{RAYSERVICES}/chat")
        router = {d["name"]: d for d in _serve_app(rs)["deployments"]}["router"]
        return rs if [a["name"] for a in router["user_config"]["adapters"]] == ["sql", "docs"] else None

    after = await eventually(swapped)
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["spec"]["rayClusterConfig"] == before["spec"]["rayClusterConfig"]
    old_app, new_app = _serve_app(before), _serve_app(after)
    assert new_app["args"] == old_app["args"]
    assert [d for d in new_app["deployments"] if d["name"] != "router"] == \
        [d for d in old_app["deployments"] if d["name"] != "router"]

    async def docs_pending():
        status = (await get(api, f"{LLMS}/chat"))["status"]
        c = condition({"status": status}, "AdaptersReady")
        return status if c.get("reason") == "Loading" and "docs" in c["message"] else None

    status = await eventually(docs_pending)
    assert "still served, being unloaded: chat" in condition({"status": status}, "AdaptersReady")["message"]
    assert [a["name"] for a in status["adapters"]] == ["sql", "docs"]


async def test_invalid_adapters_surface_in_status(api, operator):
    bad = {"adapters": [{"name": "sql", "source": "/models/adapters/sql"}]}
    await write(api, "POST", LLMS, llmservice("broken", bad))
    degraded = await eventually(lambda: _cond(api, "Degraded", "True", "broken"))
    assert degraded["reason"] == "InvalidSpec" and "spec.adapters: adapters need spec.lora" in degraded["message"]
    assert await get(api, f"{RAYSERVICES}/broken") is None

    await write(api, "PATCH", f"{LLMS}/broken", {"spec": {"lora": {}, "adapters": [
        {"name": "sql", "source": "s3://bucket/adapters/sql"}]}})

    async def scheme_error():
        c = await _cond(api, "Degraded", "True", "broken")
        return c if c and "s3://" in c["message"] else None

    c = await eventually(scheme_error)
    assert "spec.adapters.0.source" in c["message"] and "the workers cannot read s3://" in c["message"]
    await write(api, "PATCH", f"{LLMS}/broken", {"spec": {"adapters": [{"name": "sql", "source": "/models/sql"}]}})
    await eventually(lambda: get(api, f"{RAYSERVICES}/broken"))
    assert (await eventually(lambda: _cond(api, "Degraded", "False", "broken")))["reason"] == "AsExpected"


# --- drift: owned objects that are deleted or edited come back; the LLMService is not touched ------

def _writes(api: ApiServer) -> list[str]:
    """Paths of every create / patch of an owned object (not the LLMService, not a status)."""
    return [r.url.path for r in api if r.method in ("POST", "PATCH") and not r.url.path.startswith(LLMS)
            and not r.url.path.endswith("/status") and "/events" not in r.url.path]


def _reads(api: ApiServer, path: str) -> int:
    return sum(1 for r in api if r.method == "GET" and r.url.path == path)


async def test_drift_deleted_or_edited_objects_come_back(api, operator):
    await write(api, "POST", LLMS, llmservice("chat", {"decode": {"replicas": 1}}))

    async def applied():  # reconcile applied generation 1 (it writes observedGeneration last)
        return ((await get(api, f"{LLMS}/chat")).get("status") or {}).get("observedGeneration") == 1

    await eventually(applied)
    rayservice = await get(api, f"{RAYSERVICES}/chat")
    policy = await get(api, f"{POLICIES}/chat-head")
    owner = await get(api, f"{LLMS}/chat")

    # Unchanged objects are only read: a few drift checks (each reads the ConfigMap) write nothing.
    writes, reads = len(_writes(api)), _reads(api, f"{CONFIGMAPS}/chat-config")
    await eventually(lambda: _async(_reads(api, f"{CONFIGMAPS}/chat-config") >= reads + 3))
    assert _writes(api)[writes:] == []

    # Deleted: the RayService and the head NetworkPolicy are created again, as rendered.
    for path in (f"{RAYSERVICES}/chat", f"{POLICIES}/chat-head"):
        async with api.request("DELETE", path) as resp:
            assert resp.status == 200, await resp.text()
    back = await eventually(lambda: get(api, f"{RAYSERVICES}/chat"))
    assert back["metadata"]["uid"] != rayservice["metadata"]["uid"] and back["spec"] == rayservice["spec"]
    assert back["metadata"]["ownerReferences"] == rayservice["metadata"]["ownerReferences"]
    assert (await eventually(lambda: get(api, f"{POLICIES}/chat-head")))["spec"] == policy["spec"]

    # Edited: a Service that selects the decode pods, a head policy opened to everyone, fewer workers.
    await write(api, "PATCH", f"{SERVICES}/chat-grpc", {"spec": {"selector": {"ray.io/group": "decode"}}})
    await write(api, "PATCH", f"{POLICIES}/chat-head", {"spec": {"ingress": [{}]}})
    groups = back["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    await write(api, "PATCH", f"{RAYSERVICES}/chat", {"spec": {"rayClusterConfig": {"workerGroupSpecs": [
        {**g, "replicas": 0} for g in groups]}}})

    async def repaired():
        svc, pol, rs = [await get(api, p) for p in (f"{SERVICES}/chat-grpc", f"{POLICIES}/chat-head",
                                                     f"{RAYSERVICES}/chat")]
        return (svc["spec"]["selector"]["ray.io/group"] == "router" and pol["spec"] == policy["spec"]
                and rs["spec"] == rayservice["spec"])

    await eventually(repaired)
    after = await get(api, f"{LLMS}/chat")
    assert (after["metadata"]["generation"], after["spec"]) == (owner["metadata"]["generation"], owner["spec"])
    assert not [r for r in api if r.method in ("PATCH", "PUT") and r.url.path == f"{LLMS}/chat"
                and "spec" in (r.data or {})], "the LLMService's spec was written"


async def _async(value: Any) -> Any:
    return value


# --- the Ray head's NetworkPolicy, as the operator applies it ---------------------------------------

async def test_head_network_policy_applied_selects_the_head_and_admits_only_own_pods_and_kuberay(api, operator):
    await write(api, "POST", LLMS, llmservice("chat", {"decode": {"replicas": 1}}))
    policy = await eventually(lambda: get(api, f"{POLICIES}/chat-head"))
    rayservice = await eventually(lambda: get(api, f"{RAYSERVICES}/chat"))
    owner = await get(api, f"{LLMS}/chat")
    assert policy["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    # It selects the head pod and no worker pod.
    assert selector.items() <= cluster["headGroupSpec"]["template"]["metadata"]["labels"].items()
    assert not any(selector.items() <= g["template"]["metadata"]["labels"].items()
                   for g in cluster["workerGroupSpecs"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    own, kuberay = policy["spec"]["ingress"]
    # Every port to this LLMService's own pods (each of them carries the label) ...
    assert own == {"from": [{"podSelector": {"matchLabels": {"kvmesh.dev/llmservice": "chat"}}}]}
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert group["template"]["metadata"]["labels"]["kvmesh.dev/llmservice"] == "chat"
    # ... and only the dashboard / Serve ports to the KubeRay operator: never GCS 6379 or client 10001.
    assert [p["port"] for p in kuberay["ports"]] == [8265, 8000]
    assert kuberay["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}},
                                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}]
    # Another LLMService's pods are not admitted to this head.
    await write(api, "POST", LLMS, llmservice("other", {"decode": {"replicas": 1}}))
    other = await eventually(lambda: get(api, f"{POLICIES}/other-head"))
    assert other["spec"]["ingress"][0]["from"] != own["from"]
