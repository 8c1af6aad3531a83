"""Connects an engine to a KV store: loads stored prefix blocks at admission (the
scheduler's KVLoader hook) and saves newly computed prompt blocks after each step on a
background writer thread (bounded queue; when it is full, writes are dropped, never
waited for, so decoding is never blocked by the store).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter

import torch

from kvmesh.engine.hashing import block_hashes
from kvmesh.engine.outputs import SchedulerOutput
from kvmesh.engine.request import Request
from kvmesh.kvstore.base import KVStore
from kvmesh.kvstore.codec import BlockCodec, BlockDecodeError
from kvmesh.worker.host_staging import HostStaging

logger = logging.getLogger(__name__)


def block_to_bytes(block: torch.Tensor) -> bytes:
    """(layers, 2, *block_shape) tensor -> raw bytes (any dtype, incl. bfloat16)."""
    return block.contiguous().view(torch.uint8).numpy().tobytes()


def bytes_to_block(payload, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)


class StoreConnector:
    """The engine's KVConnector (engine.interfaces) over a KVStore (kvstore.base)."""

    def __init__(self, store: KVStore, codec: BlockCodec, runner, ttl_s: float | None,
                 queue_size: int = 64):
        self.store, self.codec, self.runner = store, codec, runner
        self.ttl_s = ttl_s
        self.block_size = codec.block_size
        # One block as read_blocks gives it (an 8-bit cache's: bytes, scales included).
        self.shape = (codec.num_layers, 2, *runner.spec.block_shape)
        self.dtype = runner.spec.wire_dtype
        # Blocks read from a CUDA cache reach the host through one reused pinned buffer.
        self.host = HostStaging(pin=runner.device.type == "cuda")
        self.counters: Counter[str] = Counter()
        self._pending: dict[str, list] = {}
        self._saved: dict[str, int] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-writer", daemon=True)
        self._writer.start()

    # -- load (KVLoader) ----------------------------------------------------

    def lookup(self, request: Request, num_local_tokens: int) -> int:
        bs = self.block_size
        self._update_hashes(request)
        first, last = num_local_tokens // bs, (request.num_tokens - 1) // bs
        hashes = request.block_hashes[first:last]
        self._pending.pop(request.request_id, None)
        if not hashes:
            return 0
        t0 = time.perf_counter()
        keys = [self.codec.key(h) for h in hashes]
        values = self.store.get_many(keys)
        self.counters["lookup_seconds"] += time.perf_counter() - t0
        self.counters["lookups"] += 1
        payloads = []
        for key, value in zip(keys, values):
            if value is None:
                break
            try:
                payloads.append(self.codec.decode(value, key))
            except BlockDecodeError as exc:
                self.counters[f"rejected_{exc.kind}"] += 1
                logger.warning("kv store block rejected (%s); computing it locally", exc)
                break
        self.counters["hit_blocks"] += len(payloads)
        self.counters["miss_blocks"] += len(hashes) - len(payloads)
        if payloads:
            self._pending[request.request_id] = payloads
        return len(payloads) * bs

    def load(self, request: Request, block_ids: list[int], start: int, num_tokens: int) -> int:
        payloads = self._pending.pop(request.request_id, [])
        n = min(len(payloads), num_tokens // self.block_size)
        if n == 0:
            return 0
        first = start // self.block_size
        data = torch.stack([bytes_to_block(p, self.shape, self.dtype) for p in payloads[:n]], dim=2)
        self.runner.write_blocks(block_ids[first : first + n], data)
        self.counters["bytes_read"] += n * self.codec.payload_bytes
        return n * self.block_size

    # -- save -----------------------------------------------------------------

    def save_after_step(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Queue this step's newly completed full prompt blocks for the store."""
        bs = self.block_size
        for seq in sched.seqs:
            req = requests.get(seq.request_id)
            if req is None:
                continue
            done = seq.start_pos + seq.num_tokens
            full = min(done, req.num_prompt_tokens) // bs
            saved = self._saved.get(req.request_id, max(req.num_cached_tokens, 0) // bs)
            if req.is_finished:
                self._saved.pop(req.request_id, None)
            else:
                self._saved[req.request_id] = max(full, saved)
            if full <= saved or 0 in seq.block_ids[saved:full]:
                # (block 0, the null block, stands for a block a sliding window dropped before it
                # was saved: its KV is gone, and a store entry must never be made of it)
                continue
            self._update_hashes(req)
            # seq.block_ids is the table as scheduled: still valid for a request that
            # finished this step (its freed blocks are not reused before the next step).
            data = self.host.to_host(self.runner.read_blocks(seq.block_ids[saved:full]))
            keys = [self.codec.key(req.block_hashes[i]) for i in range(saved, full)]
            items = [(k, self.codec.encode(block_to_bytes(data[:, :, j]), k)) for j, k in enumerate(keys)]
            self.enqueue(items, self.ttl_s)

    def _update_hashes(self, request: Request) -> None:
        # The same chained hashes the engine's prefix cache computes (and caches on the request).
        request.block_hashes = block_hashes(request.all_token_ids, self.block_size, self.codec.fingerprint,
                                            request.block_hashes, request.cache_salt, request.lora_key)

    def pin_prompt(self, token_ids: list[int], block_ids: list[int]) -> list[bytes]:
        """Write the prompt's full blocks without TTL (synchronously, after queued writes)
        and pin them in the store; returns their keys."""
        hashes = block_hashes(token_ids, self.block_size, self.codec.fingerprint)
        keys = [self.codec.key(h) for h in hashes]
        self.flush()
        if not keys:
            return keys
        data = self.host.to_host(self.runner.read_blocks(block_ids[: len(hashes)]))
        self.store.put_many([(k, self.codec.encode(block_to_bytes(data[:, :, i]), k)) for i, k in enumerate(keys)],
                            None)
        self.store.pin(keys)
        return keys

    def unpin(self, keys: list[bytes]) -> None:
        """Pinned keys get the connector's TTL back."""
        self.store.unpin(keys, self.ttl_s)

    def enqueue(self, items: list[tuple[bytes, bytes]], ttl_s: float | None) -> bool:
        try:
            self._queue.put_nowait((items, ttl_s))
            return True
        except queue.Full:
            self.counters["dropped_write_blocks"] += len(items)
            return False

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            items, ttl_s = job
            t0 = time.perf_counter()
            self.store.put_many(items, ttl_s)
            self.counters["write_seconds"] += time.perf_counter() - t0
            self.counters["written_blocks"] += len(items)
            self.counters["bytes_written"] += sum(len(v) for _, v in items)
            self._queue.task_done()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until queued writes reached the store (tests, prompt pinning, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._saved.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        out = {f"kvstore_{k}": v for k, v in self.counters.items()}
        out.update({f"kvstore_backend_{k}": v for k, v in self.store.stats().items()})
        return out

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self.store.close()
