"""The typed `LLMService` spec and its mapping onto kvmesh's `ServingConfig`.

The CRD's openAPIV3Schema is generated from these models (`kvmesh_operator.crd`), so the
field names, enums, minimums, defaults and descriptions live here once. Field names are
the ServingConfig's, in camelCase; where a field mirrors a ServingConfig / EngineConfig
field its default, bounds and description are copied from there (`_mirror`), so the
CRD cannot drift from the engine.

    spec = parse_spec(body["spec"])               # SpecError says which field to change
    cfg = to_serving_config(spec, name=..., namespace=...)   # a validated ServingConfig
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema,
                      model_validator)
from pydantic.alias_generators import to_camel

from kvmesh.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvmesh.router.config import RouterConfig, ScorerWeight
from kvmesh.router.plugins import PLUGINS
from kvmesh.serve.config import Autoscaling, KVStoreConfig, ServingConfig, TracingConfig

MODEL_MOUNT = "/mnt/models"
"""Where `pvc://claim/path` model URIs are mounted in the Ray pods (`<MODEL_MOUNT>/<claim>`)."""

REDIS_PORT = 6379
ROLES = ("router", "prefill", "decode")
"""Ray worker groups. In unified mode the `decode` group runs the `unified` deployment."""


class SpecError(ValueError):
    """An `LLMService` spec that cannot be served; the message names the field to change."""


def ray_resource(group: str) -> str:
    """The Ray custom resource a worker group's pods offer (one unit each) and its replicas ask for.

    One unit per pod and per replica pins exactly one replica of the role to each pod of the
    role's group: replicas land on the pods with the role's resources, and the router's fixed
    gRPC port never collides on one pod."""
    return f"kvmesh-{group}"


# --- quantities ---------------------------------------------------------------------------

_QUANTITY_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_SUFFIX = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def parse_quantity(q: int | str) -> float:
    """A Kubernetes quantity ('500m', '8Gi', 2) as a number (cores, bytes)."""
    if isinstance(q, int):
        return float(q)
    m = _QUANTITY_RE.match(q.strip())
    if m is None:
        raise ValueError(f"{q!r} is not a Kubernetes quantity (e.g. 2, '500m', '8Gi')")
    return float(m.group(1)) * _SUFFIX[m.group(2) or ""]


def _check_quantity(q: int | str) -> int | str:
    parse_quantity(q)
    if isinstance(q, int) and q < 0:
        raise ValueError("a quantity must be >= 0")
    return q


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}],
                    "pattern": _QUANTITY_RE.pattern, "x-kubernetes-int-or-string": True}),
]


# --- models -------------------------------------------------------------------------------

class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


def _cel(rule: str, message: str) -> dict[str, Any]:
    """A CEL rule for the CRD schema: the API server rejects what the validators below reject."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


def _mirror(model: type[BaseModel], field: str, **overrides: Any) -> Any:
    """A Field with the default, bounds and description of `model.field` (kvmesh's own config)."""
    info = model.model_fields[field]
    kw: dict[str, Any] = {"description": info.description}
    for meta in info.metadata:
        for bound in ("ge", "gt", "le", "lt"):
            if getattr(meta, bound, None) is not None:
                kw[bound] = getattr(meta, bound)
    default = info.default if info.default_factory is None else info.default_factory()
    kw.update(overrides)
    return Field(kw.pop("default", default), **kw)


class DraftSpec(_Spec):
    """Speculative decoding: a draft model or n-gram (prompt lookup) proposer; lossless."""

    method: Literal["ngram", "draft"] = Field(description="ngram (prompt lookup) or draft (a smaller model).")
    uri: str | None = Field(None, description="Draft checkpoint (same URI forms as model.uri); method=draft only.")
    num_speculative_tokens: int = _mirror(SpeculativeConfig, "num_speculative_tokens")


class ModelSpec(_Spec):
    """The model to serve. kvmesh never downloads weights: they are in the image or on a volume."""

    uri: str | None = Field(
        None, description="Checkpoint folder (HF layout): an absolute path in the image, file:///path, or "
        f"pvc://<claim>/<path> (the claim is mounted read-only at {MODEL_MOUNT}/<claim>). "
        "Unset serves the embedded SmolLM2-135M-Instruct.")
    name: str | None = Field(None, min_length=1, description="Model name clients send (OpenAI `model`); "
                             "defaults to the LLMService name.")
    dtype: Literal["float32", "bfloat16", "float16"] = _mirror(ModelConfig, "dtype")
    quantization: Literal["int8", "int4"] | None = _mirror(ModelConfig, "quantization")
    draft: DraftSpec | None = Field(None, description="Speculative decoding; unset = off.")


class EngineSpec(_Spec):
    """Engine options shared by every worker role."""

    block_size: int = _mirror(CacheConfig, "block_size")
    max_model_len: int | None = _mirror(ModelConfig, "max_model_len")
    max_num_seqs: int = _mirror(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = _mirror(SchedulerConfig, "max_num_batched_tokens")
    kv_cache_memory_fraction: float = _mirror(CacheConfig, "kv_cache_memory_fraction")
    kv_cache_memory_gb: float = _mirror(CacheConfig, "kv_cache_memory_gb")
    prefix_caching: bool = _mirror(CacheConfig, "enable_prefix_caching")


class ResourcesSpec(_Spec):
    """Per-pod (= per-replica) resources of a role; requests and limits are set equal."""

    cpu: Quantity = Field("1", description="CPU cores per pod, e.g. 2 or '500m'.")
    memory: Quantity = Field("4Gi", description="Memory per pod, e.g. '16Gi'.")
    gpu: int = Field(0, ge=0, description="NVIDIA GPUs per pod (nvidia.com/gpu); > 0 runs the engine on CUDA.")


class ScalingSpec(_Spec):
    """Ray Serve autoscaling on ongoing requests; the Ray worker group scales with it."""

    model_config = ConfigDict(**_Spec.model_config,
                              json_schema_extra=_cel(
                                  'self.minReplicas <= self.maxReplicas',
                                  'scaling.minReplicas must be <= scaling.maxReplicas'))

    min_replicas: int = _mirror(Autoscaling, "min_replicas")
    max_replicas: int = _mirror(Autoscaling, "max_replicas")
    target_ongoing_requests: float = _mirror(Autoscaling, "target_ongoing_requests")

    @model_validator(mode="after")
    def _check(self) -> "ScalingSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError("scaling.minReplicas must be <= scaling.maxReplicas")
        return self


class Toleration(_Spec):
    """A Kubernetes pod toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class WorkloadSpec(_Spec):
    """One role's replicas (each one Ray worker pod): a fixed count or autoscaling."""

    model_config = ConfigDict(**_Spec.model_config,
                              json_schema_extra=_cel(
                                  '!(has(self.replicas) && has(self.scaling))',
                                  'give either replicas or scaling, not both'))

    replicas: int | None = Field(None, ge=0, description="Fixed replica count (default 1); "
                                 "give either replicas or scaling.")
    scaling: ScalingSpec | None = Field(None, description="Autoscale instead of a fixed count.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Pod tolerations (e.g. GPU taints).")

    @model_validator(mode="after")
    def _one_of(self) -> "WorkloadSpec":
        if self.replicas is not None and self.scaling is not None:
            raise ValueError("give either replicas or scaling, not both")
        return self

    def bounds(self) -> tuple[int, int]:
        """(min, max) replicas, equal for a fixed count."""
        if self.scaling is not None:
            return self.scaling.min_replicas, self.scaling.max_replicas
        n = 1 if self.replicas is None else self.replicas
        return n, n


class ScorerSpec(_Spec):
    name: Literal[tuple(sorted(PLUGINS["scorer"]))] = Field(  # type: ignore[valid-type]
        description="Registered router scorer.")
    weight: float = _mirror(ScorerWeight, "weight")


def _router_resources() -> ResourcesSpec:
    return ResourcesSpec(cpu="1", memory="2Gi")


class RouterSpec(WorkloadSpec):
    """The public gRPC router: tokenizes, scores workers, runs the P/D flow."""

    resources: ResourcesSpec = Field(default_factory=_router_resources)
    scorers: list[ScorerSpec] | None = Field(
        None, description="Weighted scorers; unset keeps kvmesh's defaults (prefix 2, queue 1, kv_free 0.5).")
    pd_threshold_tokens: int = _mirror(RouterConfig, "pd_threshold_tokens")


class RedisSpec(_Spec):
    """The shared KV block store: a Redis the operator runs (managed) or one you run (url)."""

    model_config = ConfigDict(**_Spec.model_config,
                              json_schema_extra=_cel(
                                  'self.managed != has(self.url)',
                                  'give exactly one of managed: true or url'))

    managed: bool = Field(False, description="Run a Redis Deployment + Service for this LLMService.")
    url: str | None = Field(None, pattern=r"^rediss?://", description="redis://host:port/db of your own Redis.")
    max_memory: Quantity = Field("1Gi", description="Managed Redis memory cap (LRU eviction beyond it).")
    ttl_seconds: int = Field(int(KVStoreConfig.model_fields["ttl_s"].default), ge=1,
                             description=KVStoreConfig.model_fields["ttl_s"].description)

    @model_validator(mode="after")
    def _one_of(self) -> "RedisSpec":
        if self.managed == (self.url is not None):
            raise ValueError("give exactly one of managed: true or url")
        return self


class CacheSpec(_Spec):
    redis: RedisSpec | None = Field(None, description="Shared Redis KV store; unset keeps a store per worker.")


class PromptCacheSpec(_Spec):
    """A prompt whose KV every worker computes at startup and pins."""

    model_config = ConfigDict(**_Spec.model_config,
                              json_schema_extra=_cel(
                                  'has(self.text) != has(self.tokenIds)',
                                  'give exactly one of text or tokenIds'))

    name: str = Field(min_length=1)
    text: str | None = Field(None, description="Prompt text; give text or tokenIds.")
    token_ids: list[int] | None = Field(None, description="Prompt as token ids.")
    ttl_seconds: float | None = Field(None, gt=0, description="Unpin after this long; unset = pinned.")

    @model_validator(mode="after")
    def _one_of(self) -> "PromptCacheSpec":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError(f"promptCache {self.name!r}: give exactly one of text or tokenIds")
        return self


class TracingSpec(_Spec):
    otlp_endpoint: str | None = _mirror(TracingConfig, "otlp_endpoint")
    sample_ratio: float = _mirror(TracingConfig, "sample_ratio")


class SecretKeyRef(_Spec):
    name: str = Field(min_length=1, description="Secret name (same namespace).")
    key: str = Field(min_length=1, description="Key in the Secret.")


class AuthSpec(_Spec):
    api_key_secret_ref: SecretKeyRef | None = Field(
        None, description="API key clients must send; given to the router and head pods as KVMESH_API_KEY.")


class HeadSpec(_Spec):
    resources: ResourcesSpec = Field(default_factory=lambda: ResourcesSpec(cpu="1", memory="4Gi"),
                                     description="Ray head pod (GCS, Serve controller, HTTP proxy).")


class LLMServiceSpec(_Spec):
    """An LLM served by kvmesh on a KubeRay RayService. Giving `prefill` disaggregates prefill and decode."""

    image: str | None = Field(None, description="kvmesh runtime image; defaults to the operator's.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    head: HeadSpec = Field(default_factory=HeadSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    prefill: WorkloadSpec | None = Field(None, description="Prefill replicas; set = disaggregated P/D.")
    decode: WorkloadSpec = Field(default_factory=WorkloadSpec, description="Decode (or unified) replicas.")
    cache: CacheSpec = Field(default_factory=CacheSpec)
    prompt_cache: list[PromptCacheSpec] = Field(default_factory=list, description="Prompts pinned at startup.")
    tracing: TracingSpec = Field(default_factory=TracingSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)

    @property
    def mode(self) -> Literal["unified", "disaggregated"]:
        return "unified" if self.prefill is None else "disaggregated"

    def workloads(self) -> dict[str, WorkloadSpec]:
        """Ray worker groups by name: router, [prefill], decode."""
        groups: dict[str, WorkloadSpec] = {"router": self.router}
        if self.prefill is not None:
            groups["prefill"] = self.prefill
        groups["decode"] = self.decode
        return groups


# --- parsing and mapping ------------------------------------------------------------------

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")


def _format(err: ValidationError, prefix: str) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]))
        parts.append(f"{loc}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def check_name(name: str) -> None:
    """LLMService names become Service names (`<name>-grpc`) and the Ray Serve app name."""
    if not _NAME_RE.match(name):
        raise SpecError(f"metadata.name {name!r}: use 1-40 lowercase letters, digits or '-', starting with "
                        "a letter (it names Services and the Ray Serve application)")


def parse_spec(raw: Any) -> LLMServiceSpec:
    """Validate a CR's `spec` mapping; raises SpecError with every offending field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(f"spec must be a mapping, got {type(raw).__name__}")
    try:
        return LLMServiceSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(_format(e, "spec")) from None


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
    uris = [spec.model.uri, spec.model.draft.uri if spec.model.draft else None]
    claims = [u.removeprefix("pvc://").partition("/")[0] for u in uris if u and u.startswith("pvc://")]
    return list(dict.fromkeys(claims))


def redis_service_name(name: str) -> str:
    return f"{name}-redis"


def _resources(w: WorkloadSpec, group: str) -> dict[str, Any]:
    return {"num_cpus": parse_quantity(w.resources.cpu), "num_gpus": float(w.resources.gpu),
            "custom": {ray_resource(group): 1.0}}


def _workload(w: WorkloadSpec, group: str) -> dict[str, Any]:
    out: dict[str, Any] = {"resources": _resources(w, group), "node_selector": dict(w.node_selector),
                           "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in w.tolerations]}
    if w.scaling is not None:
        out["autoscaling"] = {"min_replicas": w.scaling.min_replicas, "max_replicas": w.scaling.max_replicas,
                              "target_ongoing_requests": w.scaling.target_ongoing_requests}
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
    }
    if m.draft is not None:
        engine["speculative"] = {"method": m.draft.method, "model": resolve_uri(m.draft.uri, "spec.model.draft.uri"),
                                 "num_speculative_tokens": m.draft.num_speculative_tokens}
    return engine


def to_serving_config(spec: LLMServiceSpec, *, name: str = "kvmesh", namespace: str = "default") -> ServingConfig:
    """The ServingConfig the Ray Serve app (`kvmesh.serve.app:build`) runs for this spec.

    Listens on 0.0.0.0 (inside pods); each role's replicas ask for their group's Ray
    custom resource; a managed Redis is reached through its Service's cluster DNS name.
    Raises SpecError when kvmesh's own config rejects the combination (e.g. float16 on CPU)."""
    check_name(name)
    router = _workload(spec.router, "router")
    router["config"] = {"pd_threshold_tokens": spec.router.pd_threshold_tokens}
    if spec.router.scorers is not None:
        router["config"]["scorers"] = [s.model_dump() for s in spec.router.scorers]
    data: dict[str, Any] = {
        "name": name, "model_id": spec.model.name or name, "engine": _engine(spec), "router": router,
        "decode": _workload(spec.decode, "decode"),
        "tracing": {"otlp_endpoint": spec.tracing.otlp_endpoint, "sample_ratio": spec.tracing.sample_ratio,
                    "service_name": name},
        "host": "0.0.0.0",
    }
    if spec.prefill is not None:
        data["prefill"] = _workload(spec.prefill, "prefill")
        if (spec.prefill.resources.gpu > 0) != (spec.decode.resources.gpu > 0):
            data["prefill"]["engine_overrides"] = {"device": "cuda" if spec.prefill.resources.gpu else "cpu"}
    redis = spec.cache.redis
    if redis is not None:
        url = redis.url or f"redis://{redis_service_name(name)}.{namespace}.svc:{REDIS_PORT}/0"
        data["kv_store"] = {"redis_url": url, "ttl_s": float(redis.ttl_seconds)}
    try:
        cfg = ServingConfig.model_validate(data)
        for role in cfg.roles():
            cfg.engine_for(role)
    except ValidationError as e:
        raise SpecError(f"the serving config this spec maps to is invalid: {_format(e, 'servingConfig')}") from None
    except ValueError as e:
        raise SpecError(f"the serving config this spec maps to is invalid: {e}") from None
    return cfg


def ray_cpus(q: int | str) -> int:
    """Whole CPUs a Ray node advertises for a pod's CPU quantity (`ray start --num-cpus` is an int)."""
    return max(1, math.ceil(parse_quantity(q)))
