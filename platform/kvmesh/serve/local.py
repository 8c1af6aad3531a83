"""`kvmesh serve --local`: the router plus the config's worker replicas (by default one
prefill and one decode worker) on this machine, no Ray, each a separate OS process (the faithful shape of a cluster: the
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

from kvmesh.serve.config import ServingConfig

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


def worker_args(cfg: ServingConfig, role: str) -> list[str]:
    """`kvmesh worker` arguments for one replica of `role`: the role's whole engine config
    travels as JSON, so no option can be lost on the way."""
    args = ["-m", "kvmesh.cli", "worker", "--role", role, "--host", "127.0.0.1", "--port", "0",
            "--model-id", cfg.model_id, "--transfer-ttl", str(cfg.transfer_ttl_s),
            "--config-json", cfg.engine_for(role).model_dump_json()]
    if cfg.tracing.otlp_endpoint:
        args += ["--otlp-endpoint", cfg.tracing.otlp_endpoint]
    return args


def router_args(cfg: ServingConfig, worker_addresses: list[str], http: bool) -> list[str]:
    args = ["-m", "kvmesh.cli", "router", "--host", cfg.host, "--port", str(cfg.grpc_port),
            "--model-id", cfg.model_id, "--config-json", cfg.router.config.model_dump_json()]
    if cfg.engine.model.model:
        args += ["--model", cfg.engine.model.model]
    if http:
        args += ["--http-port", str(cfg.http_port)]
    if cfg.tracing.otlp_endpoint:
        args += ["--otlp-endpoint", cfg.tracing.otlp_endpoint]
    for address in worker_addresses:
        args += ["--worker", address]
    return args


def serve_local(cfg: ServingConfig, http: bool = False, start_timeout_s: float = 600.0) -> int:
    """Run `cfg` as OS processes until SIGINT / SIGTERM: each role's replicas (prefill +
    decode, or unified), then the router over their addresses. `http` also serves the
    OpenAI API on cfg.http_port."""
    stop_requested = threading.Event()

    def on_signal(signum, frame):
        stop_requested.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    try:
        # Every worker loads its model at the same time.
        for role, workload in cfg.roles().items():
            for i in range(workload.replicas):
                name = role if workload.replicas == 1 else f"{role}-{i}"
                children.append(spawn(name, worker_args(cfg, role)))
        if not children:
            raise ValueError("serve --local: no worker replicas to start; set --decode-replicas >= 1")
        for c in children:
            wait_ready(c, start_timeout_s)
        router = wait_ready(spawn("router", router_args(cfg, [c.address for c in children], http)), start_timeout_s)
        children.append(router)
        print(f"kvmesh local: router (kvmesh.v1.LLM) at {router.address}", flush=True)
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
