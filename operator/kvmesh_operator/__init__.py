"""kvmesh's Kubernetes operator: reconciles `LLMService` (kvmesh.dev/v1alpha1) custom resources
into a KubeRay `RayService`, Services, a ConfigMap and (optionally) a managed Redis.

Modules: `spec` (typed spec, validation), `quantity` (Kubernetes quantities), `mapping`
(spec -> kvmesh ServingConfig), `render` (pure spec -> manifests), `status` (conditions
from the RayService status), `k8s` (the only Kubernetes API I/O), `handlers` (thin kopf
handlers), `crd` (the CRD, generated from `spec`).
"""

GROUP = "kvmesh.dev"
VERSION = "v1alpha1"
PLURAL = "llmservices"
KIND = "LLMService"

__all__ = ["GROUP", "VERSION", "PLURAL", "KIND"]
