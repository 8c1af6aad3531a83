"""The checked-in gRPC stubs match protos/ (regenerate with scripts/gen_protos.sh)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_stubs_are_up_to_date(tmp_path):
    subprocess.run([str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, capture_output=True,
                   env={**os.environ, "PYTHON": sys.executable})
    checked_in = ROOT / "platform" / "kvmesh" / "_proto"
    generated = sorted(p.name for p in tmp_path.iterdir() if p.name != "__init__.py")
    assert generated == sorted(p.name for p in checked_in.iterdir() if p.suffix in (".py", ".pyi")
                               and p.name != "__init__.py")
    for name in generated:
        assert (tmp_path / name).read_text() == (checked_in / name).read_text(), (
            f"platform/kvmesh/_proto/{name} is stale: run scripts/gen_protos.sh")
