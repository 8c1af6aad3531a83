"""What every pod the operator renders shares: the restricted Pod Security profile, the
environment the operator owns, and the merge of a user's pod template patch.

Pure data and functions on plain dicts; no kvmesh_operator imports, so both the spec
(validation) and the renderers use it.

Restricted profile (Kubernetes Pod Security Standards, `restricted`): the pod runs as a
non-root user (RUN_AS_USER, the runtime image's `ray` user) with the RuntimeDefault
seccomp profile; every container drops all capabilities and cannot escalate privileges.
KubeRay copies the Ray container's securityContext into the `wait-gcs-ready` init
container it injects, and the autoscaler sidecar gets `autoscalerOptions.securityContext`,
so the pods KubeRay creates meet the profile too.

Template patch (`spec.<role>.template`): a PodTemplateSpec fragment merged into the
rendered template last, the way `kubectl patch --type strategic` merges: mappings merge
key by key, a null value removes the key, lists of containers / volumes / env / ... merge
item by item on Kubernetes' merge key (MERGE_KEYS), every other list is replaced.

    template = merge_template(rendered, spec.decode.template)
"""

from __future__ import annotations

import copy
from typing import Any

RUN_AS_USER = 1000
"""uid (and gid) of the `ray` user of the kvmesh runtime image (deploy/Dockerfile)."""

SHM_VOLUME = "shared-mem"
"""KubeRay's name for the /dev/shm volume: a pod that mounts /dev/shm itself gets none from KubeRay."""
SHM_PATH = "/dev/shm"

INTERNAL_TOKEN_ENV = "KVMESH_INTERNAL_TOKEN"
KV_HMAC_ENV = "KVMESH_KV_HMAC_KEY"
REDIS_PASSWORD_ENV = "KVMESH_REDIS_PASSWORD"
API_KEY_ENV = "KVMESH_API_KEY"
OPERATOR_ENV = frozenset({INTERNAL_TOKEN_ENV, KV_HMAC_ENV, REDIS_PASSWORD_ENV, API_KEY_ENV})
"""Environment the operator sets from Secrets (spec.auth, generated ones); spec env may not."""

RESERVED_LABEL_PREFIXES = ("kvmesh.dev/", "ray.io/")
RESERVED_LABELS = frozenset(f"app.kubernetes.io/{k}" for k in ("name", "instance", "component", "managed-by"))
"""Pod labels the operator and KubeRay set and the Services / NetworkPolicies select on."""

MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
              "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
              "env": "name", "ports": "containerPort", "imagePullSecrets": "name",
              "resourceClaims": "name", "hostAliases": "ip"}
"""List fields merged item by item, on the key Kubernetes' strategic merge patch uses."""


def pod_security_context(run_as_user: int = RUN_AS_USER) -> dict[str, Any]:
    """The pod-level part of the restricted profile."""
    return {"runAsNonRoot": True, "runAsUser": run_as_user, "runAsGroup": run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(run_as_user: int = RUN_AS_USER) -> dict[str, Any]:
    """The container-level part: also complete on its own (KubeRay's autoscaler sidecar gets only this)."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
            "runAsUser": run_as_user, "seccompProfile": {"type": "RuntimeDefault"}}


def shm_volume(size: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) of a memory-backed /dev/shm capped at `size` (Ray's object store lives there)."""
    return ({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": size}},
            {"name": SHM_VOLUME, "mountPath": SHM_PATH})


def merge_template(base: Any, patch: Any, key: str = "") -> Any:
    """`patch` merged into a copy of `base` (see the module docstring); neither is modified."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = merge_template(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if key in MERGE_KEYS and isinstance(base, list) and isinstance(patch, list):
        merge_key = MERGE_KEYS[key]
        out_list = copy.deepcopy(base)
        index = {item.get(merge_key): i for i, item in enumerate(out_list) if isinstance(item, dict)}
        for item in patch:
            i = index.get(item.get(merge_key))
            if i is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[i] = merge_template(out_list[i], item)
        return out_list
    return copy.deepcopy(patch)


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def template_problems(patch: Any, where: str = "") -> list[str]:
    """What makes `patch` unusable as a pod template patch, one message per problem (empty: fine);
    each message starts with the path below `where`."""
    if not isinstance(patch, dict):
        return [f"{where or 'template'}: give a PodTemplateSpec fragment (a mapping with metadata and / or spec)"]
    problems = [f"{_at(where, k)}: a pod template has only metadata and spec" for k in patch if k not in
                ("metadata", "spec")]
    meta = patch.get("metadata") or {}
    if not isinstance(meta, dict):
        problems.append(f"{_at(where, 'metadata')}: give a mapping (labels, annotations)")
    else:
        problems += [f"{_at(where, 'metadata.' + k)}: a pod template's metadata takes only labels and annotations"
                     for k in meta if k not in ("labels", "annotations")]
        problems += label_problems(meta.get("labels") or {}, _at(where, "metadata.labels"))
    if "spec" in patch and not isinstance(patch["spec"], dict):
        problems.append(f"{_at(where, 'spec')}: give a mapping (a PodSpec fragment)")
    elif isinstance(patch.get("spec"), dict):
        problems += _list_key_problems(patch["spec"], _at(where, "spec"))
    return problems


def label_problems(labels: Any, where: str = "") -> list[str]:
    """Label keys a spec may not set (RESERVED_LABEL_PREFIXES, RESERVED_LABELS), one message each."""
    if not isinstance(labels, dict):
        return [f"{where or 'labels'}: give a mapping of label keys to values"]
    return [f"{_at(where, k)}: set by the operator or KubeRay (keys under {' and '.join(RESERVED_LABEL_PREFIXES)}, "
            f"{', '.join(sorted(RESERVED_LABELS))}; Services and NetworkPolicies select on them)"
            for k in labels if isinstance(k, str) and (k.startswith(RESERVED_LABEL_PREFIXES) or k in RESERVED_LABELS)]


def _list_key_problems(node: Any, where: str) -> list[str]:
    """Items of merged lists must carry their merge key (else the patch cannot say which item it changes)."""
    problems: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in MERGE_KEYS and isinstance(v, list):
                for i, item in enumerate(v):
                    if not isinstance(item, dict) or item.get(MERGE_KEYS[k]) in (None, ""):
                        problems.append(f"{_at(where, k)}[{i}]: give its {MERGE_KEYS[k]} ({k} merge item by item on "
                                        f"{MERGE_KEYS[k]}; kvmesh's containers are ray-head and ray-worker)")
                    else:
                        problems += _list_key_problems(item, f"{_at(where, k)}[{i}]")
            else:
                problems += _list_key_problems(v, _at(where, k))
    return problems
