"""Skip marks of the GPU group (importable from its test modules)."""

from __future__ import annotations

import pytest

from kvmesh.layers.triton_runtime import AVAILABLE

requires_triton = pytest.mark.skipif(
    not AVAILABLE, reason="triton is not installed (pip install -e '.[test]' installs it where it needs no new torch)")
