"""A parsed `LLMService` spec -> the kvmesh `ServingConfig` its Ray Serve app runs.

`to_serving_config` builds kvmesh's own config model and validates it as `kvmesh serve`
would, so a combination the engine rejects (e.g. float16 on CPU) is reported on the
LLMService instead of in a crashing pod. The names the manifests share with this config
(a worker group's Ray custom resource, the managed Redis Service, the claims behind
pvc:// model URIs) live here too.

    cfg = to_serving_config(spec, name=..., namespace=...)   # a validated ServingConfig
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvmesh.serve.config import ServingConfig
from kvmesh_operator.quantity import parse_quantity
from kvmesh_operator.spec import (
    MODEL_MOUNT,
    LLMServiceSpec,
    ParallelismSpec,
    SpecError,
    WorkerSpec,
    WorkloadSpec,
    check_name,
    format_errors,
    pvc_claims_of,
)

REDIS_PORT = 6379
TLS_MOUNT = "/etc/kvmesh/tls"
"""Where spec.tls.secretName is mounted in the router (and head) pods."""
ROLES = ("router", "prefill", "decode")
"""Ray worker groups. In unified mode the `decode` group runs the `unified` deployment."""


def ray_resource(group: str) -> str:
    """The Ray custom resource a worker group's pods offer (one unit each) and its replicas ask for.

    One unit per pod and per replica pins exactly one replica of the role to each pod of the
    role's group: replicas land on the pods with the role's resources, and the router's fixed
    gRPC port never collides on one pod."""
    return f"kvmesh-{group}"


def resolve_uri(uri: str | None, field: str) -> str | None:
    """A model URI as the folder the engine opens inside the pod (see ModelSpec.uri)."""
    if uri is None:
        return None
    if uri.startswith("file://"):
        uri = uri.removeprefix("file://")
    if uri.startswith("/"):
        return uri
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        if not claim:
            raise SpecError(f"{field} {uri!r}: pvc:// needs a claim name, e.g. pvc://models/llama-3-8b")
        return f"{MODEL_MOUNT}/{claim}/{path}".rstrip("/")
    raise SpecError(f"{field} {uri!r}: kvmesh never downloads weights; use an absolute path in the image, "
                    "file:///path or pvc://<claim>/<path>")


def pvc_claims(spec: LLMServiceSpec) -> list[str]:
    """PersistentVolumeClaims the model URIs name, in order, without duplicates."""
    return pvc_claims_of(spec.model)


def redis_service_name(name: str) -> str:
    return f"{name}-redis"


def _resources(w: WorkloadSpec, group: str) -> dict[str, Any]:
    return {"num_cpus": parse_quantity(w.resources.cpu), "num_gpus": float(w.resources.gpu),
            "custom": {ray_resource(group): 1.0}}


def _parallel(w: WorkerSpec) -> dict[str, int]:
    p = w.parallelism or ParallelismSpec()
    return {"tensor_parallel_size": p.tensor, "pipeline_parallel_size": p.pipeline}


def _workload(w: WorkloadSpec, group: str) -> dict[str, Any]:
    out: dict[str, Any] = {"resources": _resources(w, group), "node_selector": dict(w.node_selector),
                           "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in w.tolerations]}
    if isinstance(w, WorkerSpec) and w.world_size > 1:
        # All ranks of a replica are in its one pod (render.worker_group sizes it so): never
        # let Ray put a rank's bundle on another pod, even for pipeline-only groups.
        out["placement_strategy"] = "STRICT_PACK"
    if w.scaling is not None:
        out["autoscaling"] = {"min_replicas": w.scaling.min_replicas, "max_replicas": w.scaling.max_replicas,
                              "target_ongoing_requests": w.scaling.target_ongoing_requests,
                              "signals": w.scaling.signals, "upscale_delay_s": w.scaling.upscale_delay_seconds,
                              "downscale_delay_s": w.scaling.downscale_delay_seconds,
                              "look_back_period_s": w.scaling.look_back_period_seconds}
    else:
        out["replicas"] = w.bounds()[0]
    return out


def _engine(spec: LLMServiceSpec) -> dict[str, Any]:
    m, e = spec.model, spec.engine
    model: dict[str, Any] = {"model": resolve_uri(m.uri, "spec.model.uri"), "dtype": m.dtype,
                             "quantization": m.quantization, "max_model_len": e.max_model_len,
                             "device": "cuda" if spec.decode.resources.gpu > 0 else "cpu"}
    engine: dict[str, Any] = {
        "model": model,
        "cache": {"block_size": e.block_size, "kv_cache_memory_fraction": e.kv_cache_memory_fraction,
                  "kv_cache_memory_gb": e.kv_cache_memory_gb, "enable_prefix_caching": e.prefix_caching},
        "scheduler": {"max_num_seqs": e.max_num_seqs, "max_num_batched_tokens": e.max_num_batched_tokens},
        "prompt_cache": [{"name": p.name, "text": p.text, "token_ids": p.token_ids, "ttl_s": p.ttl_seconds}
                         for p in spec.prompt_cache],
        "parallel": _parallel(spec.decode),
    }
    if spec.lora is not None:
        # No modules: adapters reach the workers through the router at run time (router_user_config),
        # so adding or removing one changes no worker's config.
        engine["lora"] = {"max_loras": spec.lora.max_loras, "max_lora_rank": spec.lora.max_lora_rank,
                          "max_cpu_loras": spec.lora.max_cpu_loras, "modules": []}
    if m.draft is not None:
        engine["speculative"] = {"method": m.draft.method, "model": resolve_uri(m.draft.uri, "spec.model.draft.uri"),
                                 "num_speculative_tokens": m.draft.num_speculative_tokens}
    return engine


def adapters(spec: LLMServiceSpec) -> list[tuple[str, str]]:
    """spec.adapters as (name, path inside the worker pods), in spec order."""
    return [(a.name, resolve_uri(a.source, f"spec.adapters[{a.name}].source") or "") for a in spec.adapters]


def router_user_config(spec: LLMServiceSpec) -> dict[str, Any] | None:
    """The router deployment's Ray Serve `user_config`: what can change without restarting a replica.

    Ray Serve calls `RouterDeployment.reconfigure` with it on every router replica, at start and
    whenever it changes (an in-place update: no replica, and no worker, restarts). None while LoRA
    is off; with LoRA on, an empty list unloads every adapter."""
    if spec.lora is None:
        return None
    return {"adapters": [{"name": name, "path": path} for name, path in adapters(spec)]}


def to_serving_config(spec: LLMServiceSpec, *, name: str = "kvmesh", namespace: str = "default") -> ServingConfig:
    """The ServingConfig the Ray Serve app (`kvmesh.serve.app:build`) runs for this spec.

    Listens on 0.0.0.0 (inside pods); each role's replicas ask for their group's Ray
    custom resource; a managed Redis is reached through its Service's cluster DNS name.
    Raises SpecError when kvmesh's own config rejects the combination (e.g. float16 on CPU)."""
    check_name(name)
    model_id = spec.model.name or name
    for a in spec.adapters:
        if a.name == model_id:
            raise SpecError(f"spec.adapters: adapter name {a.name!r} is the base model's name (spec.model.name, "
                            "else the LLMService name); clients select an adapter by its name, so give it another")
    router = _workload(spec.router, "router")
    router["config"] = {"pd_threshold_tokens": spec.router.pd_threshold_tokens}
    if spec.router.scorers is not None:
        router["config"]["scorers"] = [s.model_dump() for s in spec.router.scorers]
    data: dict[str, Any] = {
        "name": name, "model_id": model_id, "engine": _engine(spec), "router": router,
        "decode": _workload(spec.decode, "decode"),
        "slo": {"ttft_s": spec.slo.ttft_seconds, "tpot_s": spec.slo.tpot_seconds,
                "window_s": spec.slo.window_seconds},
        "tracing": {"otlp_endpoint": spec.tracing.otlp_endpoint, "sample_ratio": spec.tracing.sample_ratio,
                    "service_name": name},
        "host": "0.0.0.0",
        # Ray Serve's proxy on every pod serves HTTP under KubeRay: KubeRay's readiness probe of
        # every worker pod asks the local proxy (localhost:8000/-/healthz), so without proxies
        # the decode / prefill pods never turn Ready (ray-project/kuberay#4994).
        "http_ingress": "ray_proxy",
    }
    if spec.prefill is not None:
        data["prefill"] = _workload(spec.prefill, "prefill")
        overrides: dict[str, Any] = {}
        if (spec.prefill.resources.gpu > 0) != (spec.decode.resources.gpu > 0):
            overrides["device"] = "cuda" if spec.prefill.resources.gpu else "cpu"
        if _parallel(spec.prefill) != _parallel(spec.decode):
            overrides.update(_parallel(spec.prefill))
        if overrides:
            data["prefill"]["engine_overrides"] = overrides
    if spec.tls is not None:
        data["security"] = {"tls_cert_file": f"{TLS_MOUNT}/tls.crt", "tls_key_file": f"{TLS_MOUNT}/tls.key"}
        if spec.tls.client_ca_key:
            data["security"]["tls_client_ca_file"] = f"{TLS_MOUNT}/{spec.tls.client_ca_key}"
    redis = spec.cache.redis
    if redis is not None:
        url = redis.url or f"redis://{redis_service_name(name)}.{namespace}.svc:{REDIS_PORT}/0"
        data["kv_store"] = {"redis_url": url, "ttl_s": float(redis.ttl_seconds)}
    try:
        cfg = ServingConfig.model_validate(data)
        for role in cfg.roles():
            cfg.engine_for(role)
            cfg.placement(role)
    except ValidationError as e:
        raise SpecError(f"the serving config this spec maps to is invalid: {format_errors(e, 'servingConfig')}") from None
    except ValueError as e:
        raise SpecError(f"the serving config this spec maps to is invalid: {e}") from None
    return cfg
