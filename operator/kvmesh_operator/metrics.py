"""Prometheus metrics of the operator (served by `kvmesh-operator --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

RECONCILES = Counter("kvmesh_operator_reconciles", "LLMService reconciles by result.", ["result"])
READY = Gauge("kvmesh_operator_llmservice_ready", "1 while an LLMService is Ready.", ["namespace", "name"])
DRIFT_REPAIRS = Counter("kvmesh_operator_drift_repairs", "Owned objects re-applied because they were deleted or "
                        "edited, by kind.", ["kind"])
