"""AsyncLLMEngine: an LLMEngine driven by a background step loop, for servers.

The loop runs as an asyncio task; the engine's work runs on one dedicated thread, the
`StepThread` (torch releases the GIL), so the event loop keeps accepting requests. One
thread for everything that computes: an OpenMP team belongs to the thread that starts it.
- Steps alternating over two pool threads kept two teams, and the idle team's spinning
  workers took cores from the running one (served throughput ~8% under the offline engine).
- A model loaded (or a block read) on the event-loop thread leaves a second team too, and
  with more OpenMP threads than cores libgomp throttles its spin-wait to ~1000 iterations:
  workers sleep between parallel regions and every region pays a futex wake-up (steps
  ~8% slower, 178% CPU instead of 199% on 2 cores). So `build_worker` loads the model on
  the step thread, and calls queued with `run_between_steps` run there as well.
Adds, aborts and calls from callers are queued and applied between steps, so the engine is
only ever touched by one thread at a time. `generate()` is an async iterator of
RequestOutput; leaving it early (break, cancellation, client disconnect) aborts the
request and frees its KV blocks.

Failures are per request: a step that raises fails the requests of that step (their
consumers get StepFailedError, the blocks are freed) and the loop goes on. `health()`
tells the truth for health checks: the loop is dead, or a step has run longer than
`scheduler.step_timeout_s` (a wedged kernel), or all is well.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvmesh.engine.engine import LLMEngine, pin_request_id
from kvmesh.engine.lora import LoRAInfo
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import EngineDeadError, InvalidRequestError, StepFailedError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StepThread:
    """The one thread an engine computes on: model loading, steps, block reads."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmesh-step")

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the step thread and wait for it (not from a running event loop)."""
        return self._pool.submit(fn).result()

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine,
                 on_outputs: Callable[[list[RequestOutput]], None] | None = None,
                 step_thread: StepThread | None = None):
        """`on_outputs` sees every step's outputs on the loop thread, before they are
        delivered (telemetry, the autoscaling latency window). `step_thread`: the thread
        the engine was built on (see the module doc); a new one if None."""
        self.engine = engine
        self._on_outputs = on_outputs
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending_adds: list[tuple[str, list[int], SamplingParams, str | None, bool, str | None]] = []
        self._pending_aborts: set[str] = set()
        # Callables to run on the loop thread between steps (see run_between_steps).
        self._pending_calls: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        # When the running step (or between-steps call) started; None while idle.
        self._busy_since: float | None = None
        self.step_timeout_s = engine.config.scheduler.step_timeout_s
        self._step_thread = step_thread or StepThread()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            if self._dead is not None:
                raise EngineDeadError(f"engine step loop died: {self._dead!r}")
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        hold_kv: bool = False,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Validation errors raise before streaming.

        With `params.n` > 1 the choices' outputs interleave (RequestOutput.index says
        whose); the stream ends when every choice has finished.

        `hold_kv`: see LLMEngine.add_request; free the blocks with
        `run_between_steps(lambda: engine.release_kv(request_id))`.
        `lora`: the adapter's name (loaded, or a `--lora-modules` one, read now off the step
        loop); None: the base model.
        """
        self._ensure_loop()
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if isinstance(prompt, str):
            if not prompt:
                    raise InvalidRequestError("prompt", "must not be empty")
            ids = self.engine.encode(prompt)
            text = prompt
        else:
            ids, text = list(prompt), None
        self.engine.validate_prompt_ids(ids)
        self.engine.validate_params(params, hold_kv)
        if lora:
            await self._ensure_lora(lora)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._pending_adds.append((request_id, ids, params, text, hold_kv, lora or None))
        self._wakeup.set()
        finished = False
        unfinished = params.n
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                unfinished -= item.finished
                finished = unfinished == 0
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._pending_aborts.add(request_id)
                if self._wakeup is not None:
                    self._wakeup.set()

    def health(self) -> tuple[bool, str]:
        """(healthy, why not): False when the step loop died or a step (or a call run
        between steps) has been running longer than the step watchdog allows."""
        if self._dead is not None:
            return False, f"engine step loop died: {self._dead!r}"
        if self._loop_task is not None and self._loop_task.done():
            return False, "engine step loop exited"
        since = self._busy_since
        if since is not None and time.monotonic() - since > self.step_timeout_s:
            return False, (f"engine step running for {time.monotonic() - since:.0f}s, over the "
                           f"{self.step_timeout_s:g}s watchdog (scheduler.step_timeout_s)")
        return self.engine.executor_health()

    async def cache_prompt(self, name: str, prompt: str | list[int], ttl_s: float | None = None) -> int:
        """LLMEngine.cache_prompt without blocking the event loop: the pin runs as a normal
        request. A pin over the quota raises ResourceExhaustedError at once."""
        rid = pin_request_id(name)
        if rid in self._queues:
            raise InvalidRequestError("name", f"prompt {name!r} is being cached already; wait for that call")
        # The queue exists before begin_pin queues the request: its outputs can come at
        # the very next step.
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        try:
            await self.run_between_steps(lambda: self.engine.begin_pin(name, prompt))
        except BaseException:
            self._queues.pop(rid, None)
            raise
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    break
            if item.outputs[0].finish_reason == "abort":
                raise EngineDeadError(f"prompt cache entry {name!r} was aborted while computing")
            return await self.run_between_steps(lambda: self.engine.finish_pin(name, item, ttl_s))
        except BaseException:
            self._call_soon(lambda: self.engine.cancel_pin(name))
            raise
        finally:
            self._queues.pop(rid, None)

    def _call_soon(self, fn: Callable[[], Any]) -> None:
        """Run `fn` between steps without waiting for it (cleanup from a cancelled task)."""
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it
        self._pending_calls.append((fn, fut))
        if self._wakeup is not None:
            self._wakeup.set()

    # -- LoRA adapters (see LLMEngine) -------------------------------------------

    async def _ensure_lora(self, name: str) -> None:
        """Validate a request's adapter; read a configured one not in host memory yet."""
        host = self.engine.lora_host()
        if host.get(name) is not None:
            return
        path = self.engine.configured_lora_path(name)
        if path is None:
            self.engine.lora_request(name)  # raises: not loaded, naming the loaded ones
        await self.load_lora(name, path)

    async def load_lora(self, name: str, path: str) -> LoRAInfo:
        """Read a PEFT adapter folder on a worker thread (never stalling the steps), then
        hold it between steps. Idempotent for the same name and path."""
        host = self.engine.lora_host()
        info = host.get(name)
        if info is not None and info.path == path:
            return info
        loaded = await asyncio.to_thread(host.read, name, path)
        return await self.run_between_steps(lambda: self.engine.add_lora(name, path, loaded))

    async def unload_lora(self, name: str) -> bool:
        """Drop an adapter; False if it was not loaded; InvalidRequestError while requests use it."""
        self.engine.lora_host()
        return await self.run_between_steps(lambda: self.engine.unload_lora(name))

    def list_loras(self) -> list[LoRAInfo]:
        return self.engine.list_loras()

    async def abort(self, request_id: str) -> None:
        self._pending_aborts.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def run_between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the step thread while no step is running; returns its result.

        The engine (block pool, runner KV tensors) is not thread-safe: anything that
        touches it from outside the step loop (releasing held KV, reading blocks for
        a transfer, snapshotting the prefix cache) goes through here. `fn` delays the
        next step while it runs, so keep it short; it must not touch asyncio objects.
        """
        self._ensure_loop()
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls.append((fn, fut))
        self._wakeup.set()
        return await fut

    async def _apply_pending(self) -> None:
        """Apply queued calls, adds and aborts on the step thread; deliver on the loop."""
        calls = [(fn, fut) for fn, fut in self._pending_calls if not fut.done()]  # done: caller cancelled
        adds, aborts = self._pending_adds, self._pending_aborts
        self._pending_calls, self._pending_adds, self._pending_aborts = [], [], set()
        if not (calls or adds or aborts):
            return
        self._busy_since = time.monotonic()
        try:
            results, add_errors = await self._step_thread.run(lambda: self._apply(calls, adds, aborts))
        except BaseException as exc:  # the step thread is gone; callers hear why
            for _, fut in calls:
                if not fut.done():
                    fut.set_exception(EngineDeadError(f"engine step thread failed: {exc!r}"))
            raise
        finally:
            self._busy_since = None
        for (_, fut), (ok, value) in zip(calls, results):
            if fut.done():
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)
        for rid, exc in add_errors:
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(exc)

    def _apply(self, calls, adds, aborts) -> tuple[list[tuple[bool, Any]], list[tuple[str, Exception]]]:
        """On the step thread: run the calls, add the requests, apply the aborts."""
        results: list[tuple[bool, Any]] = []
        for fn, _ in calls:
            try:
                results.append((True, fn()))
            except Exception as exc:
                results.append((False, exc))
        add_errors = []
        for rid, ids, params, text, hold_kv, lora in adds:
            if rid in aborts:
                continue
            try:
                self.engine.add_request(rid, ids, params, prompt_text=text, hold_kv=hold_kv, lora=lora)
            except Exception as exc:  # validated already; defensive, never kill the loop
                add_errors.append((rid, exc))
        if aborts:
            self.engine.abort(aborts)
        return results, add_errors

    async def _run(self) -> None:
        try:
            while True:
                await self._apply_pending()
                if not self.engine.has_unfinished():
                    self._wakeup.clear()
                    if not self._pending_adds and not self._pending_aborts and not self._pending_calls:
                        await self._wakeup.wait()
                    continue
                self._busy_since = time.monotonic()
                try:
                    outputs = await self._step_thread.run(self.engine.step)
                except StepFailedError as exc:  # those requests only; the engine serves on
                    for rid in exc.request_ids:
                        q = self._queues.get(rid)
                        if q is not None:
                            q.put_nowait(exc)
                    continue
                finally:
                    self._busy_since = None
                if self._on_outputs is not None:
                    self._on_outputs(outputs)
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                    elif not out.finished:
                        self._pending_aborts.add(out.request_id)  # consumer is gone
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surface to every waiting consumer
            logger.exception("engine step loop crashed")
            self._dead = exc
            for q in self._queues.values():
                q.put_nowait(EngineDeadError(f"engine step loop died: {exc!r}"))
            for _, fut in self._pending_calls:
                if not fut.done():
                    fut.set_exception(EngineDeadError(f"engine step loop died: {exc!r}"))
            raise

    async def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until every request (including pending aborts) has left the engine."""
        async def _idle():
            while self.engine.has_unfinished() or self._pending_adds or self._pending_aborts:
                if self._wakeup is not None:
                    self._wakeup.set()
                await asyncio.sleep(0.01)

        await asyncio.wait_for(_idle(), timeout)

    async def shutdown(self) -> None:
        """Stop the step loop and the executor's processes (a tensor-parallel group's ranks)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
            self._loop_task = None
        await self._step_thread.run(self.engine.close)
