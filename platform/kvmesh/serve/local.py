"""`kvmesh serve --local`: the router plus one prefill and one decode worker on this
machine, no Ray, each a separate OS process (the faithful shape of a cluster: the
KV really crosses a process boundary by PullKV, and a crashing worker cannot take the
router down). Workers listen on free loopback ports; the router on --port.

Ctrl-C / SIGTERM stops the router first, then the workers (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

_READY = re.compile(r"KVMESH_(WORKER|ROUTER)_READY .*address=(\S+)")


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    address: str = ""


def spawn(name: str, args: list[str]) -> Child:
    popen = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, bufsize=1)
    return Child(name, popen)


def wait_ready(child: Child, timeout_s: float) -> Child:
    """Wait for the child's READY line, then keep relaying its stdout."""
    deadline = time.monotonic() + timeout_s
    for line in child.popen.stdout:
        m = _READY.search(line)
        if m:
            child.address = m.group(2)
            break
        sys.stdout.write(f"[{child.name}] {line}")
        if time.monotonic() > deadline:
            break
    if not child.address:
        stop(child)
        raise RuntimeError(f"{child.name} did not start (exit code {child.popen.poll()}); see its log above")
    threading.Thread(target=_relay, args=(child,), daemon=True).start()
    return child


def _relay(child: Child) -> None:
    for line in child.popen.stdout:
        sys.stdout.write(f"[{child.name}] {line}")


def stop(child: Child, timeout_s: float = 10.0) -> None:
    if child.popen.poll() is None:
        child.popen.terminate()
        try:
            child.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.popen.kill()
            child.popen.wait()


def serve_local(engine_args: list[str], host: str, port: int, router_args: list[str],
                transfer_ttl_s: float, model: str | None, start_timeout_s: float = 600.0) -> int:
    """Run until SIGINT / SIGTERM. `engine_args` are worker CLI flags (--model, --dtype...)."""
    stop_requested = threading.Event()

    def on_signal(signum, frame):
        stop_requested.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    try:
        # Both workers load their model at the same time.
        for role in ("prefill", "decode"):
            children.append(spawn(role, ["-m", "kvmesh.worker.server", "--role", role, "--host", "127.0.0.1",
                                          "--port", "0", "--transfer-ttl", str(transfer_ttl_s), *engine_args]))
        for c in children:
            wait_ready(c, start_timeout_s)
        rargs = ["-m", "kvmesh.router", "--host", host, "--port", str(port), *router_args]
        if model:
            rargs += ["--model", model]
        for c in children:
            rargs += ["--worker", c.address]
        children.append(wait_ready(spawn("router", rargs), start_timeout_s))
        print(f"kvmesh local: router (kvmesh.v1.LLM) at {children[-1].address}", flush=True)
        for c in children[:-1]:
            print(f"kvmesh local: {c.name} worker (kvmesh.v1.Worker) at {c.address}", flush=True)
        print("kvmesh local: Ctrl-C to stop", flush=True)
        while not stop_requested.wait(0.5):
            dead = [c.name for c in children if c.popen.poll() is not None]
            if dead:
                print(f"kvmesh local: {', '.join(dead)} exited; stopping", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        for c in reversed(children):  # router first: no new work reaches the workers
            stop(c)
        for s, h in previous.items():
            signal.signal(s, h)
