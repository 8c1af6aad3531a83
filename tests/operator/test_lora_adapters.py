"""Multi-LoRA on Kubernetes: spec.lora reaches the workers' engine, spec.adapters only the
router's Ray Serve user_config (so adapter edits never restart a worker), validation
messages, and status.adapters / AdaptersReady from the router's /v1/models."""

from __future__ import annotations

import copy

import pytest
import yaml
from k8s_helpers import validate_schema

from kvmesh.config import LoRAConfig
from kvmesh_operator import status as st
from kvmesh_operator.render import Target, render_all
from kvmesh_operator.spec import SpecError, parse_spec

NOW = "2026-01-01T00:00:00Z"
BASE = {
    "model": {"uri": "pvc://models/llama", "name": "llama"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 2},
    "lora": {"maxLoras": 8, "maxLoraRank": 64},
    "adapters": [{"name": "sql", "source": "pvc://models/adapters/sql"},
                 {"name": "chat", "source": "/models/adapters/chat"}],
}


def _objs(spec: dict) -> dict[str, dict]:
    t = Target(name="svc", namespace="ml", spec=parse_spec(spec))
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in render_all(t)}


def _app(objs: dict[str, dict]) -> dict:
    [app] = yaml.safe_load(objs["RayService/svc"]["spec"]["serveConfigV2"])["applications"]
    return app


def _deployments(app: dict) -> dict[str, dict]:
    return {d["name"]: d for d in app["deployments"]}


def test_lora_goes_to_the_workers_engine_adapters_to_the_router_user_config(rayservice_schema):
    objs = _objs(BASE)
    validate_schema(objs["RayService/svc"], rayservice_schema)
    app = _app(objs)
    lora = LoRAConfig.model_validate(app["args"]["config"]["engine"]["lora"])
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, lora.modules) == (8, 64, None, [])
    deployments = _deployments(app)
    assert deployments["router"]["user_config"] == {"adapters": [
        {"name": "sql", "path": "/mnt/models/models/adapters/sql"}, {"name": "chat", "path": "/models/adapters/chat"}]}
    assert all("user_config" not in d for name, d in deployments.items() if name != "router")
    assert yaml.safe_load(objs["ConfigMap/svc-config"]["data"]["router-user-config.yaml"]) == \
        deployments["router"]["user_config"]
    # The adapters are nowhere in what the workers (or the router) are built from.
    assert "adapters/sql" not in yaml.safe_dump(app["args"])


@pytest.mark.parametrize("change", ["add", "remove", "replace", "none-left", "repoint"])
def test_adapter_changes_touch_only_the_router_user_config(change):
    spec = copy.deepcopy(BASE)
    if change == "add":
        spec["adapters"].append({"name": "docs", "source": "file:///models/adapters/docs"})
    elif change == "remove":
        spec["adapters"].pop(0)
    elif change == "replace":
        spec["adapters"] = [{"name": "docs", "source": "/models/adapters/docs"}]
    elif change == "none-left":
        spec["adapters"] = []
    else:
        spec["adapters"][1]["source"] = "/models/adapters/chat-v2"
    before, after = _objs(BASE), _objs(spec)
    # KubeRay hashes rayClusterConfig to decide on a new Ray cluster: identical, so no pod is replaced.
    assert after["RayService/svc"]["spec"]["rayClusterConfig"] == before["RayService/svc"]["spec"]["rayClusterConfig"]
    a, b = _app(before), _app(after)
    # Ray Serve rebuilds (restarts) deployments when the app's args change: they don't.
    assert b["args"] == a["args"] and b["import_path"] == a["import_path"]
    da, db = _deployments(a), _deployments(b)
    for name in ("prefill", "decode"):
        assert db[name] == da[name], name  # the worker deployments' config (and so its version) is unchanged
    assert {k: v for k, v in db["router"].items() if k != "user_config"} == \
        {k: v for k, v in da["router"].items() if k != "user_config"}
    assert db["router"]["user_config"] != da["router"]["user_config"]
    assert after["ConfigMap/svc-config"]["data"]["serving.yaml"] == before["ConfigMap/svc-config"]["data"]["serving.yaml"]
    if change == "none-left":
        assert db["router"]["user_config"] == {"adapters": []}  # unloads every adapter


def test_lora_itself_is_a_worker_change_and_off_renders_nothing():
    on, off = _objs(BASE), _objs({k: v for k, v in BASE.items() if k not in ("lora", "adapters")})
    assert _app(off)["args"]["config"]["engine"]["lora"] is None
    assert "user_config" not in _deployments(_app(off))["router"]
    assert "router-user-config.yaml" not in off["ConfigMap/svc-config"]["data"]
    assert _app(on)["args"] != _app(off)["args"]  # enabling LoRA restarts the workers (once)
    bigger = _objs({**BASE, "lora": {"maxLoras": 16, "maxLoraRank": 64}})
    assert _app(bigger)["args"]["config"]["engine"]["lora"]["max_loras"] == 16


@pytest.mark.parametrize("spec, message", [
    ({"adapters": [{"name": "sql", "source": "/a"}]}, "spec.adapters: adapters need spec.lora: add `lora: {}`"),
    ({"lora": {}, "adapters": [{"name": "sql", "source": "s3://bucket/sql"}]},
     "spec.adapters.0.source: adapter source 's3://bucket/sql': the workers cannot read s3://"),
    ({"lora": {}, "adapters": [{"name": "sql", "source": "https://hub/sql"}]}, "cannot read https://"),
    ({"lora": {}, "adapters": [{"name": "sql", "source": "adapters/sql"}]}, "cannot read a relative path"),
    ({"lora": {}, "adapters": [{"name": "sql", "source": "/a"}, {"name": "sql", "source": "/b"}]},
     "adapter names must be unique; repeated: sql"),
    ({"lora": {}, "adapters": [{"name": "my sql", "source": "/a"}]}, "spec.adapters.0.name: adapter name 'my sql'"),
    ({"lora": {}, "adapters": [{"name": "sql", "source": "pvc://other/sql"}]},
     "is on claim 'other', which the workers do not mount"),
    ({"lora": {"maxLoraRank": 512}}, "spec.lora.maxLoraRank: Input should be less than or equal to 256"),
    ({"lora": {"maxLoraRank": 0}}, "spec.lora.maxLoraRank: Input should be greater than or equal to 1"),
    ({"lora": {"maxLoras": 8, "maxCpuLoras": 4}}, "lora.maxCpuLoras must be >= lora.maxLoras"),
])
def test_invalid_lora_specs_name_the_field(spec, message):
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert message in str(e.value)


def test_adapter_named_like_the_base_model_is_refused():
    t = Target("svc", "ml", parse_spec({"lora": {}, "adapters": [{"name": "svc", "source": "/a"}]}))
    with pytest.raises(SpecError, match="adapter name 'svc' is the base model's name"):
        t.serving_config()


def test_crd_schema_enforces_what_it_can(llmservice_schema):
    def obj(spec):
        return {"apiVersion": "kvmesh.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "x"}, "spec": spec}

    validate_schema(obj(BASE), llmservice_schema)
    spec = llmservice_schema["properties"]["spec"]
    assert spec["properties"]["adapters"]["x-kubernetes-list-type"] == "map"  # the API server keeps names unique
    assert spec["properties"]["adapters"]["x-kubernetes-list-map-keys"] == ["name"]
    assert any("has(self.lora)" in r["rule"] for r in spec["x-kubernetes-validations"])
    for bad in ({"lora": {}, "adapters": [{"name": "sql", "source": "s3://b/sql"}]},
                {"lora": {"maxLoraRank": 1000}}, {"lora": {}, "adapters": [{"name": "a b", "source": "/a"}]}):
        with pytest.raises(AssertionError):
            validate_schema(obj(bad), llmservice_schema)


# --- status ---------------------------------------------------------------------------------

T = Target("svc", "ml", parse_spec(BASE))


def _adapters_ready(patch: dict) -> tuple[str, str, str]:
    [c] = [c for c in patch["conditions"] if c["type"] == "AdaptersReady"]
    return c["status"], c["reason"], c["message"]


def _models(*entries: dict) -> dict:
    return {"object": "list", "data": [{"id": "llama", "object": "model"}, *entries]}


def test_adapters_status_from_v1_models():
    base = st.from_rayservice(T, None, None, NOW)
    some = st.with_adapters(T, base, _models(
        {"id": "sql", "parent": "llama", "root": "/mnt/models/models/adapters/sql", "workers": 3}), None, None, NOW)
    assert some["adapters"] == [{"name": "sql", "loaded": True, "workers": 3},
                                {"name": "chat", "loaded": False, "workers": 0}]
    assert _adapters_ready(some) == ("False", "Loading", "not loaded yet: chat")
    every = st.with_adapters(T, base, _models(
        {"id": "sql", "parent": "llama", "workers": ["10.0.0.1:1", "10.0.0.2:1"]},
        {"id": "chat", "parent": "llama", "root": "/models/adapters/chat"}), None, some, NOW)
    assert every["adapters"] == [{"name": "sql", "loaded": True, "workers": 2},
                                 {"name": "chat", "loaded": True, "workers": None}]
    assert _adapters_ready(every)[:2] == ("True", "Loaded") and st.changed(some, every)
    # An old source (the router not reconfigured yet) or no worker holding it is not loaded;
    # an adapter no longer in the spec but still listed is being unloaded.
    stale = st.with_adapters(T, base, _models(
        {"id": "sql", "parent": "llama", "root": "/old/sql"}, {"id": "chat", "parent": "llama", "workers": 0},
        {"id": "gone", "parent": "llama"}), None, every, NOW)
    assert [a["loaded"] for a in stale["adapters"]] == [False, False]
    assert _adapters_ready(stale) == ("False", "Loading",
                                      "not loaded yet: sql, chat; still served, being unloaded: gone")


def test_adapters_status_without_an_answer_and_without_lora():
    base = st.from_rayservice(T, None, None, NOW)
    loaded = st.with_adapters(T, base, _models({"id": "sql"}, {"id": "chat"}), None, None, NOW)
    failed = st.with_adapters(T, base, None, (False, "ProbeFailed", "GET x: refused"), loaded, NOW)
    assert failed["adapters"] == loaded["adapters"]  # the last answer stands, the condition says why it is old
    assert _adapters_ready(failed) == ("False", "ProbeFailed", "GET x: refused")
    unknown = st.with_adapters(T, base, None, (None, "NotProbed", "tls"), None, NOW)
    assert _adapters_ready(unknown)[0] == "Unknown" and [a["loaded"] for a in unknown["adapters"]] == [False, False]
    off = Target("svc", "ml", parse_spec({}))
    plain = st.with_adapters(off, st.from_rayservice(off, None, None, NOW), None, None, loaded, NOW)
    assert plain["adapters"] is None and {c["type"] for c in plain["conditions"]} == {"Ready", "Progressing",
                                                                                    "Degraded"}
    none = Target("svc", "ml", parse_spec({"lora": {}}))
    assert _adapters_ready(st.with_adapters(none, base, _models(), None, None, NOW))[:2] == ("True", "NoAdapters")


def test_applied_keeps_adapters_ready_only_for_the_same_adapters():
    loaded = st.with_adapters(T, st.from_rayservice(T, None, None, NOW), _models({"id": "sql"}, {"id": "chat"}),
                              None, None, NOW)
    assert _adapters_ready(st.applied(T, 2, loaded, NOW))[:2] == ("True", "Loaded")
    changed = Target("svc", "ml", parse_spec({**BASE, "adapters": BASE["adapters"][:1]}))
    assert _adapters_ready(st.applied(changed, 2, loaded, NOW))[:2] == ("False", "Syncing")
