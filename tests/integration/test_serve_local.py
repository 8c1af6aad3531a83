"""`kvmesh serve --local`: starts router + prefill + decode processes, serves, and
shuts all of them down on SIGTERM."""

import asyncio
import re
import signal
import socket

import grpc
import pytest

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh_procs import collect, start_serve_local


@pytest.mark.timeout(180)
def test_serve_local_serves_then_stops_cleanly(tiny_llama, tmp_path):
    log = tmp_path / "serve.log"
    proc, port, _ = start_serve_local(tiny_llama, log, "--num-blocks", "128", "--pd-threshold-tokens", "8")
    try:
        text = log.read_text()
        assert f"router (kvmesh.v1.LLM) at 127.0.0.1:{port}" in text
        workers = re.findall(r"(prefill|decode) worker \(kvmesh.v1.Worker\) at (\S+)", text)
        assert [w[0] for w in workers] == ["prefill", "decode"]

        async def main():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = llm_pb2_grpc.LLMStub(ch).Generate(llm_pb2.GenerateRequest(
                    prompt="The quick brown fox jumps over the lazy dog.",
                    params=llm_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)), timeout=60)
                tokens, _, last = await collect(call)
                return tokens, last, dict(await call.trailing_metadata())

        tokens, last, meta = asyncio.run(main())
        assert len(tokens) == 4 and last.finish_reason == "length" and meta["kvmesh-route"] == "pd"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Every child is gone: nothing listens on the router or worker ports any more.
    for addr in [f"127.0.0.1:{port}", *(w[1] for w in workers)]:
        host, p = addr.rsplit(":", 1)
        with pytest.raises(OSError):
            socket.create_connection((host, int(p)), timeout=1).close()


INTERNAL_TOKEN = "serve-local-test-token"  # worker ports refuse calls without it (docs/security.md)


def _start_local(tiny_llama, tmp_path, *extra):
    return start_serve_local(tiny_llama, tmp_path / "serve.log", "--num-blocks", "128", *extra,
                             env={"KVMESH_INTERNAL_TOKEN": INTERNAL_TOKEN})


def _stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _worker_stats(address, token: str | None = INTERNAL_TOKEN):
    from kvmesh._proto import worker_pb2, worker_pb2_grpc

    metadata = (("kvmesh-internal-token", token),) if token else None
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10, metadata=metadata)


@pytest.mark.timeout(180)
def test_serve_local_hands_workers_the_whole_engine_config(tiny_llama, tmp_path):
    """Flags `serve --local` once dropped (speculation) reach every worker; the replica
    counts shape the local deployment (one prefill and two decode workers)."""
    proc, port, workers = _start_local(tiny_llama, tmp_path, "--speculative", "ngram", "--num-speculative-tokens",
                                       "6", "--decode-replicas", "2")
    try:
        assert [w[0] for w in workers] == ["prefill", "decode-0", "decode-1"]

        async def main():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                # A repetitive prompt: n-gram lookup finds drafts to propose.
                call = llm_pb2_grpc.LLMStub(ch).Generate(llm_pb2.GenerateRequest(
                    prompt="one two three one two three one two three one two three",
                    params=llm_pb2.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)), timeout=60)
                tokens, _, _ = await collect(call)
            return tokens, [await _worker_stats(addr) for _, addr in workers]

        tokens, stats = asyncio.run(main())
        with pytest.raises(grpc.aio.AioRpcError) as outsider:  # secure by default: worker ports need the token
            asyncio.run(_worker_stats(workers[0][1], token=None))
        assert outsider.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(tokens) == 12
        assert [st.role for st in stats] == ["prefill", "decode", "decode"]
        for st in stats:
            assert st.spec_method == "ngram" and st.num_speculative_tokens == 6
    finally:
        _stop(proc)
