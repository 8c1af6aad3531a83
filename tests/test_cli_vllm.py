"""`kvmesh serve` read as vLLM users type it: the positional model, --served-model-name,
--api-key, --ssl-*, --gpu-memory-utilization, --speculative-config and the --port note.
Parsing only (the serving itself: tests/serve/test_serve_vllm_flags.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from kvmesh.cli import build_parser
from kvmesh.cli.serve import port_notes, serving_config_from_args
from kvmesh.cli.vllm_args import apply_api_key, speculative_from_vllm
from kvmesh.config import EngineConfig


def serve_config(*argv: str):
    return serving_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_positional_model_is_model(tmp_path):
    assert serve_config("/models/llama").engine.model.model == "/models/llama"
    assert serve_config("--model", "/models/llama").engine.model.model == "/models/llama"
    assert serve_config("/models/llama", "--model", "/models/llama").engine.model.model == "/models/llama"
    (tmp_path / "m").mkdir()
    os.symlink(tmp_path / "m", tmp_path / "link")  # one folder by two paths is one model
    assert serve_config(str(tmp_path / "m"), "--model", str(tmp_path / "link")).engine.model.model
    with pytest.raises(ValueError, match="given twice") as e:
        serve_config("/models/a", "--model", "/models/b")
    assert "'/models/a' (positional) and --model '/models/b'" in str(e.value)


def test_two_models_as_a_user_types_them_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "/models/a", "--model", "/models/b", "--local"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "kvmesh: error: the model is given twice" in r.stderr
    assert "Traceback" not in r.stderr


def test_served_model_name_is_the_model_id():
    assert serve_config().model_id == "kvmesh"
    assert serve_config("--served-model-name", "smol").model_id == "smol"
    with pytest.raises(ValueError, match="one name"):
        serve_config("--served-model-name", "a", "b")
    router = build_parser().parse_args(["router", "--worker", "h:1", "--served-model-name", "smol"])
    worker = build_parser().parse_args(["worker", "--served-model-name", "smol"])
    assert router.model_id == worker.model_id == "smol"


def test_ssl_flags_are_the_tls_flags():
    sec = serve_config("--ssl-certfile", "/c.pem", "--ssl-keyfile", "/k.pem", "--ssl-ca-certs", "/ca.pem").security
    assert (sec.tls_cert_file, sec.tls_key_file, sec.tls_client_ca_file) == ("/c.pem", "/k.pem", "/ca.pem")
    assert serve_config("--tls-cert", "/c.pem", "--tls-key", "/k.pem").security.tls_cert_file == "/c.pem"
    router = build_parser().parse_args(["router", "--worker", "h:1", "--ssl-certfile", "/c", "--ssl-keyfile", "/k"])
    assert (router.tls_cert, router.tls_key) == ("/c", "/k")


def test_host_binds_both_endpoints():
    cfg = serve_config("--host", "0.0.0.0", "--port", "9000", "--http-port", "9001")
    assert (cfg.host, cfg.grpc_port, cfg.http_port) == ("0.0.0.0", 9000, 9001)


def test_api_key_sets_the_key_the_servers_check(monkeypatch):
    from kvmesh.rpc.auth import ApiKeys

    monkeypatch.setenv("KVMESH_API_KEY", "")  # restored (or removed again) after the test
    monkeypatch.delenv("KVMESH_API_KEY")
    args = build_parser().parse_args(["serve", "--api-key", "k"])
    with pytest.raises(ValueError, match="--address joins a running Ray cluster"):
        apply_api_key(args, remote=True)
    assert "KVMESH_API_KEY" not in os.environ
    apply_api_key(args)
    keys = ApiKeys.from_env()
    assert keys.tenant_of("Bearer k") is not None and keys.tenant_of("Bearer x") is None


def test_port_note_for_vllm_users():
    def notes(*argv):
        return port_notes(build_parser().parse_args(["serve", *argv]))

    assert "gRPC port" in notes("--port", "8000")[0] and "--http-port (8000)" in notes("--port", "8000")[0]
    assert "add --http-port PORT" in notes("--local", "--port", "8000")[0]
    assert "only with --http-port" in notes("--local")[0]
    assert notes() == notes("--port", "9000", "--http-port", "8000") == []


def test_speculative_config_maps_onto_kvmesh_speculation():
    ngram = serve_config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                                 '"prompt_lookup_max": 3, "prompt_lookup_min": 2}').engine.speculative
    assert (ngram.method, ngram.num_speculative_tokens, ngram.ngram_max, ngram.ngram_min) == ("ngram", 4, 3, 2)
    draft = serve_config("--speculative-config", '{"model": "/draft", "num_speculative_tokens": 5, '
                                                 '"disable_by_batch_size": 6}').engine.speculative
    assert (draft.method, draft.model, draft.num_speculative_tokens, draft.max_batch_size) == ("draft", "/draft", 5, 6)
    assert speculative_from_vllm({"method": "ngram", "prompt_lookup_min": 6}) == {
        "method": "ngram", "ngram_min": 6, "ngram_max": 6}
    for bad, says in (({"method": "eagle", "model": "x"}, "not served"), ({"num_speculative_tokens": 2}, "draft"),
                      ({"method": "ngram", "model": "x"}, "no model"), ({"method": "ngram", "foo": 1}, "foo"),
                      ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens")):
        with pytest.raises(ValueError, match=says):
            speculative_from_vllm(bad)
    with pytest.raises(SystemExit):  # argparse reports the bad JSON as a usage error
        build_parser().parse_args(["serve", "--speculative-config", "{nope"])
    with pytest.raises(ValueError, match="drop --num-speculative-tokens"):
        serve_config("--speculative-config", '{"method": "ngram"}', "--num-speculative-tokens", "3")
    gen = build_parser().parse_args(["generate", "hi", "--speculative-config", '{"method": "ngram"}'])
    assert gen.engine_speculative_config == {"method": "ngram"}


def test_gpu_memory_utilization_scales_the_kv_budget():
    from kvmesh.build import _auto_num_blocks
    from kvmesh.worker.model_runner import KVCacheSpec

    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    cpu = torch.device("cpu")
    full = _auto_num_blocks(EngineConfig.from_kwargs(kv_cache_memory_gb=1.0), spec, cpu)
    half = _auto_num_blocks(EngineConfig.from_kwargs(kv_cache_memory_gb=1.0, gpu_memory_utilization=0.5), spec, cpu)
    assert full == (1 << 30) // spec.bytes_per_block and half == full // 2
    cfg = serve_config("--gpu-memory-utilization", "0.9")
    assert cfg.engine.cache.gpu_memory_utilization == 0.9
    with pytest.raises(ValueError):
        serve_config("--gpu-memory-utilization", "1.5")


def test_serve_help_names_the_vllm_flags():
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction))
    text = serve.choices["serve"].format_help()
    for flag in ("MODEL", "--served-model-name", "--api-key", "--ssl-certfile", "--ssl-keyfile",
                 "--gpu-memory-utilization", "--speculative-config", "--host", "--http-port"):
        assert flag in text, flag
