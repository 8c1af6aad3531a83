"""The server boilerplate every kvmesh gRPC server and channel gets: message size limits,
standard health checking and reflection, signal handling."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Message size cap for every channel and server: KV chunks are <= 1 MiB by default,
# but a caller may ask for bigger ones.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted worker comes back on its address: reconnect within seconds of its
    # return, not after grpc's default backoff of up to 120 s.
    ("grpc.max_reconnect_backoff_ms", 5000),
]


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Standard grpc.health.v1 (overall and per service) plus server reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (tests, the local launcher)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def run_until_signalled(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
    """Start, then wait for SIGINT / SIGTERM and stop cleanly."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await start()
    await done.wait()
    await stop()


# Methods every server leaves open to any caller (load balancers and grpcurl need them).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class Refusal:
    """UNAUTHENTICATED handlers carrying one message, for unary and server-streaming
    methods: what an auth interceptor returns instead of the real handler."""

    def __init__(self, message: str):
        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await deny_unary(request, context)
            yield  # pragma: no cover - abort raises

        self._unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    def handler_for(self, handler):
        """The refusal shaped like `handler` (the method's real handler, or None)."""
        return self._stream if handler is not None and handler.response_streaming else self._unary

