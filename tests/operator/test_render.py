"""Rendered objects: valid against KubeRay's CRD and the Kubernetes schemas, and wired right."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

from k8s_helpers import validate_builtin, validate_schema
from kvmesh.serve.config import ServingConfig
from kvmesh_operator.render import Defaults, Target, render_all
from kvmesh_operator.spec import parse_spec

SPECS = {
    "minimal": {},
    "unified-cpu": {"decode": {"replicas": 2, "resources": {"cpu": "2", "memory": "4Gi"}}},
    "disaggregated-gpu": {
        "model": {"uri": "pvc://models/llama", "dtype": "bfloat16", "draft": {"method": "ngram"}},
        "prefill": {"replicas": 2, "resources": {"cpu": "8", "memory": "48Gi", "gpu": 1},
                    "nodeSelector": {"gpu": "h100"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "decode": {"replicas": 4, "resources": {"cpu": "8", "memory": "48Gi", "gpu": 1}},
        "cache": {"redis": {"managed": True, "maxMemory": "2Gi"}},
        "promptCache": [{"name": "sys", "text": "You are helpful."}],
        "auth": {"apiKeySecretRef": {"name": "key", "key": "api-key"}},
    },
    "autoscaling-external-redis": {
        "image": "registry.local/kvmesh:dev",
        "router": {"scaling": {"minReplicas": 1, "maxReplicas": 3}},
        "decode": {"scaling": {"minReplicas": 1, "maxReplicas": 8}},
        "cache": {"redis": {"url": "redis://redis.cache:6379/1"}},
    },
    "tensor-parallel-gpu": {
        "model": {"uri": "pvc://models/llama-70b", "dtype": "bfloat16"},
        "decode": {"replicas": 2, "parallelism": {"tensor": 2}, "resources": {"cpu": "16", "memory": "160Gi", "gpu": 2}},
    },
    "pipeline-cpu-disaggregated": {
        "prefill": {"parallelism": {"pipeline": 2}, "resources": {"cpu": "4", "memory": "8Gi"}},
        "decode": {"parallelism": {"tensor": 2, "pipeline": 2}, "resources": {"cpu": "8", "memory": "16Gi"}},
    },
}


def _render(case: str) -> tuple[Target, dict[str, dict]]:
    t = Target(name="svc", namespace="ml", spec=parse_spec(SPECS[case]))
    return t, {f"{o['kind']}/{o['metadata']['name']}": o for o in render_all(t)}


@pytest.mark.parametrize("case", SPECS)
def test_rendered_objects_validate(case, rayservice_schema):
    _, objs = _render(case)
    validate_schema(objs["RayService/svc"], rayservice_schema)
    assert validate_builtin(o for k, o in objs.items() if not k.startswith("RayService/")) >= 3


@pytest.mark.parametrize("case", SPECS)
def test_serve_config_runs_the_app_with_the_serving_config(case):
    t, objs = _render(case)
    serve = yaml.safe_load(objs["RayService/svc"]["spec"]["serveConfigV2"])
    [app] = serve["applications"]
    assert app["import_path"] == "kvmesh.serve.app:build" and app["name"] == "svc"
    assert serve["http_options"] == {"host": "0.0.0.0", "port": 8000}
    # Proxies on every pod: KubeRay's worker readiness probe asks the local proxy.
    assert serve["proxy_location"] == "EveryNode" and t.serving_config().http_ingress == "ray_proxy"
    cfg = t.serving_config()
    assert cfg.host == "0.0.0.0"
    # args: the config without placement (scaling changes no args); placement per deployment.
    assert app["args"]["config"] == cfg.runtime_dict()
    assert ServingConfig.model_validate(app["args"]["config"]).roles().keys() == cfg.roles().keys()
    assert app["deployments"] == cfg.deployment_overrides()
    assert {d["name"] for d in app["deployments"]} == {"router", *cfg.roles()}
    assert ServingConfig.model_validate(yaml.safe_load(objs["ConfigMap/svc-config"]["data"]["serving.yaml"])) == cfg


@pytest.mark.parametrize("case", SPECS)
def test_each_role_lands_on_its_worker_group(case):
    t, objs = _render(case)
    cfg = t.serving_config()
    cluster = objs["RayService/svc"]["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"router", "decode"} | ({"prefill"} if cfg.disaggregated else set())
    asks = {"router": cfg.router, **{("decode" if r == "unified" else r): w for r, w in cfg.roles().items()}}
    for group, workload in asks.items():
        offered = json.loads(json.loads(groups[group]["rayStartParams"]["resources"]))
        assert offered == {f"kvmesh-{group}": 1} and workload.resources.custom == {f"kvmesh-{group}": 1.0}
        assert float(groups[group]["rayStartParams"]["num-cpus"]) >= workload.resources.num_cpus
        lo, hi = (workload.autoscaling.min_replicas, workload.autoscaling.max_replicas) if workload.autoscaling \
            else (workload.replicas, workload.replicas)
        assert (groups[group]["minReplicas"], groups[group]["maxReplicas"]) == (lo, hi)
    assert cluster["enableInTreeAutoscaling"] == any(w.autoscaling for w in asks.values())
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_gpu_placement_volumes_and_auth():
    _, objs = _render("disaggregated-gpu")
    groups = {g["groupName"]: g for g in objs["RayService/svc"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    prefill = groups["prefill"]["template"]["spec"]
    assert prefill["nodeSelector"] == {"gpu": "h100"}
    assert prefill["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    [container] = prefill["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert groups["prefill"]["rayStartParams"]["num-gpus"] == "1"
    assert container["volumeMounts"] == [{"name": "model-0", "mountPath": "/mnt/models/models", "readOnly": True}]
    router = groups["router"]["template"]["spec"]["containers"][0]
    assert {"name": "KVMESH_API_KEY", "valueFrom": {"secretKeyRef": {"name": "key", "key": "api-key"}}} in router["env"]
    assert all(e["name"] != "KVMESH_API_KEY" for e in container["env"])  # the key goes to router and head pods only


def _app(objs: dict[str, dict]) -> dict:
    [app] = yaml.safe_load(objs["RayService/svc"]["spec"]["serveConfigV2"])["applications"]
    return app


def test_tensor_parallel_replica_takes_a_whole_gpu_pod():
    t, objs = _render("tensor-parallel-gpu")
    groups = {g["groupName"]: g for g in objs["RayService/svc"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    decode = groups["decode"]
    # One pod per replica, offering its GPUs to Ray: the TP group fits one pod and node.
    assert (decode["replicas"], decode["rayStartParams"]["num-gpus"], decode["rayStartParams"]["num-cpus"]) == \
        (2, "2", "16")
    [container] = decode["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    labels = decode["template"]["metadata"]["labels"]
    assert (labels["kvmesh.dev/tensor-parallel"], labels["kvmesh.dev/pipeline-parallel"]) == ("2", "1")
    assert "kvmesh.dev/tensor-parallel" not in groups["router"]["template"]["metadata"]["labels"]
    # The engine config and the Ray Serve placement the app runs.
    cfg = t.serving_config()
    assert (cfg.engine.parallel.tensor_parallel_size, cfg.engine.parallel.pipeline_parallel_size) == (2, 1)
    assert _app(objs)["args"]["config"]["engine"]["parallel"]["tensor_parallel_size"] == 2
    assert cfg.engine.model.device == "cuda"
    [unified] = [d for d in _app(objs)["deployments"] if d["name"] == "unified"]
    assert unified["placement_group_strategy"] == "STRICT_PACK"
    assert unified["placement_group_bundles"] == [{"CPU": 8.0, "GPU": 2.0, "kvmesh-decode": 0.5}, {"CPU": 8.0, "kvmesh-decode": 0.5}]
    assert unified["ray_actor_options"] == {"num_cpus": 8.0, "num_gpus": 2.0, "resources": {"kvmesh-decode": 0.5}}


def test_pipeline_and_mixed_parallelism_per_role():
    t, objs = _render("pipeline-cpu-disaggregated")
    cfg = t.serving_config()
    assert cfg.engine_for("decode").parallel.world_size == 4
    prefill = cfg.engine_for("prefill").parallel
    assert (prefill.tensor_parallel_size, prefill.pipeline_parallel_size) == (1, 2)
    deps = {d["name"]: d for d in _app(objs)["deployments"]}
    # The pod holds the whole replica: STRICT_PACK even for pipeline only (no bundle on another pod).
    assert deps["prefill"]["placement_group_strategy"] == "STRICT_PACK"
    assert deps["prefill"]["placement_group_bundles"] == [{"CPU": 2.0, "kvmesh-prefill": 0.5}] * 2
    assert deps["decode"]["placement_group_bundles"] == [{"CPU": 2.0, "kvmesh-decode": 0.25}] * 4
    assert "rayStartParams" in objs["RayService/svc"]["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]
    assert all("num-gpus" not in g["rayStartParams"]
               for g in objs["RayService/svc"]["spec"]["rayClusterConfig"]["workerGroupSpecs"])


def _kuberay_labels(group_spec: dict, cluster: str) -> dict[str, str]:
    """A RayService worker pod's labels as KubeRay sets them (ray-operator common/pod.go: labelPod, BuildPod)."""
    return {**group_spec["template"]["metadata"]["labels"], "ray.io/group": group_spec["groupName"],
            "ray.io/cluster": cluster, "ray.io/node-type": "worker", "ray.io/serve": "true"}


def test_services_select_the_serving_clusters_router_pods_and_redis():
    t, objs = _render("disaggregated-gpu")
    groups = {g["groupName"]: g for g in objs["RayService/svc"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    head = objs["RayService/svc"]["spec"]["rayClusterConfig"]["headGroupSpec"]
    head_labels = {**head["template"]["metadata"]["labels"], "ray.io/group": "headgroup",
                   "ray.io/cluster": "svc-a", "ray.io/node-type": "head", "ray.io/serve": "true"}
    # Before KubeRay names the cluster that serves there is only one: every router pod of it matches.
    pinned = {o["metadata"]["name"]: o for o in render_all(replace(t, active_cluster="svc-a"))
              if o["kind"] == "Service"}
    for name, port in (("svc-grpc", 50051), ("svc-http", 8000)):
        svc = objs[f"Service/{name}"]["spec"]
        assert svc["ports"][0]["port"] == port
        assert svc["selector"] == {"kvmesh.dev/llmservice": "svc", "ray.io/group": "router", "ray.io/serve": "true"}
        assert svc["selector"].items() <= _kuberay_labels(groups["router"], "svc-a").items()
        # Then only that cluster's: an upgrade's second cluster (svc-b) gets no traffic until KubeRay switches.
        selector = pinned[name]["spec"]["selector"]
        assert selector.items() <= _kuberay_labels(groups["router"], "svc-a").items()
        assert not selector.items() <= _kuberay_labels(groups["router"], "svc-b").items()
        for other in (_kuberay_labels(groups["decode"], "svc-a"), _kuberay_labels(groups["prefill"], "svc-a"),
                      head_labels, {**_kuberay_labels(groups["router"], "svc-a"), "ray.io/serve": "false"}):
            assert not selector.items() <= other.items()
    redis = objs["Deployment/svc-redis"]["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][:4] == ["--maxmemory", str(2 * 2**30), "--maxmemory-policy", "allkeys-lru"]
    assert objs["Service/svc-redis"]["spec"]["selector"].items() <= \
        objs["Deployment/svc-redis"]["spec"]["template"]["metadata"]["labels"].items()


def test_images_and_no_managed_redis():
    _, objs = _render("autoscaling-external-redis")
    assert "Deployment/svc-redis" not in objs
    pods = [objs["RayService/svc"]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"],
            *[g["template"] for g in objs["RayService/svc"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]]]
    assert {p["spec"]["containers"][0]["image"] for p in pods} == {"registry.local/kvmesh:dev"}
    t = Target(name="svc", namespace="ml", spec=parse_spec({}), defaults=Defaults(image="x/y:1", ray_version="9.9"))
    rs = {o["kind"]: o for o in render_all(t)}["RayService"]
    assert rs["spec"]["rayClusterConfig"]["rayVersion"] == "9.9"
    assert rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == "x/y:1"


def test_rendering_is_pure():
    assert render_all(Target("a", "b", parse_spec(SPECS["disaggregated-gpu"]))) == \
        render_all(Target("a", "b", parse_spec(SPECS["disaggregated-gpu"])))
