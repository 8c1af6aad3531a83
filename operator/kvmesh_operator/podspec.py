"""The pod surface of an `LLMService`: what every role (head, router, prefill, decode) may say
about its pods. Typed like the rest of the spec (`spec` builds on these models), rendered by
`render.pod_template`, merged with the user's template patch by `pods.merge_template`.

    resources            cpu, memory, gpu (per pod = per replica; a worker role's tensor x pipeline ranks
                         share its pod, one GPU each)
    nodeSelector, tolerations, affinity           placement
    shmSize              a memory-backed /dev/shm of this size (else KubeRay's, sized to the memory limit)
    serviceAccountName, priorityClassName, runtimeClassName
    env, labels, annotations
    template             a PodTemplateSpec patch applied last (see `pods`)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kvmesh_operator import pods
from kvmesh_operator.quantity import Quantity, parse_quantity

MAX_GPUS_PER_POD = 8
"""A pod is one node's share: 8 GPUs is the largest common GPU node (HGX / DGX). A replica's ranks
(tensor x pipeline) all run in its one pod, so this also bounds a GPU replica's world size; a group
spanning pods (pipeline stages on several nodes) is not rendered yet."""


class SpecModel(BaseModel):
    """Base of every spec model: camelCase fields, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


def cel(rule: str, message: str) -> dict[str, Any]:
    """A CEL rule for the CRD schema: the API server rejects what the validators reject."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


_GPU_MESSAGE = (f"at most {MAX_GPUS_PER_POD} GPUs per pod (one node's): a replica's tensor x pipeline ranks all "
                "run in its pod; add replicas to use more GPUs")


class ResourcesSpec(SpecModel):
    """Per-pod (= per-replica) resources of a role; requests and limits are set equal."""

    model_config = ConfigDict(**SpecModel.model_config,
                              json_schema_extra=cel(f"!has(self.gpu) || self.gpu <= {MAX_GPUS_PER_POD}",
                                                    f"resources.gpu: {_GPU_MESSAGE}"))

    cpu: Quantity = Field("1", description="CPU cores per pod, e.g. 2 or '500m'.")
    memory: Quantity = Field("4Gi", description="Memory per pod, e.g. '16Gi'.")
    gpu: int = Field(0, ge=0, description="NVIDIA GPUs per pod (nvidia.com/gpu); more than 0 runs the engine on "
                     "CUDA. A worker replica uses one GPU per rank: give parallelism.tensor x "
                     "parallelism.pipeline (default 1).",
                     json_schema_extra={"maximum": MAX_GPUS_PER_POD})

    @field_validator("gpu")
    @classmethod
    def _one_gpu(cls, v: int) -> int:
        if v > MAX_GPUS_PER_POD:
            raise ValueError(f"{v} GPUs: {_GPU_MESSAGE}")
        return v


class Toleration(SpecModel):
    """A Kubernetes pod toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(SpecModel):
    """An environment variable of the role's Ray container (a Kubernetes EnvVar)."""

    name: str = Field(min_length=1)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(None, description="secretKeyRef, configMapKeyRef, fieldRef or "
                                              "resourceFieldRef, as in a Pod.")

    @model_validator(mode="after")
    def _one_of(self) -> "EnvVar":
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name!r}: give value or valueFrom, not both")
        return self


class LocalObjectReference(SpecModel):
    name: str = Field(min_length=1, description="Secret name (same namespace).")


_FREE = {"x-kubernetes-preserve-unknown-fields": True}


class PodOptions(SpecModel):
    """What a role's pods look like beyond the Ray container kvmesh renders."""

    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Pod tolerations (e.g. GPU taints).")
    affinity: dict[str, Any] | None = Field(None, description="Pod affinity (nodeAffinity, podAffinity, "
                                            "podAntiAffinity), as in a Pod.", json_schema_extra=_FREE)
    shm_size: Quantity | None = Field(None, description="Size of the pods' /dev/shm (memory-backed; Ray's object "
                                      "store lives there), at most resources.memory. Unset: KubeRay's, "
                                      "sized to the memory limit.")
    service_account_name: str | None = Field(None, min_length=1, description="ServiceAccount of the pods; "
                                             "unset: KubeRay's default.")
    priority_class_name: str | None = Field(None, min_length=1, description="PriorityClass of the pods.")
    runtime_class_name: str | None = Field(None, min_length=1, description="RuntimeClass of the pods (e.g. "
                                           "nvidia, gvisor).")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment of the Ray container.",
                              json_schema_extra={"x-kubernetes-list-type": "map",
                                                 "x-kubernetes-list-map-keys": ["name"]})
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels (not under kvmesh.dev/ or "
                                   "ray.io/, nor app.kubernetes.io/name, instance, component or managed-by).")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")
    template: dict[str, Any] | None = Field(
        None, description="A PodTemplateSpec patch merged into the rendered pod template last, like a "
        "strategic merge patch: mappings merge, null removes a key, containers / volumes / env / ... merge item "
        "by item by name (ports by containerPort, volumeMounts by mountPath), other lists are replaced. The Ray "
        "container is ray-head on the head and ray-worker on the workers.", json_schema_extra=_FREE)

    @field_validator("env")
    @classmethod
    def _env(cls, v: list[EnvVar]) -> list[EnvVar]:
        names = [e.name for e in v]
        owned = sorted(set(names) & pods.OPERATOR_ENV)
        if owned:
            raise ValueError(f"{', '.join(owned)}: set by the operator from spec.auth and the Secrets it generates")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"env names must be unique; repeated: {', '.join(dup)}")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        problems = pods.label_problems(v)
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @field_validator("template")
    @classmethod
    def _template(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        problems = pods.template_problems(v) if v is not None else []
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _shm(self) -> "PodOptions":
        if self.shm_size is not None and parse_quantity(self.shm_size) > parse_quantity(self.resources.memory):
            raise ValueError(f"shmSize {self.shm_size} is more than resources.memory {self.resources.memory}: "
                             "a memory-backed /dev/shm counts against the pod's memory limit")
        return self
