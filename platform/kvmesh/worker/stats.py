"""A worker's counters since start and its Stats reply (what the router polls: load,
free KV blocks, cached block hashes, transfer and cache-source counters, speculation,
the LoRA adapters it holds)."""

from __future__ import annotations

from kvmesh._proto import worker_pb2
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.lora import LoRAInfo
from kvmesh.engine.outputs import RequestOutput


def lora_info_proto(info: LoRAInfo) -> worker_pb2.LoRAInfo:
    return worker_pb2.LoRAInfo(name=info.name, path=info.path, rank=info.rank, key=info.key,
                               resident=info.resident, num_requests=info.num_requests)


def fill_lora_stats(resp: worker_pb2.StatsResponse, eng: LLMEngine) -> None:
    """LoRA: whether this worker serves adapters, its device slots, and the adapters it holds
    in host memory (the router's adapter table and lora_affinity scorer read them)."""
    lora = eng.config.lora
    if lora is None or not eng.lora_enabled:
        return
    resp.lora_enabled, resp.max_loras, resp.max_lora_rank = True, lora.max_loras, lora.max_lora_rank
    resp.loras.extend(lora_info_proto(i) for i in eng.list_loras() if i.loaded)


class WorkerCounters:
    """Per-worker counters since start, exported in Stats."""

    def __init__(self) -> None:
        self.requests = self.prompt_tokens = self.cached_prompt_tokens = 0
        self.kv_sent_blocks = self.kv_sent_bytes = 0
        self.kv_received_blocks = self.kv_received_bytes = 0
        self.kv_pull_failures = self.transfers_expired = 0
        self.cached_local = self.cached_store = self.cached_transfer = 0

    def count_finished(self, out: RequestOutput, sources: tuple[int, int, int]) -> None:
        self.requests += 1
        self.prompt_tokens += len(out.prompt_token_ids)
        self.cached_prompt_tokens += out.num_cached_tokens
        local, store, transfer = sources
        self.cached_local += local
        self.cached_store += store
        self.cached_transfer += transfer


def stats_response(eng: LLMEngine, role: str, address: str, model_id: str, c: WorkerCounters,
                   num_held_transfers: int, kv_loaded_tokens: int, max_block_hashes: int = 0
                   ) -> worker_pb2.StatsResponse:
    """A worker's StatsResponse from its engine and counters (call between engine steps)."""
    stats, hashes = eng.stats(), eng.kv_manager.pool.cached_block_hashes(max_block_hashes)
    spec = eng.config.speculative
    resp = worker_pb2.StatsResponse(
        role=role, address=address, model_id=model_id,
        model_fingerprint=eng.fingerprint, block_size=eng.config.cache.block_size,
        max_model_len=eng.max_model_len, num_waiting=int(stats["num_waiting"]),
        num_running=int(stats["num_running"]), num_free_blocks=int(stats["num_free_blocks"]),
        num_usable_blocks=int(stats["num_usable_blocks"]), num_held_transfers=num_held_transfers,
        requests_total=c.requests, prompt_tokens_total=c.prompt_tokens,
        cached_prompt_tokens_total=c.cached_prompt_tokens,
        kv_sent_blocks=c.kv_sent_blocks, kv_sent_bytes=c.kv_sent_bytes,
        kv_received_blocks=c.kv_received_blocks, kv_received_bytes=c.kv_received_bytes,
        kv_loaded_tokens=kv_loaded_tokens, kv_pull_failures=c.kv_pull_failures,
        transfers_expired=c.transfers_expired, cached_block_hashes=hashes,
        num_preemptions=int(stats["num_preemptions"]), cached_prompt_tokens_local=c.cached_local,
        cached_prompt_tokens_store=c.cached_store, cached_prompt_tokens_transfer=c.cached_transfer,
        kv_store_bytes_read=int(stats.get("kvstore_bytes_read", 0)),
        kv_store_bytes_written=int(stats.get("kvstore_bytes_written", 0)),
        spec_method=str(stats.get("spec_method", "")),
        num_speculative_tokens=spec.num_speculative_tokens if spec is not None and "spec_method" in stats else 0,
        spec_proposed_tokens=int(stats.get("spec_proposed_tokens", 0)),
        spec_accepted_tokens=int(stats.get("spec_accepted_tokens", 0)),
    )
    fill_lora_stats(resp, eng)
    return resp
