"""KV transfer pieces without processes: chunking, checksums, layout checks, TTLs."""

import pytest
import torch

from kvmesh.errors import KVTransferError
from kvmesh.worker.kv_transfer import KVAssembler, TransferTable, make_chunk
from kvmesh.worker.model_runner import KVCacheSpec


class FakeRunner:
    spec = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def _layout(runner, n):
    from kvmesh._proto import worker_pb2

    s = runner.spec
    return worker_pb2.KVLayout(num_layers=s.num_layers, block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                               head_dim=s.head_dim, dtype="bfloat16", num_blocks=n, num_tokens=4 * n - 1,
                               model_fingerprint="fp")


def test_chunks_reassemble_bit_exact_and_checksums_catch_corruption():
    kv = torch.randn(2, 2, 5, 4, 2, 8).to(torch.bfloat16)
    layout = _layout(FakeRunner, 5)
    chunks = [make_chunk(kv[:, :, i:i + 2], i, layout if i == 0 else None) for i in range(0, 5, 2)]
    asm = KVAssembler(FakeRunner, "fp")
    for c in chunks:
        asm.add(c)
    pulled = asm.result()
    assert torch.equal(pulled.kv, kv) and pulled.num_tokens == 19 and pulled.num_blocks == 5

    bad = KVAssembler(FakeRunner, "fp")
    bad.add(chunks[0])
    corrupt = type(chunks[1])()
    corrupt.CopyFrom(chunks[1])
    corrupt.data = bytes([corrupt.data[0] ^ 1]) + corrupt.data[1:]
    with pytest.raises(KVTransferError, match="crc32"):
        bad.add(corrupt)
    with pytest.raises(KVTransferError, match="out of order"):
        KVAssembler(FakeRunner, "fp").add(chunks[0]) or bad.add(chunks[2])
    with pytest.raises(KVTransferError, match="different model"):
        KVAssembler(FakeRunner, "other").add(chunks[0])
    short = KVAssembler(FakeRunner, "fp")
    short.add(chunks[0])
    with pytest.raises(KVTransferError, match="got 2 of 5"):
        short.result()


def test_transfer_table_expires_only_idle_transfers():
    t = TransferTable(ttl_s=10)
    a, b = t.add("a", [1, 2], 7), t.add("b", [3], 2)
    b.pulls_in_flight = 1
    assert t.expired(now=a.expires_at - 1) == []
    assert t.expired(now=a.expires_at + 1) == ["a"]  # b is being pulled
    assert t.pop("a") is a and t.pop("a") is None and len(t) == 1
    with pytest.raises(ValueError, match="TTL"):
        TransferTable(0)


def test_loader_serves_staged_kv_once_and_defers_the_rest_to_the_engines_loader():
    from kvmesh import SamplingParams
    from kvmesh.engine.request import Request
    from kvmesh.worker.kv_transfer import PulledKV, PulledKVLoader

    class Runner:
        def __init__(self):
            self.writes = []

        def write_blocks(self, ids, data):
            self.writes.append((list(ids), tuple(data.shape)))

    class Inner:
        def lookup(self, request, num_local):
            return 4

        def load(self, request, block_ids, start, num_tokens):
            return 4

    runner = Runner()
    loader = PulledKVLoader(runner, block_size=4, inner=Inner())
    staged, other = Request("s", list(range(11)), SamplingParams()), Request("o", list(range(11)), SamplingParams())
    loader.stage("s", PulledKV(torch.zeros(2, 2, 3, 4, 2, 8), num_tokens=10, num_bytes=0))
    assert loader.lookup(staged, 4) == 6 and loader.lookup(other, 0) == 4
    # Local prefix hit of 1 block: load tokens 4..9 into blocks 1..2 (the last one partial).
    assert loader.load(staged, [7, 8, 9], 4, 6) == 6
    assert runner.writes == [([8, 9], (2, 2, 2, 4, 2, 8))]
    assert loader.load(staged, [7, 8, 9], 4, 6) == 4  # used up: the inner loader answers
    assert loader.loaded_tokens == 6
