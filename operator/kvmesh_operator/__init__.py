"""kvmesh's Kubernetes operator: reconciles `LLMService` (kvmesh.dev/v1alpha1) custom resources
into a KubeRay `RayService`, Services, a ConfigMap and (optionally) a managed Redis.

Modules: `spec` (typed spec, validation) with `podspec` (each role's pod options),
`quantity` (Kubernetes quantities), `mapping` (spec -> kvmesh ServingConfig), `render`
(pure spec -> manifests) with `pods` (restricted security contexts, template patch merge)
and `security` (Secrets, NetworkPolicies), `status` (conditions from the RayService
status), `drift` (what of an owned object to repair), `k8s` (the only Kubernetes API I/O),
`handlers` (thin kopf handlers), `crd` (the CRD, generated from `spec`).
"""

GROUP = "kvmesh.dev"
VERSION = "v1alpha1"
PLURAL = "llmservices"
KIND = "LLMService"

__all__ = ["GROUP", "VERSION", "PLURAL", "KIND"]
