"""`LoopThread`: a private asyncio event loop on its own daemon thread.

A Ray Serve replica's own loop serves Ray calls and HTTP; kvmesh's gRPC servers and
the engine run on a LoopThread instead, so neither can stall the other. Code on the
replica's side hands coroutines over with `run` (blocking, for constructors) or
`run_async` (awaitable, for async replica methods).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    """A private asyncio loop: the gRPC servers and the engine live here, away from the
    Ray replica's own loop (which serves Ray calls and HTTP)."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    def run(self, coro: Coroutine, timeout_s: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def run_async(self, coro: Coroutine) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def alive(self) -> bool:
        return self._thread.is_alive() and self.loop.is_running()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
