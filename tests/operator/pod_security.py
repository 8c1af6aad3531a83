"""A checker of the `restricted` Pod Security Standard, and the pod KubeRay builds from a template.

`restricted_violations(pod_spec)` returns one message per rule a PodSpec breaks, the rules
of https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline, then
restricted), as the Pod Security admission controller enforces them at `restricted: latest`.

`kuberay_pod(template, ...)` adds what KubeRay's BuildPod / DefaultWorkerPodTemplate add to a
Ray pod template (ray-operator/controllers/ray/common/pod.go): the /dev/shm emptyDir unless
the Ray container mounts /dev/shm, the `wait-gcs-ready` init container on workers (a copy of
the Ray container's securityContext), and on the head of an autoscaling cluster the
`autoscaler` sidecar (securityContext from autoscalerOptions) with a shared log emptyDir.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in pod.get(kind) or []:
            yield f"{kind}[{c.get('name')}]", c


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Every rule of the restricted profile `pod` (a PodSpec) breaks; empty: it is admitted."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    # baseline
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"{key} is true")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("securityContext.windowsOptions.hostProcess is true")
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if "hostPath" in kinds:
            out.append(f"volume {v.get('name')}: hostPath")
        elif not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v.get('name')}: type {sorted(kinds)} is not allowed")
    for s in psc.get("sysctls") or []:
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {s.get('name')} is not a safe sysctl")
    out += _selinux_apparmor("securityContext", psc)
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"securityContext.seccompProfile.type is {pod_seccomp}")
    if psc.get("runAsUser") == 0:
        out.append("securityContext.runAsUser is 0")
    for where, c in _containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}: windowsOptions.hostProcess is true")
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                out.append(f"{where}: hostPort {p['hostPort']}")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{where}: procMount {sc['procMount']}")
        out += _selinux_apparmor(f"{where}.securityContext", sc)
        caps = sc.get("capabilities") or {}
        added = set(caps.get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"{where}: adds capabilities {sorted(added - BASELINE_CAPABILITIES)} (baseline)")
        # restricted
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities.drop does not include ALL")
        if added - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds capabilities {sorted(added - {'NET_BIND_SERVICE'})}")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{where}: runAsNonRoot is not true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile.type is {seccomp} (pod or container; RuntimeDefault or Localhost)")
    return out


def _selinux_apparmor(where: str, sc: dict[str, Any]) -> list[str]:
    out = []
    se = sc.get("seLinuxOptions") or {}
    if se.get("type", "") not in SELINUX_TYPES:
        out.append(f"{where}.seLinuxOptions.type {se['type']}")
    for key in ("user", "role"):
        if se.get(key):
            out.append(f"{where}.seLinuxOptions.{key} is set")
    if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"{where}.appArmorProfile.type {sc['appArmorProfile']['type']}")
    return out


def kuberay_pod(template: dict[str, Any], *, head: bool, cluster: dict[str, Any]) -> dict[str, Any]:
    """The PodSpec KubeRay creates from a Ray group's pod template (see the module docstring)."""
    pod = copy.deepcopy(template["spec"])
    ray = pod["containers"][0]
    if not head:
        pod.setdefault("initContainers", []).append({
            "name": "wait-gcs-ready", "image": ray["image"], "securityContext": copy.deepcopy(ray.get("securityContext")),
            "env": copy.deepcopy(ray.get("env")), "volumeMounts": copy.deepcopy(ray.get("volumeMounts")),
            "resources": {"limits": {"cpu": "200m", "memory": "256Mi"}, "requests": {"cpu": "200m", "memory": "256Mi"}}})
    if not any(m.get("mountPath") == "/dev/shm" for m in ray.get("volumeMounts") or []):
        limit = ray.get("resources", {}).get("limits", {}).get("memory")
        pod.setdefault("volumes", []).append({"name": "shared-mem", "emptyDir": {"medium": "Memory",
                                                                                  "sizeLimit": limit}})
        ray.setdefault("volumeMounts", []).append({"name": "shared-mem", "mountPath": "/dev/shm"})
    if head and cluster.get("enableInTreeAutoscaling"):
        options = cluster.get("autoscalerOptions") or {}
        pod["containers"].append({"name": "autoscaler", "image": ray["image"],
                                  "securityContext": copy.deepcopy(options.get("securityContext")),
                                  "volumeMounts": [{"name": "ray-logs", "mountPath": "/tmp/ray"}]})
        pod["volumes"].append({"name": "ray-logs", "emptyDir": {}})
    return pod
