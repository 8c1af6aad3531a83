"""KV transfer between workers (disaggregated prefill / decode).

Prefill side: a finished prefill's KV blocks are held in the engine (hold_kv) and
registered here under a transfer id with a TTL; `PullKV` streams them as chunks and a
completed pull releases them; a transfer nobody pulls is released when its TTL ends.

Decode side: `pull_kv` fetches and verifies the chunks *before* the request is added
to the engine (network I/O never runs inside an engine step), and `PulledKVLoader`
(the scheduler's KVLoader hook) copies the staged tensor into the request's blocks at
admission, so those prompt tokens count as computed.

Wire layout: the concatenation of all chunks is a C-contiguous tensor
(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim) in the model dtype,
split along the block axis; each chunk carries a crc32 of its bytes. An 8-bit KV cache
(int8, fp8_e4m3) sends its blocks as stored, scales included: (num_layers, 2, num_blocks,
block bytes) (worker/model_runner.py KVCacheSpec), named by KVLayout.dtype.

Both workers must store the same KV dtype: a pull from a worker with another
`kv_cache_dtype` is refused (KVTransferError, the decode worker recomputes the prompt),
never converted: re-quantizing float KV would make the decode worker's cache differ from
what it computes itself, and dequantizing int8 KV into a float cache would hand it KV its
own prefill never produces.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import grpc
import torch

from kvmesh._proto import worker_pb2, worker_pb2_grpc
from kvmesh.engine.request import Request
from kvmesh.errors import KVTransferError

DEFAULT_CHUNK_BYTES = 1 << 20

# -- prefill side: held transfers -------------------------------------------------


@dataclass
class HeldTransfer:
    transfer_id: str  # also the engine request id the blocks are held under
    block_ids: list[int]
    num_tokens: int
    expires_at: float
    pulls_in_flight: int = 0


class TransferTable:
    """Transfers held on a prefill worker: pure bookkeeping, the server releases the
    engine blocks. A transfer being pulled never expires mid-pull."""

    def __init__(self, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"transfer TTL must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self._held: dict[str, HeldTransfer] = {}

    def __len__(self) -> int:
        return len(self._held)

    def add(self, transfer_id: str, block_ids: list[int], num_tokens: int) -> HeldTransfer:
        t = HeldTransfer(transfer_id, list(block_ids), num_tokens, time.monotonic() + self.ttl_s)
        self._held[transfer_id] = t
        return t

    def get(self, transfer_id: str) -> HeldTransfer | None:
        return self._held.get(transfer_id)

    def pop(self, transfer_id: str) -> HeldTransfer | None:
        return self._held.pop(transfer_id, None)

    def expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [t.transfer_id for t in self._held.values() if t.pulls_in_flight == 0 and t.expires_at <= now]


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor in C order (any dtype, bfloat16 included)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def make_layout(runner, num_blocks: int, num_tokens: int, fingerprint: str) -> worker_pb2.KVLayout:
    spec = runner.spec
    return worker_pb2.KVLayout(
        num_layers=spec.num_layers, block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, dtype=spec.kv_dtype_name, num_blocks=num_blocks,
        num_tokens=num_tokens, model_fingerprint=fingerprint,
    )


def blocks_per_chunk(runner, max_chunk_bytes: int) -> int:
    return max(1, (max_chunk_bytes or DEFAULT_CHUNK_BYTES) // runner.spec.bytes_per_block)


def check_layout(spec, layout: worker_pb2.KVLayout, fingerprint: str) -> None:
    """Raises KVTransferError unless KV of `layout` fits a cache of `spec` for `fingerprint`."""
    if layout.model_fingerprint != fingerprint:
        raise KVTransferError("source worker serves a different model (fingerprint mismatch)")
    if layout.dtype != spec.kv_dtype_name:
        raise KVTransferError(f"KV cache dtype mismatch: the source stores {layout.dtype} KV, this worker "
                              f"{spec.kv_dtype_name}; give prefill and decode workers the same --kv-cache-dtype")
    ours = (spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)
    theirs = (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if ours != theirs:
        raise KVTransferError(f"KV layout mismatch: ours {ours}, source {theirs}")


def make_chunk(kv: torch.Tensor, first_block: int, layout: worker_pb2.KVLayout | None) -> worker_pb2.KVChunk:
    """kv: (num_layers, 2, n, *block_shape) of blocks first_block.. (KVCacheSpec)."""
    data = tensor_to_bytes(kv)
    chunk = worker_pb2.KVChunk(first_block=first_block, num_blocks=kv.shape[2], data=data,
                               crc32=zlib.crc32(data))
    if layout is not None:
        chunk.layout.CopyFrom(layout)
    return chunk


# -- decode side: pull, verify, stage, load -----------------------------------------


@dataclass
class PulledKV:
    kv: torch.Tensor  # (num_layers, 2, num_blocks, *block_shape), as read_blocks gives it
    num_tokens: int
    num_bytes: int

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]


class KVAssembler:
    """Checks chunks as they arrive (layout, order, size, checksum) and builds the
    (num_layers, 2, num_blocks, *block_shape) tensor."""

    def __init__(self, runner, fingerprint: str):
        self.runner = runner
        self.fingerprint = fingerprint
        self.layout: worker_pb2.KVLayout | None = None
        self.num_bytes = 0
        self._pieces: list[torch.Tensor] = []
        self._next_block = 0

    def add(self, chunk: worker_pb2.KVChunk) -> None:
        if self.layout is None:
            if not chunk.HasField("layout"):
                raise KVTransferError("first KV chunk carries no layout")
            self._check_layout(chunk.layout)
            self.layout = chunk.layout
        if chunk.first_block != self._next_block:
            raise KVTransferError(f"KV chunk out of order: block {chunk.first_block}, expected {self._next_block}")
        if zlib.crc32(chunk.data) != chunk.crc32:
            raise KVTransferError(f"KV chunk at block {chunk.first_block} failed its crc32 check")
        spec = self.runner.spec
        if chunk.num_blocks < 1 or len(chunk.data) != chunk.num_blocks * spec.bytes_per_block:
            raise KVTransferError(f"KV chunk at block {chunk.first_block}: {len(chunk.data)} bytes "
                                  f"for {chunk.num_blocks} blocks")
        flat = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8).view(spec.wire_dtype)
        self._pieces.append(flat.view(spec.num_layers, 2, chunk.num_blocks, *spec.block_shape))
        self.num_bytes += len(chunk.data)
        self._next_block += chunk.num_blocks

    def _check_layout(self, layout: worker_pb2.KVLayout) -> None:
        check_layout(self.runner.spec, layout, self.fingerprint)

    def result(self) -> PulledKV:
        if self.layout is None:
            raise KVTransferError("the source sent no KV chunks")
        if self._next_block != self.layout.num_blocks:
            raise KVTransferError(f"got {self._next_block} of {self.layout.num_blocks} KV blocks")
        kv = self._pieces[0] if len(self._pieces) == 1 else torch.cat(self._pieces, dim=2)
        return PulledKV(kv, self.layout.num_tokens, self.num_bytes)


async def pull_kv(channel: grpc.aio.Channel, runner, transfer_id: str, fingerprint: str,
                  timeout: float | None, max_chunk_bytes: int = 0) -> PulledKV:
    """Fetch and verify the KV held under `transfer_id` on the worker behind `channel`.

    Raises grpc.aio.AioRpcError (source unreachable, transfer unknown or expired) or
    KVTransferError (corrupt or incompatible data); the caller then recomputes.
    """
    stub = worker_pb2_grpc.WorkerStub(channel)
    call = stub.PullKV(worker_pb2.PullKVRequest(transfer_id=transfer_id, model_fingerprint=fingerprint,
                                                max_chunk_bytes=max_chunk_bytes), timeout=timeout)
    asm = KVAssembler(runner, fingerprint)
    try:
        async for chunk in call:
            asm.add(chunk)
    finally:
        call.cancel()  # no-op once the stream completed; stops the source on our errors
    return asm.result()


@dataclass
class _Staged:
    kv: torch.Tensor
    num_tokens: int


class PulledKVLoader:
    """The scheduler's KVLoader for pulled KV: request id -> staged tensor.

    `lookup` / `load` run inside engine steps (the step thread); `stage` / `discard`
    run on the event loop before the request is added and after it ends. Dict
    operations are atomic under the GIL and a request's entry is never touched by both
    sides at once (staged before add, discarded after the stream ends).
    """

    def __init__(self, runner, block_size: int, inner=None):
        self.runner = runner
        self.block_size = block_size
        # The engine's own loader (e.g. the shared KV store connector) serves every
        # request that has no pulled KV.
        self.inner = inner
        self._staged: dict[str, _Staged] = {}
        self.loaded_tokens = 0

    def stage(self, request_id: str, pulled: PulledKV) -> None:
        self._staged[request_id] = _Staged(pulled.kv, pulled.num_tokens)

    def discard(self, request_id: str) -> None:
        self._staged.pop(request_id, None)

    def lookup(self, request: Request, num_local_tokens: int) -> int:
        staged = self._staged.get(request.request_id)
        if staged is None:
            return self.inner.lookup(request, num_local_tokens) if self.inner is not None else 0
        return max(staged.num_tokens - num_local_tokens, 0)

    def load(self, request: Request, block_ids: list[int], start: int, num_tokens: int) -> int:
        # Used once: after a preemption the request recomputes (its prefix is usually
        # still in the local prefix cache by then).
        staged = self._staged.pop(request.request_id, None)
        if staged is None:
            return self.inner.load(request, block_ids, start, num_tokens) if self.inner is not None else 0
        bs = self.block_size
        # `start` is a block boundary (the local prefix hit is whole blocks).
        first = start // bs
        last = min(-(-(start + num_tokens) // bs), staged.kv.shape[2])
        got = min(num_tokens, last * bs - start, staged.num_tokens - start)
        if got <= 0:
            return 0
        self.runner.write_blocks(block_ids[first:last], staged.kv[:, :, first:last])
        self.loaded_tokens += got
        return got
