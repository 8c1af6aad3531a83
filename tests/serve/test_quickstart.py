"""The README quickstart, as a new user runs it: `kvmesh serve` with no arguments
(embedded model, local Ray, default ports), then the README's curl command and Python
gRPC snippet, copied from the README itself, then Ctrl-C."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from serve_procs import start_serve, stop_serve

from kvmesh.serve.app import LOCAL_RAY_ENV

README = Path(__file__).resolve().parents[2] / "README.md"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def snippet(name: str) -> str:
    m = re.search(rf"<!-- quickstart:{name} -->\s*```\w*\n(.*?)```", README.read_text(), re.S)
    assert m, f"README.md lost its quickstart:{name} block"
    return m.group(1)


def test_readme_quickstart(tmp_path):
    serve_cmd = snippet("serve").strip()
    assert serve_cmd.endswith("kvmesh serve"), serve_cmd  # install (done by CI) && kvmesh serve
    s = start_serve([], tmp_path / "serve.log")
    try:
        assert s.grpc == "127.0.0.1:50051" and s.http == "http://127.0.0.1:8000"
        assert_daemon_timers_slowed()
        out = subprocess.run(["bash", "-c", snippet("curl")], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        assert body["choices"][0]["text"].startswith(" Paris"), body
        out = subprocess.run([sys.executable, "-c", snippet("python")], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(" Paris"), out.stdout
    finally:
        rc = stop_serve(s)
    assert rc == 0, s.log.read_text()[-3000:]


def assert_daemon_timers_slowed() -> None:
    """The Ray instance `kvmesh serve` started runs its daemons with LOCAL_RAY_ENV (the log
    monitor's file scan, the Serve controller's loop)."""
    seen = set()
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        for daemon in ("log_monitor.py", "ray::ServeController"):
            if daemon in cmd:
                try:
                    env = proc.environ()
                except (psutil.AccessDenied, psutil.NoSuchProcess):
                    continue
                assert {k: env.get(k) for k in LOCAL_RAY_ENV} == LOCAL_RAY_ENV, (daemon, cmd)
                seen.add(daemon)
    assert {"log_monitor.py", "ray::ServeController"} <= seen, f"Ray daemons not found (saw {sorted(seen)})"
