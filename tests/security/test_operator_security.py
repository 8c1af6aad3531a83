"""What the operator renders for security: TLS from a Secret on every Ray pod and in the
serving config, generated internal token / KV key / Redis password handed to the pods as
environment (never in the ConfigMap), Redis with --requirepass, NetworkPolicies that admit
only the LLMService's own pods to workers and Redis, and only them and KubeRay to the Ray head."""

from __future__ import annotations

import base64

import kubernetes_validate
import pytest
import yaml

from kvmesh.serve.config import ServingConfig
from kvmesh_operator.handlers import defaults_from_env
from kvmesh_operator.render import Target, render_all
from kvmesh_operator.security import generated_secrets, secret_manifest
from kvmesh_operator.spec import parse_spec

SPEC = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}, "cache": {"redis": {"managed": True}},
        "tls": {"secretName": "chat-tls", "clientCaKey": "ca.crt"}}


def _objs(spec=SPEC) -> dict[str, dict]:
    t = Target(name="chat", namespace="ml", spec=parse_spec(spec))
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in render_all(t)}


def _pods(objs) -> dict[str, dict]:
    cluster = objs["RayService/chat"]["spec"]["rayClusterConfig"]
    pods = {g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]}
    pods["head"] = cluster["headGroupSpec"]["template"]["spec"]
    return pods


def test_tls_secret_is_mounted_and_served():
    objs = _objs()
    serve = yaml.safe_load(objs["RayService/chat"]["spec"]["serveConfigV2"])
    assert serve["http_options"]["ssl_certfile"] == "/etc/kvmesh/tls/tls.crt"
    assert serve["http_options"]["ssl_ca_certs"] == "/etc/kvmesh/tls/ca.crt"
    cfg = ServingConfig.model_validate(serve["applications"][0]["args"]["config"])
    assert (cfg.security.tls_cert_file, cfg.security.tls_key_file) == ("/etc/kvmesh/tls/tls.crt",
                                                                       "/etc/kvmesh/tls/tls.key")
    for group, pod in _pods(objs).items():  # Ray Serve's HTTP proxy runs on every pod
        assert {"name": "kvmesh-tls", "secret": {"secretName": "chat-tls", "defaultMode": 0o440}} in pod["volumes"]
        assert {"name": "kvmesh-tls", "mountPath": "/etc/kvmesh/tls", "readOnly": True} in \
            pod["containers"][0]["volumeMounts"], group


def test_secrets_reach_the_pods_as_environment_only():
    objs = _objs()
    for group, pod in _pods(objs).items():
        env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in pod["containers"][0]["env"]}
        assert env["KVMESH_INTERNAL_TOKEN"] == {"name": "chat-internal", "key": "token"}, group
        assert env["KVMESH_KV_HMAC_KEY"] == {"name": "chat-internal", "key": "kvHmacKey"}
        assert env["KVMESH_REDIS_PASSWORD"] == {"name": "chat-redis-auth", "key": "password"}
    config = objs["ConfigMap/chat-config"]["data"]["serving.yaml"]
    assert "password" not in config and "KVMESH_" not in config and "internal_token_file: null" in config
    own = _objs({"auth": {"internalTokenSecretRef": {"name": "mine", "key": "t"}}})
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in _pods(own)["decode"]["containers"][0]["env"]}
    assert env["KVMESH_INTERNAL_TOKEN"] == {"name": "mine", "key": "t"} and "KVMESH_REDIS_PASSWORD" not in env


def test_managed_redis_requires_the_generated_password():
    container = _objs()["Deployment/chat-redis"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert container["env"] == [{"name": "REDIS_PASSWORD",
                                 "valueFrom": {"secretKeyRef": {"name": "chat-redis-auth", "key": "password"}}}]
    gens = generated_secrets("chat", parse_spec(SPEC))
    assert [(g.name, g.keys) for g in gens] == [("chat-internal", ("token", "kvHmacKey")),
                                                ("chat-redis-auth", ("password",))]
    a, b = (secret_manifest(gens[1], "ml", {}) for _ in range(2))
    assert a["data"]["password"] != b["data"]["password"]  # random per creation
    assert len(base64.b64decode(a["data"]["password"])) >= 32


def test_network_policies_admit_only_this_llmservice():
    objs = _objs()
    workers, redis = objs["NetworkPolicy/chat-workers"], objs["NetworkPolicy/chat-redis"]
    for policy in (workers, redis):
        kubernetes_validate.validate(policy, "1.35.0", strict=True)
        assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels":
                                                                         {"kvmesh.dev/llmservice": "chat"}}}]
    assert workers["spec"]["podSelector"]["matchExpressions"] == [
        {"key": "kvmesh.dev/role", "operator": "In", "values": ["prefill", "decode"]}]
    assert redis["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 6379}]
    # the pods carry the labels the policies select on
    for group in ("prefill", "decode"):
        labels = next(g for g in objs["RayService/chat"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
                      if g["groupName"] == group)["template"]["metadata"]["labels"]
        assert labels["kvmesh.dev/llmservice"] == "chat" and labels["kvmesh.dev/role"] == group
    assert "NetworkPolicy/chat-redis" not in _objs({})


def test_head_network_policy_admits_its_own_pods_and_the_kuberay_operator_only():
    objs = _objs()
    head = objs["NetworkPolicy/chat-head"]
    kubernetes_validate.validate(head, "1.35.0", strict=True)
    cluster = objs["RayService/chat"]["spec"]["rayClusterConfig"]
    head_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    assert head["spec"]["podSelector"] == {"matchLabels": {"kvmesh.dev/llmservice": "chat", "kvmesh.dev/role": "head"}}
    assert head["spec"]["podSelector"]["matchLabels"].items() <= head_labels.items()
    assert not any(head["spec"]["podSelector"]["matchLabels"].items() <= g["template"]["metadata"]["labels"].items()
                   for g in cluster["workerGroupSpecs"])
    own, kuberay = head["spec"]["ingress"]
    # Its own Ray cluster on every port: GCS 6379, dashboard 8265, client 10001 and the ports Ray picks.
    assert own == {"from": [{"podSelector": {"matchLabels": {"kvmesh.dev/llmservice": "chat"}}}]}
    # KubeRay on the dashboard (Serve REST API) and the Serve proxy's health check; never GCS or the client port.
    assert kuberay == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}},
                                 "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}],
                       "ports": [{"protocol": "TCP", "port": 8265}, {"protocol": "TCP", "port": 8000}]}
    assert head["spec"]["policyTypes"] == ["Ingress"]


def test_kuberay_selectors_come_from_the_operator_settings(monkeypatch):
    monkeypatch.setenv("KVMESH_KUBERAY_NAMESPACE_SELECTOR", '{"team": "platform"}')
    monkeypatch.setenv("KVMESH_KUBERAY_POD_SELECTOR", '{"app": "kuberay"}')
    monkeypatch.setenv("KVMESH_IMAGE_PULL_SECRETS", "ghcr, mirror")
    defaults = defaults_from_env()
    assert defaults.image_pull_secrets == ("ghcr", "mirror")
    objs = render_all(Target("chat", "ml", parse_spec({}), defaults))
    [_, kuberay] = next(o for o in objs if o["metadata"]["name"] == "chat-head")["spec"]["ingress"]
    assert kuberay["from"] == [{"namespaceSelector": {"matchLabels": {"team": "platform"}},
                                "podSelector": {"matchLabels": {"app": "kuberay"}}}]
    monkeypatch.setenv("KVMESH_KUBERAY_POD_SELECTOR", "app=kuberay")
    with pytest.raises(ValueError, match="KVMESH_KUBERAY_POD_SELECTOR: expected a JSON object"):
        defaults_from_env()
