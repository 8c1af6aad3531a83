"""The typed `LLMService` spec: pydantic models, validation, and the errors users see.

The CRD's openAPIV3Schema is generated from these models (`kvmesh_operator.crd`), so the
field names, enums, minimums, defaults and descriptions live here once. Field names are
the ServingConfig's, in camelCase; where a field mirrors a ServingConfig / EngineConfig
field its default, bounds and description are copied from there (`_mirror`), so the
CRD cannot drift from the engine. `mapping` turns a parsed spec into that ServingConfig.

    spec = parse_spec(body["spec"])               # SpecError says which field to change
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from kvmesh.config import (
    CacheConfig,
    LoRAConfig,
    LoRAModule,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvmesh.router.config import RouterConfig, ScorerWeight
from kvmesh.router.plugins import PLUGINS
from kvmesh.serve.config import Autoscaling, KVStoreConfig, SLOTargets, TracingConfig
from kvmesh_operator.podspec import LocalObjectReference, PodOptions, ResourcesSpec, SpecModel, cel
from kvmesh_operator.quantity import Quantity

MODEL_MOUNT = "/mnt/models"
"""Where `pvc://claim/path` model URIs are mounted in the Ray pods (`<MODEL_MOUNT>/<claim>`)."""


class SpecError(ValueError):
    """An `LLMService` spec that cannot be served; the message names the field to change."""


_Spec = SpecModel
_cel = cel


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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _mirror(ModelConfig, "dtype")
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


class ScalingSpec(_Spec):
    """Ray Serve autoscaling (worker roles: on kvmesh's queue depth, KV usage and TTFT / TPOT
    against spec.slo by default); the Ray worker group scales with it."""

    model_config = ConfigDict(**_Spec.model_config,
                              json_schema_extra=_cel(
                                  'self.minReplicas <= self.maxReplicas',
                                  'scaling.minReplicas must be <= scaling.maxReplicas'))

    min_replicas: int = _mirror(Autoscaling, "min_replicas")
    max_replicas: int = _mirror(Autoscaling, "max_replicas")
    target_ongoing_requests: float = _mirror(Autoscaling, "target_ongoing_requests")
    signals: Literal["kvmesh", "ongoing_requests"] = _mirror(Autoscaling, "signals")
    upscale_delay_seconds: float = _mirror(Autoscaling, "upscale_delay_s")
    downscale_delay_seconds: float = _mirror(Autoscaling, "downscale_delay_s")
    look_back_period_seconds: float = _mirror(Autoscaling, "look_back_period_s")

    @model_validator(mode="after")
    def _check(self) -> "ScalingSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError("scaling.minReplicas must be <= scaling.maxReplicas")
        return self


class WorkloadSpec(PodOptions):
    """One role's replicas (each one Ray worker pod): a fixed count or autoscaling, and its pods."""

    model_config = ConfigDict(**_Spec.model_config,
                              json_schema_extra=_cel(
                                  '!(has(self.replicas) && has(self.scaling))',
                                  'give either replicas or scaling, not both'))

    replicas: int | None = Field(None, ge=0, description="Fixed replica count (default 1); "
                                 "give either replicas or scaling.")
    scaling: ScalingSpec | None = Field(None, description="Autoscale instead of a fixed count.")

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


class ParallelismSpec(_Spec):
    """How one replica's model is split over GPUs (or CPU processes), as KServe's `parallelism`:
    a replica runs tensor x pipeline ranks, all in its one Ray worker pod; the router sees one
    worker per replica. Model-specific limits (heads divisible by tensor, layers by pipeline)
    are the engine's to check when it loads the model."""

    tensor: int = _mirror(ParallelConfig, "tensor_parallel_size")
    pipeline: int = _mirror(ParallelConfig, "pipeline_parallel_size")

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline


_GPU_RULE = ("!has(self.resources) || !has(self.resources.gpu) || self.resources.gpu == 0 || "
             "self.resources.gpu == (has(self.parallelism) ? self.parallelism.tensor * self.parallelism.pipeline : 1)")
_GPU_RULE_MESSAGE = ("resources.gpu must be 0 (CPU) or parallelism.tensor x parallelism.pipeline (default 1): each "
                     "rank of a replica runs on its own GPU, all in the replica's pod")


class WorkerSpec(WorkloadSpec):
    """A worker role (prefill, or decode / unified): replicas and pods as any workload, and how
    each replica splits its model (parallelism)."""

    model_config = ConfigDict(**_Spec.model_config, json_schema_extra={"x-kubernetes-validations": [
        *_cel('!(has(self.replicas) && has(self.scaling))', 'give either replicas or scaling, not both')[
            "x-kubernetes-validations"],
        {"rule": _GPU_RULE, "message": _GPU_RULE_MESSAGE}]})

    parallelism: ParallelismSpec | None = Field(
        None, description="Tensor / pipeline parallelism of each replica; unset: one rank (tensor 1, pipeline 1). "
        "resources are per replica (= per pod): give tensor x pipeline GPUs, or none for CPU ranks.")

    @property
    def world_size(self) -> int:
        return 1 if self.parallelism is None else self.parallelism.world_size

    @model_validator(mode="after")
    def _gpus(self) -> "WorkerSpec":
        gpu, world = self.resources.gpu, self.world_size
        if gpu and gpu != world:
            p = self.parallelism or ParallelismSpec()
            raise ValueError(f"resources.gpu {gpu} with parallelism tensor {p.tensor} x pipeline {p.pipeline}: each "
                             f"replica runs {world} rank{'s' if world > 1 else ''}, one GPU each, in its one pod; "
                             f"give resources.gpu: {world} (or 0 for CPU ranks), or set parallelism so that "
                             f"tensor x pipeline = {gpu}; more replicas use more GPUs")
        return self


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
        None, description="Weighted scorers; unset keeps kvmesh's defaults (prefix 2, queue 1, kv_free 0.5, lora_affinity 1).")
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


class SLOSpec(_Spec):
    """Latency targets (p90) that worker autoscaling holds: prefill replicas for TTFT, decode for TPOT."""

    ttft_seconds: float = _mirror(SLOTargets, "ttft_s")
    tpot_seconds: float = _mirror(SLOTargets, "tpot_s")
    window_seconds: float = _mirror(SLOTargets, "window_s")


class TracingSpec(_Spec):
    otlp_endpoint: str | None = _mirror(TracingConfig, "otlp_endpoint")
    sample_ratio: float = _mirror(TracingConfig, "sample_ratio")


class SecretKeyRef(_Spec):
    name: str = Field(min_length=1, description="Secret name (same namespace).")
    key: str = Field(min_length=1, description="Key in the Secret.")


class AuthSpec(_Spec):
    api_key_secret_ref: SecretKeyRef | None = Field(
        None, description="API key clients must send; given to the router and head pods as KVMESH_API_KEY.")
    internal_token_secret_ref: SecretKeyRef | None = Field(
        None, description="Token every router -> worker and worker -> worker call carries (KVMESH_INTERNAL_TOKEN); "
        "unset: the operator generates one in the Secret <name>-internal (with the KV HMAC key).")


class TLSSpec(_Spec):
    """TLS of the public endpoints (gRPC and HTTP): a kubernetes.io/tls Secret mounted into the router pods."""

    secret_name: str = Field(min_length=1, description="Secret of type kubernetes.io/tls (tls.crt, tls.key) in "
                             "the LLMService's namespace.")
    client_ca_key: str | None = Field(None, min_length=1, description="Key of a CA bundle in the same Secret; set: "
                                      "clients must present a certificate it signed (mutual TLS).")


class HeadSpec(PodOptions):
    """The Ray head pod (GCS, Serve controller, HTTP proxy): no kvmesh replica runs on it."""

    resources: ResourcesSpec = Field(default_factory=lambda: ResourcesSpec(cpu="1", memory="4Gi"),
                                     description="Ray head pod (GCS, Serve controller, HTTP proxy).")


def _string_constraints(model: type[BaseModel], field: str) -> dict[str, Any]:
    """pattern / min_length / max_length of `model.field` (kvmesh's own config), for a Field."""
    out: dict[str, Any] = {}
    for meta in model.model_fields[field].metadata:
        for key in ("pattern", "min_length", "max_length"):
            if getattr(meta, key, None) is not None:
                out[key] = getattr(meta, key)
    return out


_ADAPTER_NAME = _string_constraints(LoRAModule, "name")
ADAPTER_SOURCE_PATTERN = r"^(/|file:///|pvc://[^/]+/)"
"""The adapter sources a worker can read: the CRD's pattern (the validator below explains)."""


class LoRASpec(_Spec):
    """Multi-LoRA serving on every worker: requests for different adapters share each step.
    Set (even `lora: {}`) = on. A change here changes the workers' engine and restarts them;
    spec.adapters never does."""

    model_config = ConfigDict(**_Spec.model_config,
                              json_schema_extra=_cel(
                                  '!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras',
                                  'lora.maxCpuLoras must be >= lora.maxLoras'))

    max_loras: int = _mirror(LoRAConfig, "max_loras")
    max_lora_rank: int = _mirror(LoRAConfig, "max_lora_rank")
    max_cpu_loras: int | None = _mirror(
        LoRAConfig, "max_cpu_loras",
        description="Adapters each worker keeps in host memory (an LRU; the others are read again from "
        "their source on first use); unset = maxLoras.")

    @model_validator(mode="after")
    def _check(self) -> "LoRASpec":
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("lora.maxCpuLoras must be >= lora.maxLoras")
        return self


class AdapterSpec(_Spec):
    """A LoRA adapter (a PEFT folder): clients select it by sending its name as the OpenAI `model`."""

    name: str = Field(description="The OpenAI `model` name that selects the adapter.",
                      json_schema_extra={"pattern": _ADAPTER_NAME["pattern"],
                                         "minLength": _ADAPTER_NAME.get("min_length", 1),
                                         "maxLength": _ADAPTER_NAME.get("max_length", 128)})
    source: str = Field(
        description="Where the workers read the adapter folder: an absolute path in the image or a mounted "
        "volume (/models/adapters/sql), file:///path, or pvc://<claim>/<path> on a claim spec.model already "
        "mounts. kvmesh never downloads adapters.", json_schema_extra={"pattern": ADAPTER_SOURCE_PATTERN})

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        lo, hi = _ADAPTER_NAME.get("min_length", 1), _ADAPTER_NAME.get("max_length", 128)
        if not (lo <= len(v) <= hi) or not re.fullmatch(_ADAPTER_NAME["pattern"], v):
            raise ValueError(f"adapter name {v!r}: use {lo}-{hi} letters, digits or '._:/-' (clients send it "
                             "as the OpenAI `model`)")
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not re.match(ADAPTER_SOURCE_PATTERN, v):
            scheme = v.partition("://")[0] + "://" if "://" in v else "a relative path"
            if scheme == "pvc://":
                raise ValueError(f"adapter source {v!r}: give pvc://<claim>/<path to the adapter folder>")
            raise ValueError(f"adapter source {v!r}: the workers cannot read {scheme}; kvmesh never downloads "
                             "adapters. Copy the adapter folder into the image or the model volume and give an "
                             "absolute path (/models/adapters/sql), file:///path or pvc://<claim>/<path>")
        return v


class LLMServiceSpec(_Spec):
    """An LLM served by kvmesh on a KubeRay RayService. Giving `prefill` disaggregates prefill and decode."""

    model_config = ConfigDict(**_Spec.model_config,
                              json_schema_extra=_cel(
                                  'has(self.lora) || !has(self.adapters) || size(self.adapters) == 0',
                                  'spec.adapters needs spec.lora (lora: {} turns LoRA on with its defaults)'))

    image: str | None = Field(None, description="kvmesh runtime image; defaults to the operator's.")
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        None, description="Secrets to pull the image with, on every pod; unset: the operator's default "
        "(Helm value image.pullSecrets).")
    model: ModelSpec = Field(default_factory=ModelSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    head: HeadSpec = Field(default_factory=HeadSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    prefill: WorkerSpec | None = Field(None, description="Prefill replicas; set = disaggregated P/D.")
    decode: WorkerSpec = Field(default_factory=WorkerSpec, description="Decode (or unified) replicas.")
    cache: CacheSpec = Field(default_factory=CacheSpec)
    prompt_cache: list[PromptCacheSpec] = Field(default_factory=list, description="Prompts pinned at startup.")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="Latency targets of SLO autoscaling.")
    tracing: TracingSpec = Field(default_factory=TracingSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)
    tls: TLSSpec | None = Field(None, description="Serve gRPC and HTTP over TLS; unset: plaintext (TLS "
                                "terminated elsewhere, e.g. at a Gateway).")
    lora: LoRASpec | None = Field(None, description="Multi-LoRA serving on the workers (`lora: {}` for the "
                                  "defaults); unset = off. Changing it restarts the workers.")
    adapters: list[AdapterSpec] = Field(
        default_factory=list, description="LoRA adapters the router serves (needs spec.lora). Adding, changing "
        "or removing one reconfigures the router in place: it loads / unloads the adapter on the running "
        "workers, which are not restarted.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})

    @field_validator("adapters")
    @classmethod
    def _adapters(cls, v: list[AdapterSpec], info: ValidationInfo) -> list[AdapterSpec]:
        if not v:
            return v
        if "lora" in info.data and info.data["lora"] is None:  # (absent: lora itself is invalid)
            raise ValueError("adapters need spec.lora: add `lora: {}` (LoRA on with its defaults) or set "
                             "lora.maxLoras / maxLoraRank. Turning LoRA on changes the workers and restarts them "
                             "once; adapters alone never restart them")
        names = [a.name for a in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"adapter names must be unique; repeated: {', '.join(dup)}")
        model = info.data.get("model")
        mounted = set(pvc_claims_of(model)) if model is not None else set()
        for a in v:
            if a.source.startswith("pvc://"):
                claim = a.source.removeprefix("pvc://").partition("/")[0]
                if claim not in mounted:
                    have = f"spec.model mounts {', '.join(sorted(mounted))}" if mounted else \
                        "spec.model mounts no claim"
                    raise ValueError(f"adapter {a.name!r}: source {a.source!r} is on claim {claim!r}, which the "
                                     f"workers do not mount ({have}). Mounting a new volume restarts the workers: "
                                     "put adapters on the model's claim or in the image")
        return v

    @property
    def mode(self) -> Literal["unified", "disaggregated"]:
        return "unified" if self.prefill is None else "disaggregated"

    def workers(self) -> dict[str, WorkerSpec]:
        """Worker roles by Ray worker group name: [prefill], decode."""
        return {g: w for g, w in self.workloads().items() if isinstance(w, WorkerSpec)}

    def workloads(self) -> dict[str, WorkloadSpec]:
        """Ray worker groups by name: router, [prefill], decode."""
        groups: dict[str, WorkloadSpec] = {"router": self.router}
        if self.prefill is not None:
            groups["prefill"] = self.prefill
        groups["decode"] = self.decode
        return groups


def pvc_claims_of(model: ModelSpec) -> list[str]:
    """PersistentVolumeClaims the model URIs name, in order, without duplicates."""
    uris = [model.uri, model.draft.uri if model.draft else None]
    claims = [u.removeprefix("pvc://").partition("/")[0] for u in uris if u and u.startswith("pvc://")]
    return list(dict.fromkeys(claims))


# --- parsing ------------------------------------------------------------------------------

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")


def format_errors(err: ValidationError, prefix: str) -> str:
    """Every error of `err` as `<prefix>.<field path>: <message>`, joined by '; '."""
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
        raise SpecError(format_errors(e, "spec")) from None

