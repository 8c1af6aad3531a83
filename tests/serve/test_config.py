"""ServingConfig: validation, per-role engine configs, and the declarative Ray Serve
application it renders (placement kept out of `args`, so scaling restarts nothing)."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from kvmesh.cli import build_parser
from kvmesh.cli.serve import serving_config_from_args
from kvmesh.serve.config import ServingConfig


def test_defaults_are_unified_embedded_no_store():
    cfg = ServingConfig()
    assert not cfg.disaggregated and list(cfg.roles()) == ["unified"]
    eng = cfg.engine_for("unified")
    # No Redis: each worker's own prefix cache only. A private memory store would copy every
    # prompt block into the host memory the CPU KV cache already lives in.
    assert eng.model.model is None and eng.kv_store is None
    assert (cfg.grpc_port, cfg.http_port) == (50051, 8000)


def test_private_memory_store_is_opt_in_and_redis_wins():
    cfg = ServingConfig.model_validate({"engine": {"kv_store": "memory"}})
    assert cfg.engine_for("unified").kv_store == "memory"
    cfg = ServingConfig.model_validate({"engine": {"kv_store": "memory"},
                                        "kv_store": {"redis_url": "redis://r:6379/0"}})
    assert cfg.engine_for("unified").kv_store == "redis://r:6379/0"


def test_roles_overrides_and_store():
    cfg = ServingConfig.model_validate({
        "prefill": {"replicas": 2, "engine_overrides": {"max_num_seqs": 4}},
        "decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 3}},
        "kv_store": {"redis_url": "redis://127.0.0.1:6379/0", "ttl_s": 60},
    })
    assert list(cfg.roles()) == ["prefill", "decode"]
    assert cfg.engine_for("prefill").scheduler.max_num_seqs == 4
    assert cfg.engine_for("decode").scheduler.max_num_seqs == 64
    assert cfg.engine_for("decode").kv_store == "redis://127.0.0.1:6379/0"
    assert cfg.engine_for("decode").kv_store_ttl_s == 60


@pytest.mark.parametrize("bad, field", [
    ({"name": "Bad_Name"}, "name"),
    ({"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 1}}}, "min_replicas"),
    ({"decode": {"replicas": -1}}, "replicas"),
    ({"router": {"config": {"picker": "nope"}}}, "picker"),
    ({"grpc_port": 70000}, "grpc_port"),
    ({"typo": 1}, "typo"),
])
def test_bad_config_names_the_field(bad, field):
    with pytest.raises(ValidationError) as e:
        ServingConfig.model_validate(bad)
    assert field in str(e.value)


def test_bad_engine_override_names_the_role():
    cfg = ServingConfig.model_validate({"prefill": {"engine_overrides": {"max_num_seqz": 4}}})
    with pytest.raises(ValueError, match="prefill.engine_overrides"):
        cfg.engine_for("prefill")


def test_scaling_changes_only_deployment_overrides():
    base = {"prefill": {"replicas": 1}, "decode": {"replicas": 1, "resources": {"num_cpus": 2}}}
    a = ServingConfig.model_validate(base)
    b = ServingConfig.model_validate({**base, "decode": {"replicas": 4, "resources": {"num_cpus": 2}}})
    app_a, app_b = a.ray_serve_application(), b.ray_serve_application()
    assert app_a["args"] == app_b["args"]  # same code version: Ray Serve scales in place
    assert app_a["deployments"] != app_b["deployments"]
    decode = next(d for d in app_b["deployments"] if d["name"] == "decode")
    assert decode["num_replicas"] == 4 and decode["ray_actor_options"]["num_cpus"] == 2
    # The args alone rebuild a config with the same roles and engines.
    runtime = ServingConfig.model_validate(app_b["args"]["config"])
    assert runtime.roles().keys() == b.roles().keys()
    assert runtime.engine_for("decode") == b.engine_for("decode")


def test_ray_serve_schema_accepts_the_application():
    from ray.serve.schema import ServeDeploySchema

    cfg = ServingConfig.model_validate({"decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 2}}})
    schema = ServeDeploySchema.model_validate({"applications": [cfg.ray_serve_application()]})
    assert schema.applications[0].import_path == "kvmesh.serve.app:build"


def test_cli_flags_override_the_file(tmp_path):
    f = tmp_path / "serving.yaml"
    f.write_text(yaml.safe_dump({"name": "svc", "engine": {"cache": {"block_size": 8}}, "decode": {"replicas": 2}}))
    args = build_parser().parse_args(["serve", "--config", str(f), "--prefill-replicas", "1", "--max-num-seqs", "7",
                                      "--redis-url", "redis://r:6379/0", "--port", "6000"])
    cfg = serving_config_from_args(args)
    assert cfg.name == "svc" and cfg.disaggregated and cfg.decode.replicas == 2
    assert cfg.engine.cache.block_size == 8 and cfg.engine.scheduler.max_num_seqs == 7
    assert cfg.kv_store.redis_url == "redis://r:6379/0" and cfg.grpc_port == 6000
    assert ServingConfig.model_validate(yaml.safe_load(cfg.to_yaml())) == cfg


def test_chat_flags_reach_the_config_and_the_router(tmp_path):
    from kvmesh.serve.local import router_args

    f = tmp_path / "serving.yaml"
    f.write_text(yaml.safe_dump({"chat": {"reasoning_parser": "qwen3"}}))
    args = build_parser().parse_args(["serve", "--config", str(f), "--tool-call-parser", "mistral",
                                      "--no-enable-auto-tool-choice"])
    cfg = serving_config_from_args(args)
    assert (cfg.chat.tool_call_parser, cfg.chat.enable_auto_tool_choice, cfg.chat.reasoning_parser) == (
        "mistral", False, "qwen3")
    assert ServingConfig().chat.tool_call_parser == "auto" and ServingConfig().chat.enable_auto_tool_choice
    child = router_args(cfg, ["127.0.0.1:1"], http=True)
    router = build_parser().parse_args(child[2:])  # what `kvmesh serve --local` starts: `kvmesh router ...`
    assert (router.chat__tool_call_parser, router.chat__enable_auto_tool_choice, router.chat__reasoning_parser) == (
        "mistral", False, "qwen3")
    with pytest.raises(ValidationError, match="tool_call_parser: unknown 'xml'"):
        ServingConfig.model_validate({"chat": {"tool_call_parser": "xml"}})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "o1"])
