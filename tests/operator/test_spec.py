"""LLMService spec -> ServingConfig: mapping, defaults shared with kvmesh, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from k8s_helpers import ROOT
from kvmesh.serve.config import ServingConfig
from kvmesh_operator.mapping import to_serving_config
from kvmesh_operator.quantity import parse_quantity, ray_cpus
from kvmesh_operator.spec import SpecError, parse_spec


def test_empty_spec_is_unified_with_kvmesh_defaults():
    spec = parse_spec({})
    cfg = to_serving_config(spec, name="chat")
    assert spec.mode == "unified" and cfg.roles().keys() == {"unified"}
    assert (cfg.name, cfg.model_id, cfg.host) == ("chat", "chat", "0.0.0.0")
    assert cfg.engine.cache.block_size == ServingConfig().engine.cache.block_size
    assert cfg.decode.replicas == 1 and cfg.decode.resources.custom == {"kvmesh-decode": 1.0}
    assert cfg.router.resources.custom == {"kvmesh-router": 1.0}
    assert cfg.kv_store.redis_url is None


def test_disaggregated_spec_maps_every_field():
    spec = parse_spec({
        "model": {"uri": "pvc://models/llama", "name": "llama", "dtype": "bfloat16", "quantization": "int8",
                  "draft": {"method": "draft", "uri": "/models/draft", "numSpeculativeTokens": 3}},
        "engine": {"blockSize": 32, "maxModelLen": 4096, "maxNumSeqs": 8, "maxNumBatchedTokens": 512,
                   "kvCacheMemoryFraction": 0.5, "prefixCaching": False},
        "router": {"replicas": 2, "scorers": [{"name": "queue", "weight": 3}], "pdThresholdTokens": 64},
        "prefill": {"replicas": 2, "resources": {"cpu": "500m", "gpu": 1}},
        "decode": {"scaling": {"minReplicas": 2, "maxReplicas": 6, "targetOngoingRequests": 4},
                   "resources": {"cpu": 4, "gpu": 1}},
        "cache": {"redis": {"managed": True, "ttlSeconds": 60}},
        "promptCache": [{"name": "sys", "tokenIds": [1, 2, 3]}],
        "tracing": {"otlpEndpoint": "http://otel:4317", "sampleRatio": 0.5},
    })
    cfg = to_serving_config(spec, name="llama", namespace="ml")
    assert cfg.disaggregated and cfg.model_id == "llama"
    m = cfg.engine.model
    assert (m.model, m.dtype, m.quantization, m.device, m.max_model_len) == (
        "/mnt/models/models/llama", "bfloat16", "int8", "cuda", 4096)
    assert (cfg.engine.cache.block_size, cfg.engine.cache.enable_prefix_caching) == (32, False)
    assert cfg.engine.cache.kv_cache_memory_fraction == 0.5
    assert (cfg.engine.scheduler.max_num_seqs, cfg.engine.scheduler.max_num_batched_tokens) == (8, 512)
    assert cfg.engine.speculative.model == "/models/draft" and cfg.engine.speculative.num_speculative_tokens == 3
    assert cfg.engine.prompt_cache[0].token_ids == [1, 2, 3]
    assert cfg.router.replicas == 2 and cfg.router.config.pd_threshold_tokens == 64
    assert [(s.name, s.weight) for s in cfg.router.config.scorers] == [("queue", 3.0)]
    assert cfg.prefill.replicas == 2 and cfg.prefill.resources.num_cpus == 0.5
    assert cfg.prefill.resources.custom == {"kvmesh-prefill": 1.0}
    a = cfg.decode.autoscaling
    assert (a.min_replicas, a.max_replicas, a.target_ongoing_requests) == (2, 6, 4)
    assert cfg.kv_store.redis_url == "redis://llama-redis.ml.svc:6379/0" and cfg.kv_store.ttl_s == 60
    assert cfg.tracing.otlp_endpoint == "http://otel:4317" and cfg.tracing.sample_ratio == 0.5
    assert ServingConfig.model_validate(cfg.model_dump(mode="json")) == cfg


@pytest.mark.parametrize("raw, message", [
    ({"decode": {"replicas": 1, "scaling": {}}}, "spec.decode: give either replicas or scaling"),
    ({"decode": {"scaling": {"minReplicas": 3, "maxReplicas": 2}}}, "minReplicas must be <= scaling.maxReplicas"),
    ({"decode": {"resources": {"cpu": "two"}}}, "spec.decode.resources.cpu"),
    ({"engine": {"blockSize": 0}}, "spec.engine.blockSize"),
    ({"router": {"scorers": [{"name": "nope"}]}}, "spec.router.scorers.0.name"),
    ({"cache": {"redis": {"managed": True, "url": "redis://x:6379"}}}, "exactly one of managed"),
    ({"promptCache": [{"name": "p"}]}, "exactly one of text or tokenIds"),
    ({"modle": {}}, "spec.modle: Extra inputs are not permitted"),
    ({"model": {"uri": "hf://meta/llama"}}, "never downloads weights"),
    ({"model": {"dtype": "float16"}}, "float16 is not supported on CPU"),
    ("nope", "spec must be a mapping"),
])
def test_bad_specs_name_the_field(raw, message):
    with pytest.raises(SpecError, match=None) as err:
        to_serving_config(parse_spec(raw))
    assert message in str(err.value)


def test_bad_name():
    with pytest.raises(SpecError, match="metadata.name"):
        to_serving_config(parse_spec({}), name="9lives")


def test_quantities():
    assert parse_quantity("500m") == 0.5 and parse_quantity("2Gi") == 2 * 2**30 and parse_quantity(3) == 3
    assert ray_cpus("500m") == 1 and ray_cpus("2.5") == 3
    with pytest.raises(ValueError):
        parse_quantity("1.5.2")


def test_operator_imports_no_torch():
    code = ("import sys, kvmesh_operator.handlers, kvmesh_operator.crd; "
            "assert 'torch' not in sys.modules, 'the operator must stay light'")
    env = {"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'platform'}", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
