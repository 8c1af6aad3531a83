"""The router's LoRA adapters: which adapters it serves (name -> path) and where they are.

- The *registry* (`LoRAAdapters.paths`) is what clients may ask for by `model`: the
  engine config's `lora.modules` at start-up, plus `LoadLoRAAdapter` at run time, minus
  `UnloadLoRAAdapter`; `sync_adapters` makes it equal to a given list (the Kubernetes
  operator's reconcile). An adapter a worker reports in Stats that the registry does not
  name (loaded on the worker directly) is served too, under the path the worker reported.
- The *adapter table* is on each `WorkerHandle` (`loras`, from Stats polls and LoadLoRA
  replies, plus the adapters this router sent there lately); the `lora_affinity` scorer
  reads it, so a request goes where its adapter already is.
- Every worker request for an adapter carries its path (`LoRARef`): a worker that does
  not hold it loads it first (load-on-miss), so an adapter no worker holds is served by
  the best worker by the usual scores, which then holds it for the next requests.
- `content keys`: the adapter's fingerprint, as the workers report it, is mixed into the
  router's block hashes (engine/hashing.py) so prefix affinity of adapter requests
  matches the workers' KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import grpc
from pydantic import ValidationError

from kvmesh._proto import llm_pb2, worker_pb2
from kvmesh.config import LoRAModule
from kvmesh.errors import InvalidRequestError, NotFoundError, UnavailableError
from kvmesh.router.plugins import RouteRequest, WorkerScheduler
from kvmesh.router.registry import WorkerHandle, WorkerPool
from kvmesh.rpc.status import error_of_rpc

logger = logging.getLogger(__name__)

# An unload a worker refused (requests still run under the adapter) is retried this long.
UNLOAD_RETRY_S = 120.0
_UNLOAD_RETRY_PERIOD_S = 1.0


def check_adapter(name: str, path: str, base_model: str, name_field: str = "lora_name",
                  path_field: str = "lora_path") -> None:
    """An adapter name and path as LoRAModule takes them, and not the base model's name."""
    if not name:
        raise InvalidRequestError(name_field, "required: the name requests select the adapter by (`model`)")
    if not path:
        raise InvalidRequestError(path_field, "required: a PEFT adapter folder (adapter_config.json + "
                                              "adapter_model.safetensors) the workers can read")
    try:
        LoRAModule(name=name, path=path)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = name_field if err.get("loc", ("name",))[0] == "name" else path_field
        raise InvalidRequestError(field, f"{err.get('msg', 'invalid')} (got {name if field == name_field else path!r})"
                                  ) from None
    if name == base_model:
        raise InvalidRequestError(name_field, f"{name!r} is the base model's name; name the adapter otherwise")


class LoRAAdapters:
    """The registry and the run-time operations on adapters (see the module docstring)."""

    def __init__(self, pool: WorkerPool, scheduler: WorkerScheduler, base_model: str,
                 adapters: Iterable[tuple[str, str]] = (), rpc_timeout_s: float = 60.0):
        self.pool = pool
        self.scheduler = scheduler
        self.base_model = base_model
        self.rpc_timeout_s = rpc_timeout_s
        self.paths: dict[str, str] = {}
        for name, path in adapters:
            check_adapter(name, path, base_model, "lora.modules.name", "lora.modules.path")
            self.paths[name] = path
        # Unloaded (or synced away) here: not served even while a worker still reports it.
        self._removed: set[str] = set()
        self._background: set[asyncio.Task] = set()

    # -- lookups ------------------------------------------------------------------------

    def _reported(self) -> dict[str, worker_pb2.LoRAInfo]:
        """Adapters the workers report holding, by name (the first report wins)."""
        out: dict[str, worker_pb2.LoRAInfo] = {}
        for w in self.pool.handles():
            for name, info in w.loras.items():
                out.setdefault(name, info)
        return out

    def served(self) -> dict[str, str]:
        """Every adapter a request may name: the registry, then the workers' own."""
        out = {n: i.path for n, i in self._reported().items() if i.path and n not in self._removed}
        out.update(self.paths)
        return dict(sorted(out.items()))

    def key_of(self, name: str) -> str:
        """The adapter's content fingerprint as a worker holding it reported it ('' unknown)."""
        for w in self.pool.handles():
            info = w.loras.get(name)
            if info is not None and info.key and (name not in self.paths or info.path == self.paths[name]):
                return info.key
        return ""

    def resolve(self, model: str, lora: llm_pb2.LoRARef | None = None) -> llm_pb2.LoRARef | None:
        """The adapter a request's `model` (or `lora.name`) selects; None: the base model.
        Unknown names are NOT_FOUND, listing what is served."""
        name = model
        if lora is not None and lora.name:
            if model and model != self.base_model and model != lora.name:
                raise InvalidRequestError("lora", f"names adapter {lora.name!r} but model is {model!r}; set one")
            name = lora.name
        if not name or name == self.base_model:
            return None
        served = self.served()
        path = served.get(name)
        if path is None:
            names = ", ".join(repr(n) for n in [self.base_model, *served])
            raise NotFoundError("model", f"model {name!r} is not served here; ListModels shows {names} "
                                         "(load an adapter with LoadLoRAAdapter / POST /v1/load_lora_adapter)")
        if lora is not None and lora.path and lora.path != path:
            raise InvalidRequestError("lora.path", f"adapter {name!r} is served from {path!r}, not {lora.path!r}; "
                                                   "load other weights under another name")
        workers = [w for w in self.pool.handles() if w.stats is not None]
        if workers and not any(w.lora_enabled for w in workers):
            raise InvalidRequestError("model", f"{name!r} is a LoRA adapter, but no worker serves adapters; start "
                                               "the workers with --enable-lora")
        return llm_pb2.LoRARef(name=name, path=path)

    def model_infos(self, base: llm_pb2.ModelInfo) -> list[llm_pb2.ModelInfo]:
        """ListModels: the base model, then one entry per adapter (parent: the base model)."""
        out = [base]
        handles = self.pool.handles()
        for name, path in self.served().items():
            out.append(llm_pb2.ModelInfo(id=name, max_model_len=base.max_model_len, block_size=base.block_size,
                                         fingerprint=base.fingerprint, parent=self.base_model, root=path,
                                         num_workers=sum(name in w.loras for w in handles)))
        return out

    # -- load / unload --------------------------------------------------------------------

    def _targets(self, name: str) -> list[WorkerHandle]:
        """Where to load a new adapter: for each stage that has workers, the best worker
        by the usual scores, unless one of them already reports holding it."""
        healthy = [w for w in self.pool.handles() if w.healthy()]
        stages = ["decode"] + (["prefill"] if any(w.role == "prefill" for w in healthy) else [])
        out: list[WorkerHandle] = []
        for stage in stages:
            req = RouteRequest(f"load-lora-{name}", [], [], self.pool.block_size or 1, stage=stage, lora=name)
            cands = self.scheduler.candidates(req, healthy)
            if any(name in w.loras for w in cands):
                continue
            w = self.scheduler.pick(req, healthy)
            if w is not None and w not in out:
                out.append(w)
        return out

    async def _load_on(self, w: WorkerHandle, name: str, path: str, timeout: float | None) -> worker_pb2.LoRAInfo:
        try:
            info = await w.stub.LoadLoRA(worker_pb2.LoadLoRARequest(lora=llm_pb2.LoRARef(name=name, path=path)),
                                         timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise error_of_rpc(exc, prefix=f"worker {w.address}: ") from None
        w.note_lora(name, info)
        return info

    async def load(self, name: str, path: str, timeout_s: float | None = None) -> llm_pb2.LoadLoRAAdapterResponse:
        """Load on at least one worker (one per stage: P/D needs it at prefill and decode),
        then register it. Idempotent for the same name and path; a bad path is the
        worker's INVALID_ARGUMENT and registers nothing."""
        check_adapter(name, path, self.base_model)
        known = self.paths.get(name)
        if known is not None and known != path:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is already loaded from {known!r}; unload it "
                                                   "first, or load these weights under another name")
        if not any(w.healthy() for w in self.pool.handles()):
            raise UnavailableError("no healthy worker to load the adapter on; retry shortly")
        timeout = timeout_s if timeout_s is not None else self.rpc_timeout_s
        infos = await asyncio.gather(*(self._load_on(w, name, path, timeout) for w in self._targets(name)))
        self.paths[name] = path
        self._removed.discard(name)
        holders = sorted(w.address for w in self.pool.handles() if name in w.loras)
        rank = infos[0].rank if infos else next((w.loras[name].rank for w in self.pool.handles()
                                                  if name in w.loras), 0)
        logger.info("LoRA adapter %s (%s) registered; held by %s", name, path, ", ".join(holders))
        return llm_pb2.LoadLoRAAdapterResponse(lora_name=name, rank=rank, workers=holders)

    async def unload(self, name: str, timeout_s: float | None = None) -> None:
        """Drop from the registry and unload from every worker; NOT_FOUND if nothing
        serves it. A worker still running requests under it is retried in the background
        (no new request can name it meanwhile)."""
        if not name:
            raise InvalidRequestError("lora_name", "required: the adapter to unload")
        if name not in self.paths and not any(w.holds_lora(name) for w in self.pool.handles()):
            names = ", ".join(repr(n) for n in self.served()) or "none"
            raise NotFoundError("lora_name", f"LoRA adapter {name!r} is not loaded (adapters: {names})")
        old = self.paths.pop(name, None)
        self._removed.add(name)
        await self._unload_everywhere(name, old, timeout_s if timeout_s is not None else self.rpc_timeout_s)

    async def _unload_everywhere(self, name: str, old_path: str | None, timeout: float) -> None:
        workers = self.pool.handles()
        results = await asyncio.gather(*(self._unload_on(w, name, timeout) for w in workers))
        for w, busy in zip(workers, results):
            if busy:
                self._retry_unload(w, name, old_path)

    async def _unload_on(self, w: WorkerHandle, name: str, timeout: float) -> bool:
        """True when the worker refused because requests still run under the adapter."""
        try:
            await w.stub.UnloadLoRA(worker_pb2.UnloadLoRARequest(name=name), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                logger.info("worker %s keeps LoRA adapter %s for now (%s); retrying", w.address, name, exc.details())
                return True
            logger.warning("unloading LoRA adapter %s from %s failed (%s: %s)", name, w.address, exc.code().name,
                           exc.details())
        w.forget_lora(name)
        return False

    def _retry_unload(self, w: WorkerHandle, name: str, old_path: str | None) -> None:
        async def retry() -> None:
            deadline = time.monotonic() + UNLOAD_RETRY_S
            while time.monotonic() < deadline:
                await asyncio.sleep(_UNLOAD_RETRY_PERIOD_S)
                if old_path is not None and self.paths.get(name) == old_path:  # loaded again meanwhile: keep it
                    return
                if not await self._unload_on(w, name, self.rpc_timeout_s):
                    return
            logger.warning("worker %s still runs requests under LoRA adapter %s after %.0f s; giving up unloading",
                           w.address, name, UNLOAD_RETRY_S)

        task = asyncio.get_running_loop().create_task(retry())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def sync(self, adapters: list[tuple[str, str]]) -> None:
        """Make the registry equal to `adapters`: removed ones (or ones whose path changed)
        are unloaded from every worker; new ones are registered and loaded lazily, by the
        first request (load-on-miss)."""
        want: dict[str, str] = {}
        for name, path in adapters:
            check_adapter(name, path, self.base_model, "adapters.name", "adapters.path")
            if name in want and want[name] != path:
                raise InvalidRequestError("adapters", f"adapter {name!r} is listed twice with different paths")
            want[name] = path
        gone = {n: p for n, p in self.paths.items() if want.get(n) != p}
        changed = bool(gone) or bool(set(want) - set(self.paths))
        for name in gone:
            self.paths.pop(name)
            self._removed.add(name)
        await asyncio.gather(*(self._unload_everywhere(n, p, self.rpc_timeout_s) for n, p in gone.items()))
        self.paths.update(want)
        self._removed -= set(want)
        if changed:
            logger.info("LoRA adapters synced: %s", ", ".join(sorted(want)) or "none")

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
