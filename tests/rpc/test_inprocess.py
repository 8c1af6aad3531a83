"""kvmesh.rpc.inprocess: a grpc.aio servicer awaited in-process behaves as over gRPC for
its caller: the stream, an abort as `grpc.aio.AioRpcError` (code, details, trailers),
the caller's metadata, the deadline, and a closed stream closing the handler."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.rpc.inprocess import InProcessContext, unary_stream, unary_unary
from kvmesh.rpc.retry_info import retry_after_metadata, retry_after_of


class Servicer:
    def __init__(self):
        self.closed = asyncio.Event()
        self.seen: dict = {}

    async def Count(self, n: int, context):
        self.seen = {m.key: m.value for m in context.invocation_metadata()}
        try:
            for i in range(n):
                yield i
                await asyncio.sleep(0)
            if n == 2:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down",
                                    trailing_metadata=retry_after_metadata(3, "slow down"))
        finally:
            self.closed.set()

    async def Echo(self, request: str, context):
        if not request:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: give one")
        return request.upper()


def test_stream_messages_metadata_and_deadline():
    async def run():
        s = Servicer()
        ctx = InProcessContext((("authorization", "Bearer k"),), timeout_s=30)
        got = [m async for m in unary_stream(s.Count, 3, ctx)]
        return got, s.seen, ctx.time_remaining(), InProcessContext().time_remaining()

    got, seen, left, unbounded = asyncio.run(run())
    assert got == [0, 1, 2]
    assert seen == {"authorization": "Bearer k"}
    assert 29 < left <= 30 and unbounded is None


def test_abort_is_the_rpc_error_a_client_sees():
    async def run():
        s = Servicer()
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for m in unary_stream(s.Count, 2, InProcessContext()):
                got.append(m)
        return got, exc.value

    got, err = asyncio.run(run())
    assert got == [0, 1]  # messages before the abort still arrive
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details() == "slow down"
    assert retry_after_of(err) == 3


def test_unary_reply_and_abort():
    async def run():
        s = Servicer()
        ok = await unary_unary(s.Echo, "hi", InProcessContext())
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await unary_unary(s.Echo, "", InProcessContext())
        return ok, exc.value

    ok, err = asyncio.run(run())
    assert ok == "HI"
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("request:")


def test_a_consumer_that_stops_closes_the_handler():
    """What a client disconnect does: the handler's `finally` runs (the router cancels
    the worker stream there, which frees the request's KV blocks)."""
    async def closed_early():
        s = Servicer()
        stream = unary_stream(s.Count, 1000, InProcessContext())
        assert await stream.__anext__() == 0
        await stream.aclose()
        return s.closed.is_set()

    async def cancelled():
        s = Servicer()

        async def consume():
            async for _ in unary_stream(s.Count, 10**9, InProcessContext()):
                await asyncio.sleep(0.001)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Cancelled between messages, the abandoned stream is closed by asyncio's async
        # generator finalizer, a loop iteration or two later (as a gRPC call is on GC).
        await asyncio.wait_for(s.closed.wait(), 5)
        return s.closed.is_set()

    assert asyncio.run(closed_early())
    assert asyncio.run(cancelled())
