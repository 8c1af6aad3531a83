"""Start `kvmesh serve` (Ray Serve on a local Ray instance) as a real OS process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
_READY = re.compile(r"KVMESH_SERVE_READY grpc=(\S+) http=(\S+)")


@dataclass
class Serve:
    popen: subprocess.Popen
    log: Path
    grpc: str = ""
    http: str = ""

    def alive(self) -> bool:
        return self.popen.poll() is None


def kvmesh_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", *args]


def start_serve(args: list[str], log: Path, timeout: float = 600.0) -> Serve:
    """Run `kvmesh serve ARGS` and wait for its READY line (the app is deployed)."""
    env = {**os.environ, **_ENV}
    with open(log, "w") as fh:
        popen = subprocess.Popen(kvmesh_cmd("serve", *args), stdout=fh, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
    s = Serve(popen, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _READY.search(log.read_text())
        if m:
            s.grpc, s.http = m.group(1), m.group(2)
            return s
        if not s.alive():
            break
        time.sleep(0.5)
    stop_serve(s)
    raise RuntimeError(f"kvmesh serve did not become ready in {timeout}s; log:\n{log.read_text()[-6000:]}")


def run_kvmesh(args: list[str], timeout: float = 600.0) -> subprocess.CompletedProcess:
    return subprocess.run(kvmesh_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **_ENV})


def stop_serve(s: Serve, timeout: float = 120.0) -> int | None:
    """Ctrl-C, as a user would; the process shuts the app and Ray down. Kill on timeout."""
    if s.alive():
        s.popen.send_signal(signal.SIGINT)
        try:
            return s.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(s.popen.pid, signal.SIGKILL)
            s.popen.wait()
            subprocess.run(["ray", "stop", "--force"], capture_output=True)
    return s.popen.returncode


def free_port() -> int:
    from kvmesh.rpc import free_port as fp

    return fp()


class ClosedLoop:
    """`clients` threads each calling `request(i)` back to back until stopped, so requests
    are always in flight (a standing queue when clients outnumber the running slots).
    `request` returns an error message or None; exceptions are recorded the same way."""

    def __init__(self, request: Callable[[int], str | None], clients: int, join_s: float = 300.0):
        self.request, self.join_s = request, join_s
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                error = self.request(i)
                if error:
                    self.errors.append(error)
                self.done += 1
            except Exception as exc:  # recorded, asserted by the test
                self.errors.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.join_s)
