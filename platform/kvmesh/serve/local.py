"""`kvmesh serve --local`: the router plus the config's worker replicas (by default one
prefill and one decode worker) on this machine, no Ray, each a separate OS process (the
faithful shape of a cluster: the KV really crosses a process boundary by PullKV, and a
crashing worker cannot take the router down). Workers listen on free loopback ports; the
router on --port.

The launcher is a supervisor: a child that exits, or a worker whose gRPC health check
fails `unhealthy_after` times in a row (a dead or wedged engine reports NOT_SERVING; a
blocked event loop does not answer), is stopped and started again, with a backoff when
it keeps failing. The router keeps serving from the other workers meanwhile (it retries
and resumes streams elsewhere).

A restarted child gets **the same address** it had: the first start picks a free port,
later starts pin it. The router knows its workers by static address, so it needs no new
configuration: its Stats poll finds the worker again within `stats_interval_s` of its
return (the address is a stable identity, as a Kubernetes Service name is). The cost: a
port taken by another process meanwhile keeps the worker from coming back (it is retried
with backoff, and said so). Prompts pinned at run time (CachePrompt) are not re-pinned
on a restarted worker; the config's `prompt_cache` is.

Ctrl-C / SIGTERM stops the router first, then the workers (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.rpc.internal_auth import InternalAuth
from kvmesh.serve.config import ServingConfig

_READY = re.compile(r"KVMESH_(WORKER|ROUTER)_READY .*address=(\S+)")
# Restarts within this window count towards the backoff (1 s, 2 s, 4 s, ... 30 s).
_BACKOFF_WINDOW_S = 120.0
_MAX_BACKOFF_S = 30.0


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    args: list[str] = field(default_factory=list)  # `python` arguments; the port is pinned after start
    address: str = ""
    is_worker: bool = True
    health_failures: int = 0
    restarting: bool = False
    restarts: list[float] = field(default_factory=list)  # monotonic times, for the backoff


def spawn(name: str, args: list[str], is_worker: bool = True) -> Child:
    popen = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, bufsize=1)
    return Child(name, popen, list(args), is_worker=is_worker)


def wait_ready(child: Child, timeout_s: float) -> Child:
    """Wait for the child's READY line, then keep relaying its stdout."""
    deadline = time.monotonic() + timeout_s
    address = ""
    for line in child.popen.stdout:
        m = _READY.search(line)
        if m:
            address = m.group(2)
            break
        sys.stdout.write(f"[{child.name}] {line}")
        if time.monotonic() > deadline:
            break
    if not address:
        stop(child)
        raise RuntimeError(f"{child.name} did not start (exit code {child.popen.poll()}); see its log above")
    child.address = address
    threading.Thread(target=_relay, args=(child, child.popen), daemon=True).start()
    return child


def _relay(child: Child, popen: subprocess.Popen) -> None:
    for line in popen.stdout:
        sys.stdout.write(f"[{child.name}] {line}")


def stop(child: Child, timeout_s: float = 10.0) -> None:
    if child.popen.poll() is None:
        child.popen.terminate()
        try:
            child.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.popen.kill()
            child.popen.wait()


def pin_port(args: list[str], address: str) -> list[str]:
    """`args` with `--port` set to the port of `address` (a restart keeps the address)."""
    out = list(args)
    out[out.index("--port") + 1] = address.rsplit(":", 1)[1]
    return out


def health_ok(address: str, timeout_s: float, auth: InternalAuth) -> bool:
    """The standard gRPC health check of the whole server (open even with the internal
    token; over the internal mutual TLS when that is on)."""
    async def check() -> int:
        async with auth.channel(address) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return resp.status

    try:
        return asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING
    except grpc.aio.AioRpcError:
        return False


class Supervisor:
    """Restarts exited children and health-failing workers; see the module docstring."""

    def __init__(self, children: list[Child], start_timeout_s: float, health_period_s: float = 2.0,
                 health_timeout_s: float = 3.0, unhealthy_after: int = 3):
        self.children = children
        self.start_timeout_s = start_timeout_s
        self.health_period_s = health_period_s
        self.health_timeout_s = health_timeout_s
        self.unhealthy_after = unhealthy_after
        self._lock = threading.Lock()
        self._stopping = False
        self._next_health = time.monotonic() + health_period_s
        self._auth = InternalAuth.load()  # the environment the workers were started with

    def tick(self) -> None:
        """One supervision pass (called every ~0.5 s)."""
        now = time.monotonic()
        check_health = now >= self._next_health
        if check_health:
            self._next_health = now + self.health_period_s
        for c in self.children:
            if c.restarting:
                continue
            code = c.popen.poll()
            if code is not None:
                self.restart(c, f"exited with code {code}")
            elif check_health and c.is_worker:
                if health_ok(c.address, self.health_timeout_s, self._auth):
                    c.health_failures = 0
                    continue
                c.health_failures += 1
                if c.health_failures >= self.unhealthy_after:
                    self.restart(c, f"failed {c.health_failures} health checks in a row")

    def restart(self, child: Child, reason: str) -> None:
        child.restarting = True
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < _BACKOFF_WINDOW_S] + [now]
        delay = min(_MAX_BACKOFF_S, 2.0 ** (len(child.restarts) - 1))
        print(f"kvmesh local: {child.name} at {child.address} {reason}; restarting it on the same address "
              f"in {delay:.0f}s", file=sys.stderr, flush=True)
        threading.Thread(target=self._restart, args=(child, delay), daemon=True,
                         name=f"restart-{child.name}").start()

    def _restart(self, child: Child, delay: float) -> None:
        try:
            stop(child, timeout_s=5.0)
            time.sleep(delay)
            with self._lock:
                if self._stopping:
                    return
                child.popen = subprocess.Popen([sys.executable, *pin_port(child.args, child.address)],
                                               stdout=subprocess.PIPE, text=True, bufsize=1)
            wait_ready(child, self.start_timeout_s)
            print(f"kvmesh local: {child.name} is back at {child.address}", flush=True)
        except (RuntimeError, OSError) as exc:  # the next tick sees it down and tries again
            print(f"kvmesh local: restarting {child.name} failed: {exc}", file=sys.stderr, flush=True)
        finally:
            child.health_failures = 0
            child.restarting = False

    def stop_all(self) -> None:
        with self._lock:
            self._stopping = True
        for c in reversed(self.children):  # router first: no new work reaches the workers
            stop(c)


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
    if cfg.engine.lora is not None and cfg.engine.lora.modules:
        # The router serves the start-up adapters by name (the workers get them in their config).
        args += ["--lora-modules", *(json.dumps(m.model_dump()) for m in cfg.engine.lora.modules)]
    if http:
        args += ["--http-port", str(cfg.http_port), *cfg.chat.cli_flags()]
    if cfg.tracing.otlp_endpoint:
        args += ["--otlp-endpoint", cfg.tracing.otlp_endpoint]
    sec = cfg.security
    for flag, path in (("--tls-cert", sec.tls_cert_file), ("--tls-key", sec.tls_key_file),
                       ("--tls-client-ca", sec.tls_client_ca_file)):
        if path:
            args += [flag, path]
    for address in worker_addresses:
        args += ["--worker", address]
    return args


def serve_local(cfg: ServingConfig, http: bool = False, start_timeout_s: float = 600.0,
                health_period_s: float = 2.0, unhealthy_after: int = 3) -> int:
    """Run `cfg` as OS processes until SIGINT / SIGTERM: each role's replicas (prefill +
    decode, or unified), then the router over their addresses, supervised (dead or
    health-failing children are restarted on their address). `http` also serves the
    OpenAI API on cfg.http_port."""
    stop_requested = threading.Event()

    def on_signal(signum, frame):
        stop_requested.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    supervisor = Supervisor(children, start_timeout_s, health_period_s, unhealthy_after=unhealthy_after)
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
        router = wait_ready(spawn("router", router_args(cfg, [c.address for c in children], http),
                                  is_worker=False), start_timeout_s)
        children.append(router)
        print(f"kvmesh local: router (kvmesh.v1.LLM) at {router.address}", flush=True)
        for c in children[:-1]:
            print(f"kvmesh local: {c.name} worker (kvmesh.v1.Worker) at {c.address}", flush=True)
        print("kvmesh local: Ctrl-C to stop", flush=True)
        while not stop_requested.wait(0.5):
            supervisor.tick()
        return 0
    finally:
        supervisor.stop_all()
        for s, h in previous.items():
            signal.signal(s, h)
