"""benchmarks/gpu_check.py imports everything it uses and, without a CUDA device, says so
and exits 0; on a GPU machine the same command runs the whole check (not here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_without_cuda_says_so(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path),
           "PYTHONPATH": f"{ROOT / 'platform'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA device here; nothing was measured" in r.stdout
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written
