"""Fixtures of the hardening tests: a fake router backend for the HTTP app (what the
fuzzers hit without a model), and the integration tests' process helpers
(tests/integration/kvmesh_procs.py) for the multi-process regressions."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
