"""Drift: whether a live object still holds what the operator rendered for it.

The operator owns the fields it renders (server-side apply as `kvmesh-operator`) and checks
exactly those. `drifted(desired, live)` names the first rendered field that is missing or
different in the live object (or says the object is gone); fields others added are not
drift, since server-side apply leaves them in place too: extra keys of a mapping, extra
items of a list merged by key (containers, env, ports: `pods.MERGE_KEYS`), extra labels.
Label selectors are compared whole (Kubernetes replaces them whole), so an extra selector
key is drift. Pure: `handlers.repair_drift` does the I/O.

    where = drifted(rendered, await api.get(...))   # None: nothing to repair
"""

from __future__ import annotations

from typing import Any

from kvmesh_operator.pods import MERGE_KEYS

MISSING = "(object missing)"
WHOLE = frozenset({"selector", "podSelector", "namespaceSelector"})
"""Fields compared whole: a label selector means exactly its keys."""
_SKIP = frozenset({"apiVersion", "kind", "metadata", "status"})


def drifted(desired: dict[str, Any], live: dict[str, Any] | None) -> str | None:
    """The first path where `live` departs from `desired` (MISSING when it is gone), else None."""
    if live is None:
        return MISSING
    want_meta, have_meta = desired.get("metadata") or {}, live.get("metadata") or {}
    for key in ("labels", "annotations"):
        where = _diff(want_meta.get(key) or {}, have_meta.get(key) or {}, f"metadata.{key}")
        if where:
            return where
    owners = {r.get("uid") for r in have_meta.get("ownerReferences") or []}
    if any(r.get("uid") not in owners for r in want_meta.get("ownerReferences") or []):
        return "metadata.ownerReferences"
    for key, want in desired.items():
        if key not in _SKIP:
            where = _diff(want, live.get(key), key)
            if where:
                return where
    return None


def _diff(want: Any, have: Any, path: str) -> str | None:
    field = path.rsplit(".", 1)[-1]
    if field in WHOLE:
        return None if want == have else path
    if isinstance(want, dict):
        if have is None:
            return path if want else None
        if not isinstance(have, dict):
            return path
        for k, v in want.items():
            where = _diff(v, have.get(k), f"{path}.{k}")
            if where:
                return where
        return None
    if isinstance(want, list):
        return _diff_list(want, have, path, field)
    return None if want == have else path


def _diff_list(want: list[Any], have: Any, path: str, field: str) -> str | None:
    if have is None:
        return path if want else None
    if not isinstance(have, list):
        return path
    key = MERGE_KEYS.get(field)
    if key is not None and all(isinstance(item, dict) and key in item for item in want):
        by_key = {item.get(key): item for item in have if isinstance(item, dict)}
        for item in want:
            where = _diff(item, by_key.get(item[key]), f"{path}[{item[key]}]")
            if where:
                return where
        return None
    if len(want) != len(have):
        return path
    for i, (w, h) in enumerate(zip(want, have)):
        where = _diff(w, h, f"{path}[{i}]")
        if where:
            return where
    return None
