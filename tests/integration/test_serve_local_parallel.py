"""`kvmesh serve --local --tensor-parallel-size 2`: one decode worker whose group is two
processes (the worker is rank 0, rank 1 is a fork of its fork server). Greedy output through
the router equals the one-rank engine's; a killed rank turns the worker's gRPC health NOT_SERVING at once, a
request sent meanwhile ends (served or refused with a status) instead of hanging, the
supervisor restarts the whole worker (a fresh group) on the same address, and SIGTERM
leaves no rank process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import is_rank_process

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh_procs import start_serve_local

PROMPT_IDS = [5, 17, 33, 2, 91, 44, 8, 12, 60, 7]
MAX_TOKENS = 12


def worker_and_rank(serve_pid: int, port: int) -> tuple[int, int]:
    """(pid of the worker listening on `port`, pid of its rank 1 process)."""
    for child in psutil.Process(serve_pid).children():
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp")):
                ranks = [p for p in child.children(recursive=True) if is_rank_process(p)]
                assert len(ranks) == 1, [p.cmdline() for p in child.children(recursive=True)]
                return child.pid, ranks[0].pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no child of {serve_pid} listens on {port}")


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return resp.status


async def generate(port: int, timeout: float = 60) -> list[int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = llm_pb2_grpc.LLMStub(ch).Generate(llm_pb2.GenerateRequest(
            prompt_token_ids=PROMPT_IDS,
            params=llm_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)), timeout=timeout)
        return [t async for msg in call for t in msg.token_ids]


@pytest.mark.timeout(400)
def test_serve_local_tensor_parallel_serves_and_restarts_a_group_with_a_dead_rank(tiny_llama, tmp_path):
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.llm import LLM

    llm = LLM(model=str(tiny_llama), max_model_len=128, block_size=4, num_blocks=128)
    want = llm.generate([PROMPT_IDS], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    want = list(want[0].outputs[0].token_ids)
    llm.close()

    log = tmp_path / "serve.log"
    proc, port, workers = start_serve_local(tiny_llama, log, "--num-blocks", "128", "--tensor-parallel-size", "2",
                                            "--prefill-replicas", "0", "--decode-replicas", "1", timeout=200)
    seen: list[int] = []
    try:
        assert len(workers) == 1, log.read_text()
        name, address = workers[0]
        worker_pid, rank_pid = worker_and_rank(proc.pid, int(address.rsplit(":", 1)[1]))
        seen += [worker_pid, rank_pid]
        assert asyncio.run(generate(port)) == want

        os.kill(rank_pid, signal.SIGKILL)

        async def outage():
            """Health goes NOT_SERVING; a request sent now ends one way or the other."""
            statuses = []
            pending = asyncio.ensure_future(generate(port, timeout=150))
            deadline = time.monotonic() + 30
            while health_pb2.HealthCheckResponse.NOT_SERVING not in statuses:
                assert time.monotonic() < deadline, statuses
                try:
                    statuses.append(await health(address))
                except grpc.aio.AioRpcError as exc:  # the supervisor already stopped it
                    statuses.append(exc.code())
                    break
                await asyncio.sleep(0.1)
            try:
                outcome = await pending
            except grpc.aio.AioRpcError as exc:
                outcome = exc.code()
            return statuses, outcome

        statuses, outcome = asyncio.run(outage())
        assert statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING or statuses[-1] in (
            health_pb2.HealthCheckResponse.NOT_SERVING, grpc.StatusCode.UNAVAILABLE), statuses
        # Served by the restarted group (the router retries), or refused with a status: not hung.
        assert outcome == want or isinstance(outcome, grpc.StatusCode), outcome

        deadline = time.monotonic() + 150
        while f"{name} is back at {address}" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        new_worker, new_rank = worker_and_rank(proc.pid, int(address.rsplit(":", 1)[1]))
        assert new_worker != worker_pid and new_rank != rank_pid
        seen += [new_worker, new_rank]
        assert not psutil.pid_exists(worker_pid) or psutil.Process(worker_pid).status() == psutil.STATUS_ZOMBIE
        assert asyncio.run(health(address)) == health_pb2.HealthCheckResponse.SERVING
        deadline = time.monotonic() + 60
        while True:  # the router's Stats poll finds the worker again
            try:
                got = asyncio.run(generate(port))
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
                time.sleep(0.5)
        assert got == want
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(60) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    left = [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {left}"
