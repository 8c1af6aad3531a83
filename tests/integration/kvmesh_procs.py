"""Start kvmesh workers and routers as real OS processes on loopback, for tests.

Every process listens on port 0 and reports its address in one READY line on
stdout; output goes to a log file that is shown when a start fails. `stop` always
ends the process (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    address: str = ""
    ready: str = ""

    def alive(self) -> bool:
        return self.popen.poll() is None


def spawn(name: str, args: list[str], log_dir: Path, ready: str) -> Proc:
    """Start `python args...` without waiting; see wait_ready."""
    log = log_dir / f"{name}.log"
    env = {**os.environ, **_ENV}
    with open(log, "w") as fh:
        popen = subprocess.Popen([sys.executable, *args], stdout=fh, stderr=subprocess.STDOUT, env=env)
    proc = Proc(name, popen, log)
    proc.ready = ready
    return proc


def wait_ready(proc: Proc, timeout: float = 120.0) -> Proc:
    """Wait for the process's READY line; fills `address`. Kills it on failure."""
    deadline = time.monotonic() + timeout
    pattern = re.compile(proc.ready + r".*address=(\S+)")
    while time.monotonic() < deadline:
        m = pattern.search(proc.log.read_text())
        if m:
            proc.address = m.group(1)
            return proc
        if not proc.alive():
            break
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"{proc.name} did not start within {timeout}s; its log:\n{proc.log.read_text()[-4000:]}")


def spawn_worker(name: str, model: Path, role: str, log_dir: Path, *, transfer_ttl: float = 30.0,
                 num_blocks: int = 256, block_size: int = 4, max_model_len: int = 256, extra: list[str] = ()) -> Proc:
    args = ["-m", "kvmesh.cli", "worker", "--role", role, "--port", "0", "--model", str(model),
            "--threads", "1", "--num-blocks", str(num_blocks), "--block-size", str(block_size),
            "--max-model-len", str(max_model_len), "--transfer-ttl", str(transfer_ttl), *extra]
    return spawn(name, args, log_dir, "KVMESH_WORKER_READY")


def spawn_router(name: str, model: Path, workers: list[str], log_dir: Path, *, extra: list[str] = ()) -> Proc:
    args = ["-m", "kvmesh.cli", "router", "--port", "0", "--model", str(model), *extra]
    for w in workers:
        args += ["--worker", w]
    return spawn(name, args, log_dir, "KVMESH_ROUTER_READY")


def stop(proc: Proc, timeout: float = 10.0) -> None:
    if proc.alive():
        proc.popen.terminate()
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(timeout)


def kill(proc: Proc) -> None:
    """Hard kill (a crashed worker)."""
    if proc.alive():
        proc.popen.kill()
        proc.popen.wait(10)


async def collect(call) -> tuple[list[int], str, object]:
    """Drain a Generate-style stream: (token ids, text, last message)."""
    tokens, text, last = [], "", None
    async for msg in call:
        tokens += list(msg.token_ids)
        text += msg.text
        last = msg
    return tokens, text, last


async def worker_stats(address: str):
    import grpc

    from kvmesh._proto import worker_pb2, worker_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)


async def wait_idle(addresses: list[str], timeout: float = 15.0) -> list:
    """Poll Stats until every worker is back to its full free-block count with nothing
    running and no held transfer; returns the final Stats (asserts on timeout)."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        stats = [await worker_stats(a) for a in addresses]
        if all(s.num_free_blocks == s.num_usable_blocks and s.num_running == 0 and s.num_waiting == 0
               and s.num_held_transfers == 0 for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"workers not idle after {timeout}s: {stats}")
        await asyncio.sleep(0.1)


def start_serve_local(model: Path, log: Path, *args: str, env: dict | None = None,
                      timeout: float = 150.0) -> tuple[subprocess.Popen, int, list[tuple[str, str]]]:
    """`kvmesh serve --local` on `model` with tiny-model engine flags plus `args`, on a
    free gRPC port; returns (process, port, [(worker name, address)]) once it is ready.
    Kills it and fails with its log if it exits or is not ready within `timeout`."""
    from kvmesh.rpc import free_port

    port = free_port()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", "--local", "--model", str(model), "--port", str(port),
             "--threads", "1", "--block-size", "4", "--max-model-len", "128", *args],
            stdout=fh, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    deadline = time.monotonic() + timeout
    while "Ctrl-C to stop" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(log.read_text())
        time.sleep(0.2)
    return proc, port, re.findall(r"(\S+) worker \(kvmesh.v1.Worker\) at (\S+)", log.read_text())
