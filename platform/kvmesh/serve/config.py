"""The serving config: one typed model for a whole kvmesh deployment.

`kvmesh serve --config FILE.yaml` reads it, `kvmesh.serve.app.build_app` turns it into a
Ray Serve application, and the Kubernetes operator renders it from an `LLMService` spec
(field names follow the CRD's, in snake_case). Omitting `prefill` gives unified serving
(every `decode` replica prefills its own prompts); giving it means disaggregated P/D.

Example (YAML)::

    name: kvmesh
    engine:
      model: {dtype: float32}
      cache: {block_size: 16}
    router: {replicas: 1, config: {pd_threshold_tokens: 256}}
    prefill: {replicas: 1, resources: {num_cpus: 1}}
    decode:
      autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}
    kv_store: {redis_url: redis://127.0.0.1:6379/0}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmesh.chat.config import ChatConfig
from kvmesh.config import EngineConfig, TracingConfig
from kvmesh.router.config import RouterConfig
from kvmesh.serve.autoscale import policy_config
from kvmesh.serve.placement import placement_options

WORKER_ROLES = ("prefill", "decode", "unified")


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Resources(_Base):
    """What one replica asks Ray for (logical resources: Ray places by them)."""

    num_cpus: float = Field(1.0, ge=0, description="CPUs per replica (fractions allowed).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (fractions allowed).")
    memory_gb: float | None = Field(None, gt=0, description="Memory reserved per replica, GiB.")
    custom: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources, e.g. {kvmesh-decode: 1}: the operator gives each role's Ray "
        "worker group one such resource so the role's replicas land on its pods.",
    )

    def ray_actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory_gb is not None:
            opts["memory"] = int(self.memory_gb * (1 << 30))
        if self.custom:
            opts["resources"] = dict(self.custom)
        return opts


class Autoscaling(_Base):
    """Ray Serve autoscaling of one role. Worker roles follow kvmesh's own signals by
    default (kvmesh.serve.autoscale: queue depth, KV usage, TTFT / TPOT p90 against `slo`);
    the router, and any role with `signals: ongoing_requests`, follow Ray's count of
    ongoing requests per replica."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Requests in flight per replica that autoscaling aims for."
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, description="Seconds a decision to add replicas must hold before Ray acts on it.")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="Seconds a decision to remove replicas must hold before Ray acts on it.")
    look_back_period_s: float = Field(
        30.0, gt=0, description="Seconds over which Ray aggregates each replica's metrics before the policy "
        "reads them (Ray Serve's look_back_period_s; kvmesh's policy reads the peak, Ray's the mean).")
    metrics_interval_s: float | None = Field(
        None, gt=0, description="Seconds between a replica's metric pushes to Ray's controller; None keeps "
        "Ray's default (10 s; Ray marks the field deprecated in favour of "
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S). Must stay below look_back_period_s.")
    busy_high: float | None = Field(
        None, gt=0, le=1, description="kvmesh signals: also add a replica when the role's replicas spend more than "
        "this fraction of the time in engine steps (a utilization that leads TTFT where steps are compute-bound "
        "at small batches, as on CPU); unset: busy is not a signal.")
    signals: Literal["kvmesh", "ongoing_requests"] = Field(
        "kvmesh", description="kvmesh: scale worker roles on queue depth, KV usage and TTFT / TPOT against the "
        "config's slo; ongoing_requests: Ray Serve's default policy (sees only calls through Ray).")

    @model_validator(mode="after")
    def _check(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.min_replicas must be <= max_replicas")
        if self.metrics_interval_s is not None and self.metrics_interval_s >= self.look_back_period_s:
            raise ValueError("autoscaling.metrics_interval_s must be < look_back_period_s (Ray aggregates pushes "
                             "over the look-back period)")
        return self

    def ray(self, role: str | None = None, slo: "SLOTargets | None" = None) -> dict[str, Any]:
        """Ray Serve's autoscaling_config; a worker `role` with `slo` gets the kvmesh policy."""
        out = {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
        }
        if self.metrics_interval_s is not None:  # unset: Ray's default, and no deprecation warning
            out["metrics_interval_s"] = self.metrics_interval_s
        if self.signals == "kvmesh" and role in WORKER_ROLES and slo is not None:
            out["policy"] = policy_config(role, slo.ttft_s, slo.tpot_s, self.busy_high)
            # The policy reads each metric's peak over the look-back, not its mean: the mean
            # lags a load step by half the look-back (measured: the ramp's first upscale came
            # ~15 s after the step with a 4-s look-back), while the peak reacts to the first
            # push over target and holds it for the look-back, so a momentary lull in the
            # queue does not count as room to scale down either.
            out["aggregation_function"] = "max"
        return out


class Workload(_Base):
    """One role's replicas: a fixed count or autoscaling, and per-replica resources.

    `node_selector` and `tolerations` only matter on Kubernetes (the operator puts
    them on the Ray worker group of this role)."""

    replicas: int = Field(1, ge=0, description="Fixed replica count (ignored when autoscaling is set).")
    autoscaling: Autoscaling | None = Field(None, description="Autoscale instead of a fixed count.")
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    engine_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Flat engine options for this role only (e.g. {max_num_seqs: 8} for prefill).",
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] | None = Field(
        None, description="Ray placement group strategy of a replica with several ranks (tensor / pipeline "
        "parallelism); unset: STRICT_PACK with tensor parallelism (one node), PACK for pipeline only. "
        "`resources` stay per replica and are split evenly over its ranks' bundles.",
    )
    rank_launch: Literal["processes", "actors"] = Field(
        "processes", description="How a multi-rank replica starts ranks 1..: as its own child processes (they see "
        "the replica's GPUs: every GPU goes in the replica's bundle) or as Ray actors, one per bundle with its own "
        "GPU share (kvmesh.serve.rank_actors; needed for pipeline stages on other nodes).",
    )

    def scaling_options(self, role: str | None = None, slo: "SLOTargets | None" = None) -> dict[str, Any]:
        if self.autoscaling is not None:
            return {"autoscaling_config": self.autoscaling.ray(role, slo)}
        return {"num_replicas": self.replicas}


class RouterWorkload(Workload):
    config: RouterConfig = Field(default_factory=RouterConfig, description="Scorers, picker, P/D decider.")
    resources: Resources = Field(default_factory=lambda: Resources(num_cpus=0.5))


class KVStoreConfig(_Base):
    """The shared KV block store the workers read and write (prefix / prompt cache)."""

    redis_url: str | None = Field(
        None, description="redis://host:port/db. None: no shared store; each worker keeps its own prefix cache "
        "(engine.kv_store: memory adds a private in-process second tier, worth it only when the KV cache is on "
        "a GPU: on CPU it copies every prompt block into the same host memory).",
    )
    ttl_s: float = Field(3600.0, gt=0, description="TTL of KV blocks written to the store.")


class SecurityConfig(_Base):
    """TLS on the public endpoints and the internal token of router <-> worker calls.

    Only file paths live here (the config is readable in ConfigMaps and Ray's dashboard):
    the secrets themselves are files (Kubernetes Secrets mounted by the operator) or
    environment variables (docs/security.md)."""

    tls_cert_file: str | None = Field(
        None, description="PEM certificate chain of the public gRPC and HTTP endpoints; set with tls_key_file to "
        "serve them over TLS.")
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_client_ca_file: str | None = Field(
        None, description="PEM CA bundle; when set, public clients must present a certificate it signed (mTLS).")
    internal_token_file: str | None = Field(
        None, description="File holding the shared internal token every worker RPC must carry "
        "(KVMESH_INTERNAL_TOKEN in the environment takes precedence).")

    @model_validator(mode="after")
    def _pair(self) -> "SecurityConfig":
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("security: give both tls_cert_file and tls_key_file (or neither)")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("security.tls_client_ca_file needs tls_cert_file and tls_key_file")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


class SLOTargets(_Base):
    """Latency targets (p90 over a recent window) the kvmesh autoscaling policy
    (router.autoscale) scales each role against: prefill / unified replicas for TTFT,
    decode / unified replicas for TPOT."""

    ttft_s: float = Field(2.0, gt=0, description="Time to first token, p90, seconds.")
    tpot_s: float = Field(0.1, gt=0, description="Time per output token, p90, seconds.")
    window_s: float = Field(
        30.0, gt=0, description="Seconds of finished requests each worker's TTFT / TPOT p90 covers (the "
        "'recent window' the targets are held over).")


class ServingConfig(_Base):
    name: str = Field("kvmesh", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                      description="Application name (Ray Serve app, worker registry keys, metrics label).")
    model_id: str = Field("kvmesh", min_length=1, description="Model name clients send (OpenAI `model`).")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    router: RouterWorkload = Field(default_factory=RouterWorkload)
    prefill: Workload | None = Field(None, description="Prefill replicas; None = unified serving.")
    decode: Workload = Field(default_factory=Workload, description="Decode (or unified) replicas.")
    kv_store: KVStoreConfig = Field(default_factory=KVStoreConfig)
    slo: SLOTargets = Field(default_factory=SLOTargets, description="Latency targets for SLO autoscaling.")
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    host: str = Field("127.0.0.1", description="Address the gRPC and HTTP endpoints listen on.")
    grpc_port: int = Field(50051, ge=0, le=65535, description="Public gRPC port (kvmesh.v1.LLM).")
    http_port: int = Field(8000, ge=0, le=65535, description="OpenAI-compatible HTTP port.")
    http_ingress: Literal["router", "ray_proxy"] = Field(
        "router", description="Who serves the OpenAI HTTP API under Ray: 'router' (each router replica listens on "
        "http_port itself, SO_REUSEPORT; Ray Serve runs no proxy) or 'ray_proxy' (Ray Serve's HTTP proxy on every "
        "node forwards to the router replicas: one more process hop and a Ray message per streamed chunk).")
    transfer_ttl_s: float = Field(30.0, gt=0, description="Seconds prefilled KV waits for its decode pull.")
    registry_ttl_s: float = Field(
        10.0, gt=0, description="A worker that misses heartbeats this long leaves the registry."
    )
    security: SecurityConfig = Field(default_factory=SecurityConfig,
                                     description="TLS of the public endpoints, internal token file.")
    chat: ChatConfig = Field(default_factory=ChatConfig,
                             description="Tool-call and reasoning parsers of the OpenAI chat API.")

    @property
    def proxy_location(self) -> str:
        """Ray Serve's `proxy_location` for this config: no proxies when the router replicas
        serve HTTP themselves (`serve.start` locally, serveConfigV2 under KubeRay)."""
        return "Disabled" if self.http_ingress == "router" else "EveryNode"

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def roles(self) -> dict[str, Workload]:
        """Worker roles to deploy: {prefill, decode} or {unified}."""
        if self.prefill is None:
            return {"unified": self.decode}
        return {"prefill": self.prefill, "decode": self.decode}

    def engine_for(self, role: str) -> EngineConfig:
        """The engine config of one role: the shared one, the store, then the role's overrides."""
        base = self.engine.model_dump()
        if self.kv_store.redis_url is not None:
            base["kv_store"] = self.kv_store.redis_url
        base["kv_store_ttl_s"] = self.kv_store.ttl_s
        cfg = EngineConfig(**base)
        try:
            return cfg.with_overrides(**self.roles()[role].engine_overrides)
        except ValueError as e:
            raise ValueError(f"{role}.engine_overrides: {e}") from e

    # -- Ray Serve ----------------------------------------------------------------------

    def runtime_dict(self) -> dict[str, Any]:
        """The config without placement (replica counts, autoscaling, resources): what the
        replicas run. It is the Serve app's `args`; placement goes to the per-deployment
        overrides, so scaling a role changes no `args` and restarts nothing."""
        data = self.model_dump(mode="json")
        data["router"] = {"config": data["router"]["config"]}
        for role in ("prefill", "decode"):
            if data[role] is not None:
                data[role] = {"engine_overrides": data[role]["engine_overrides"],
                              "rank_launch": data[role]["rank_launch"]}
        return data

    def placement(self, role: str) -> dict[str, Any]:
        """Ray Serve placement options of one deployment: `ray_actor_options`, plus, for a
        worker role whose engine has several ranks, `placement_group_bundles` (one per rank)
        and `placement_group_strategy` (kvmesh.serve.placement)."""
        if role == "router":
            return {"ray_actor_options": self.router.resources.ray_actor_options()}
        wl = self.roles()[role]
        try:
            return placement_options(wl.resources, self.engine_for(role).parallel, wl.placement_strategy,
                                     rank_actors=wl.rank_launch == "actors")
        except ValueError as e:
            raise ValueError(f"{'decode' if role == 'unified' else role}: {e}") from None

    def deployment_overrides(self) -> list[dict[str, Any]]:
        """Per-deployment placement, in Ray Serve config-file form."""
        out = []
        for name, wl in [("router", self.router), *self.roles().items()]:
            out.append({"name": name, **wl.scaling_options(name, self.slo), **self.placement(name)})
        return out

    def ray_serve_application(self, import_path: str = "kvmesh.serve.app:build") -> dict[str, Any]:
        """One entry of a Ray Serve config file's `applications` (also KubeRay's serveConfigV2)."""
        return {"name": self.name, "route_prefix": "/", "import_path": import_path,
                "args": {"config": self.runtime_dict()}, "deployments": self.deployment_overrides()}

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ServingConfig":
        import yaml

        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the serving config must be a mapping, got {type(data).__name__}")
        return cls.model_validate(data)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
