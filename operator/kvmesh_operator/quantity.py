"""Kubernetes resource quantities ('500m', '8Gi', 2): parsing, a pydantic field type, Ray CPUs.

A quantity is a decimal number with an optional SI (k, M, G, ...) or binary (Ki, Mi, Gi,
...) suffix, or 'm' for thousandths. Integers are accepted as they are (YAML `cpu: 2`).
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import AfterValidator, WithJsonSchema

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
"""A spec field holding a quantity: kept as written (the CRD round-trips it), checked on parse."""


def ray_cpus(q: int | str) -> int:
    """Whole CPUs a Ray node advertises for a pod's CPU quantity (`ray start --num-cpus` is an int)."""
    return max(1, math.ceil(parse_quantity(q)))
