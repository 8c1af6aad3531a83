"""The composition root: the only place that loads models, sizes the KV cache and wires
executors, proposers, KV store connectors and P/D loaders into engines and workers.

Everything below is built by constructor arguments; nothing is rewired afterwards.

    build_engine(config)                      -> LLMEngine (offline, `kvmesh generate`)
    build_async_engine(config)                -> AsyncLLMEngine
    build_worker(config, WorkerServerConfig)  -> WorkerServer (gRPC worker, not started)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from kvmesh.checkpoint.files import load_tokenizer, model_fingerprint, resolve_model_path
from kvmesh.config import EngineConfig, SpeculativeConfig
from kvmesh.engine.async_engine import AsyncLLMEngine, StepThread
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.interfaces import ModelInfo
from kvmesh.engine.kv_cache_manager import blocks_per_request
from kvmesh.engine.outputs import RequestOutput
from kvmesh.errors import ConfigError, InvalidRequestError
from kvmesh.kvstore import BlockCodec, create_store
from kvmesh.kvstore.codec import load_mac_key
from kvmesh.layers import kv_cache as kvq
from kvmesh.layers import native
from kvmesh.models.arch import ArchConfig
from kvmesh.layers.op import PipelineStage
from kvmesh.models.llama import check_tensor_parallel, local_kv_heads
from kvmesh.models.loader import build_meta_model, load_arch_config
from kvmesh.quant.loader import load_model, quantization_id
from kvmesh.rpc.internal_auth import InternalAuth
from kvmesh.telemetry.workers import CacheSourceTracker
from kvmesh.worker.executor import Executor, Proposer
from kvmesh.worker.gpu_kv_transfer import GpuTransport, build_gpu_kv
from kvmesh.worker.kv_connector import StoreConnector
from kvmesh.worker.kv_transfer import PulledKVLoader
from kvmesh.worker.lora import LoRAManager
from kvmesh.worker.model_runner import DTYPES, KVCacheSpec, ModelRunner
from kvmesh.worker.groups import ParallelGroups, attach_shm
from kvmesh.worker.parallel import COLLECTIVE_TIMEOUT_S, START_TIMEOUT_S, ParallelLoRA, ParallelRunner, start_group
from kvmesh.worker.pipeline import PipelineForward
from kvmesh.worker.rank_process import RankLauncher
from kvmesh.worker.server import WorkerServer, WorkerServerConfig
from kvmesh.worker.spec_decode import DraftModelProposer, NgramProposer
from kvmesh.worker.structured import GrammarCompiler, GrammarMasks

logger = logging.getLogger(__name__)

_GPU_STAGING_MAX_BYTES = 512 << 20  # taken after the KV cache, out of its headroom


@dataclass
class EngineParts:
    """What `build_parts` made: the pieces an engine (or a worker) is wired from."""

    config: EngineConfig
    tokenizer: object
    info: ModelInfo
    arch: ArchConfig
    executor: Executor
    connector: StoreConnector | None


def build_parts(config: EngineConfig | None = None, progress: bool = True,
                rank_launcher: RankLauncher | None = None) -> EngineParts:
    """Load the model and tokenizer, size the KV cache, build runner, proposer and the
    shared-store connector. With tensor_parallel_size x pipeline_parallel_size > 1 the runner
    is a ParallelRunner: ranks 1..world-1 are started by `rank_launcher` (default: this
    process's children; kvmesh.serve.rank_actors: Ray actors) and load their shards while
    this process loads rank 0's."""
    config = config or EngineConfig()
    mc, cc = config.model, config.cache
    device = torch.device(mc.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device: CUDA requested but torch sees no GPU; use --device cpu")
    path = resolve_model_path(mc.model, progress=progress)
    tokenizer = load_tokenizer(path if mc.tokenizer is None else resolve_model_path(mc.tokenizer))
    dtype_name = resolve_dtype(mc.dtype, device)
    dtype = DTYPES[dtype_name]
    arch = load_arch_config(path)
    tp, pp = _check_parallel(config, arch, device, path)
    world = tp * pp
    threads = config.num_threads or torch.get_num_threads()
    if config.num_threads or world > 1:
        torch.set_num_threads(max(1, threads // world))  # the ranks share this machine's cores
    limit = arch.max_position_embeddings
    if mc.max_model_len is not None and mc.max_model_len > arch.max_position_embeddings:
        raise ConfigError(
            f"model.max_model_len: {mc.max_model_len} exceeds the model's "
            f"max_position_embeddings ({arch.max_position_embeddings})"
        )
    max_model_len = mc.max_model_len or limit
    max_positions = max_model_len + 1
    kv_quant = kvq.resolve(cc.kv_cache_dtype, device)  # None: K/V in the model's dtype
    # Each rank's cache holds its share of the KV heads (tensor parallel) or of the layers
    # (pipeline parallel: sized for the largest stage); the budget (num_blocks, kv_cache_memory_gb) is per rank.
    stage_layers = max(len(PipelineStage(r, pp).layer_range(arch.num_layers)) for r in range(pp))
    spec = KVCacheSpec(stage_layers, cc.block_size, local_kv_heads(arch, tp), arch.head_dim, dtype, kv_quant)
    num_blocks = cc.num_blocks or _auto_num_blocks(config, spec, device)
    capacity = (num_blocks - 1) * cc.block_size
    # Every layer sliding: a request holds about a window of blocks, however long (the engine
    # frees the rest; not with a draft model, whose cache shares the target's blocks).
    kv_window = arch.kv_window if config.speculative is None or config.speculative.method == "ngram" else None
    need = blocks_per_request(max_model_len, cc.block_size, kv_window, config.scheduler.max_num_batched_tokens)
    if need > num_blocks - 1:
        if mc.max_model_len is not None:
            raise ConfigError(
                f"cache: {num_blocks} blocks of {cc.block_size} tokens hold {capacity} tokens, "
                f"less than one request of max_model_len={max_model_len} needs ({need} blocks); raise "
                "cache.num_blocks / kv_cache_memory_gb or lower max_model_len"
            )
        max_model_len = capacity
    fingerprint = model_fingerprint(
        path, {"dtype": dtype_name, "block_size": cc.block_size,
               "quantization": quantization_id(path, mc.quantization, mc.quantization_group_size)}
    )
    eos_ids = _eos_token_ids(path, tokenizer, arch)
    # Structured outputs: grammars over this tokenizer, EOS as their stop tokens (worker/structured.py).
    grammar = GrammarMasks(GrammarCompiler(tokenizer, arch.vocab_size, eos_ids))
    load = partial(_load_runner, config, path, max_positions, max_model_len, num_blocks)
    if world > 1:
        runner = _start_group(tp, pp, max(1, threads // world), load, grammar, rank_launcher)
        if runner.lora is not None:  # every rank holds the start-up adapters (each its cut)
            _add_lora_modules(runner.lora, config)
    else:
        runner = load(None, grammar)
    model = runner.model
    proposer = None
    if config.speculative is not None:
        proposer = _build_proposer(config, config.speculative, path, model if world == 1 else None, arch,
                                   max_model_len, num_blocks)
    connector = None
    if config.kv_store:
        # KVMESH_KV_HMAC_KEY set: blocks in the shared store are authenticated (kvstore/codec.py).
        # (an 8-bit cache's blocks are stored as such, scales included, under keys of their own;
        # a tensor-parallel group's blocks hold every KV head, as TP=1's: see worker/parallel.py)
        codec = BlockCodec(fingerprint, runner.spec.kv_dtype_name, cc.block_size, arch.num_layers, arch.num_kv_heads,
                           arch.head_dim, mac_key=load_mac_key())
        connector = StoreConnector(create_store(config.kv_store), codec, runner, config.kv_store_ttl_s)
    info = ModelInfo(path=str(path), fingerprint=fingerprint, vocab_size=arch.vocab_size,
                     max_model_len=max_model_len, eos_token_id=_eos_token_id(tokenizer, arch),
                     eos_token_ids=eos_ids, kv_window=arch.kv_window)
    logger.info("kvmesh engine: %s, %d KV blocks x %d tokens (%s), max_model_len %d, tensor parallel %d, "
                "pipeline parallel %d", path, num_blocks, cc.block_size, spec.kv_dtype_name, max_model_len, tp, pp)
    return EngineParts(config, tokenizer, info, arch, Executor(runner, proposer), connector)


def _load_runner(config: EngineConfig, path: Path, max_positions: int, max_model_len: int, num_blocks: int,
                 groups: ParallelGroups | None, grammar: GrammarMasks | None = None) -> ModelRunner:
    """Load the model (this rank's shard of it: its slice of its stage's layers, for a rank
    of parallel `groups`) and build its runner: the same on every rank of a stage, so their
    layers and collectives match. Ranks other than 0 get no grammar (they do not sample).
    With LoRA on, every rank gets an adapter store; one rank reads `--lora-modules` now, a
    parallel group's are added through rank 0 once every rank is up (build_parts)."""
    mc, cc = config.model, config.cache
    device = torch.device(mc.device)
    dtype = DTYPES[resolve_dtype(mc.dtype, device)]
    tp = groups.tp if groups is not None and groups.tp.size > 1 else None
    pp = groups.stage if groups is not None else None
    if tp is not None and config.parallel.shm_all_reduce and device.type == "cpu":
        # (every rank of the group comes here with the same config: a collective)
        tp = attach_shm(tp, config.kernels.cpu_kernels and native.load(config.kernels.native_isa),
                        COLLECTIVE_TIMEOUT_S)
    model, arch = load_model(path, dtype, device, max_positions, mc.quantization, mc.quantization_group_size,
                             config.kernels, tp, pp)
    graph_batch = min(config.cuda_graph_max_batch_size, config.scheduler.max_num_seqs) if config.cuda_graphs else 0
    return ModelRunner(model, arch, cc.block_size, num_blocks, device, seed=mc.seed,
                       attention_backend=config.attention_backend, cuda_graph_max_batch=graph_batch,
                       max_model_len=max_model_len, kernels=config.kernels, grammar=grammar,
                       lora=_build_lora(config, model, arch, max_positions, device, dtype, groups),
                       kv_quant=kvq.resolve(cc.kv_cache_dtype, device),
                       num_kv_heads=local_kv_heads(arch, tp.size if tp else 1),
                       driver=groups is None or groups.rank == 0,
                       pipeline=PipelineForward(groups.pp, arch.hidden_size, dtype, device) if pp else None,
                       num_layers=len(pp.layer_range(arch.num_layers)) if pp else None,
                       kv_populate=cc.kv_cache_populate)


def _start_group(tp: int, pp: int, threads: int, load: Callable[..., ModelRunner],
                 grammar: GrammarMasks, launcher: RankLauncher | None = None) -> ParallelRunner:
    """Start ranks 1..tp*pp-1 (each runs `load` with its groups), load rank 0 here
    meanwhile, and wrap them as one runner. A failure on any rank stops them all."""
    groups, ranks, store = start_group(tp, pp, threads, load, launcher=launcher)
    try:
        local = load(groups, grammar)
        ranks.wait_ready(START_TIMEOUT_S)
    except BaseException:
        ranks.close()
        raise
    return ParallelRunner(local, ranks, groups, store)


def _check_parallel(config: EngineConfig, arch: ArchConfig, device: torch.device, path: Path) -> tuple[int, int]:
    """The (tensor, pipeline) parallel sizes, after refusing what this build cannot split (ConfigError)."""
    pc = config.parallel
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    if tp == 1 and pp == 1:
        return 1, 1
    what = "tensor_parallel_size" if pp == 1 else "pipeline_parallel_size" if tp == 1 else \
        "tensor_parallel_size / pipeline_parallel_size"
    if device.type != "cpu" or pc.distributed_backend == "nccl":
        raise ConfigError(f"parallel.{what}: tensor / pipeline parallelism runs on CPU over gloo in this build; "
                          f"use --device cpu (distributed_backend auto / gloo) or {what}=1")
    if tp > 1:
        try:
            check_tensor_parallel(arch, tp)
        except ValueError as exc:
            raise ConfigError(f"parallel.tensor_parallel_size: {exc}") from None
    if pp > arch.num_layers:
        raise ConfigError(f"parallel.pipeline_parallel_size: {pp} stages for {arch.num_layers} layers; "
                          f"use at most {arch.num_layers}")
    if config.cuda_graphs and device.type == "cuda":
        raise ConfigError(f"cuda_graphs: not with {what} > 1 in this build")
    return tp, pp


def build_engine(config: EngineConfig | None = None, progress: bool = True,
                 rank_launcher: RankLauncher | None = None, **kwargs) -> LLMEngine:
    """An LLMEngine for `config` (or flat EngineConfig keyword arguments), prompt cache warmed."""
    parts = build_parts(_config(config, kwargs), progress, rank_launcher)
    return _warm(LLMEngine(parts.config, parts.executor, parts.tokenizer, parts.info,
                           kv_connector=parts.connector))


def build_async_engine(config: EngineConfig | None = None, progress: bool = True, **kwargs) -> AsyncLLMEngine:
    """An AsyncLLMEngine whose model was loaded on its step thread (see async_engine)."""
    step_thread = StepThread()
    return AsyncLLMEngine(step_thread.call(lambda: build_engine(config, progress, **kwargs)), step_thread=step_thread)


def build_worker(config: EngineConfig | None, server_config: WorkerServerConfig | None = None,
                 progress: bool = False, auth: InternalAuth | None = None,
                 gpu_transports: list[GpuTransport] | None = None, gpu_node: str | None = None,
                 on_outputs: Callable[[list[RequestOutput]], None] | None = None,
                 rank_launcher: RankLauncher | None = None) -> WorkerServer:
    """A gRPC worker (not started; call it on the event loop that will run it). Its
    engine's KV loader is a chain: KV pulled from a
    prefill worker if staged for the request, else the shared store; a tracker notes
    which source served each request (cache-source metrics).

    P/D KV moves device to device by the transports this machine has (CUDA IPC and NCCL
    through cupy on a CUDA device; none on CPU: bytes over gRPC); `gpu_transports` and
    `gpu_node` replace those transports and this machine's node id (tests, embedders);
    `on_outputs` observes every engine step's outputs (see AsyncLLMEngine); `rank_launcher`
    starts a parallel engine's ranks 1.. (see build_parts).

    The model is loaded on the engine's step thread, the thread every step runs on: one
    OpenMP team per process (see async_engine)."""
    def build():
        parts = build_parts(config, progress, rank_launcher)
        runner = parts.executor.runner
        gpu_source, gpu_sink = build_gpu_kv(runner, _staging_bytes(parts), gpu_transports, gpu_node)
        pulled = PulledKVLoader(parts.executor.runner, parts.config.cache.block_size, inner=parts.connector)
        sources = CacheSourceTracker(pulled)
        engine = _warm(LLMEngine(parts.config, parts.executor, parts.tokenizer, parts.info,
                                 kv_loader=sources, kv_connector=parts.connector))
        return engine, pulled, sources, gpu_source, gpu_sink

    step_thread = StepThread()
    engine, pulled, sources, gpu_source, gpu_sink = step_thread.call(build)
    return WorkerServer(AsyncLLMEngine(engine, on_outputs, step_thread), server_config or WorkerServerConfig(), pulled,
                        sources, auth, gpu_source, gpu_sink)


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """ModelConfig.dtype with "auto" resolved: bfloat16 on CUDA, float32 elsewhere (exact
    against transformers on CPU, where bf16 matmuls rarely pay)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def _staging_bytes(parts: EngineParts) -> int:
    """The device-to-device staging buffer: room for 4 full-length prompts in flight, at
    most _GPU_STAGING_MAX_BYTES; a pull that does not fit streams bytes instead."""
    spec, bs = parts.executor.runner.spec, parts.config.cache.block_size
    per_prompt = -(-parts.info.max_model_len // bs) * spec.bytes_per_block
    return min(4 * per_prompt, _GPU_STAGING_MAX_BYTES)


def _build_lora(config: EngineConfig, model, arch: ArchConfig, max_positions: int, device: torch.device,
                dtype: torch.dtype, groups: ParallelGroups | None) -> LoRAManager | None:
    """The adapter store of a multi-LoRA engine (None with LoRA off). One rank: with the
    `--lora-modules` read now. Rank 0 of a group checks adapters against the whole model,
    built on the meta device (its own holds a shard, or a stage)."""
    if config.lora is None:
        return None
    template = None
    if groups is not None and groups.rank == 0:
        template = build_meta_model(arch, max_positions, dtype, config.kernels)
    manager = LoRAManager(model, config.lora, device, dtype, template)
    if groups is None:
        _add_lora_modules(manager, config)
    return manager


def _add_lora_modules(host: LoRAManager | ParallelLoRA, config: EngineConfig) -> None:
    """Hold `--lora-modules` (as many as host memory holds): a bad folder fails the start-up, naming it."""
    for module in config.lora.modules[: host.capacity]:
        try:
            host.add(module.name, module.path, host.read(module.name, module.path))
        except InvalidRequestError as exc:
            raise ConfigError(f"lora.modules: adapter {module.name!r}: {exc.reason}") from None


def _config(config: EngineConfig | None, kwargs: dict) -> EngineConfig:
    if config is not None and kwargs:
        return config.with_overrides(**kwargs)
    return config if config is not None else EngineConfig.from_kwargs(**kwargs)


def _warm(engine: LLMEngine) -> LLMEngine:
    for entry in engine.config.prompt_cache:
        engine.cache_prompt(entry.name, entry.text if entry.text is not None else entry.token_ids, entry.ttl_s)
    return engine


def _build_proposer(config: EngineConfig, spec: SpeculativeConfig, path: Path, model, arch: ArchConfig,
                    max_model_len: int, num_blocks: int) -> Proposer:
    """The proposer; a draft model runs whole (unsharded) in this process, beside rank 0 of a
    tensor / pipeline parallel target (vLLM's draft tensor parallel size 1: a draft is small, and
    its steps are the latency a split would add collectives to). `model`: the target's
    whole model for a "self" draft to share, None when this process holds only a shard."""
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
    mc = config.model
    device = torch.device(mc.device)
    if spec.model == "self" and spec.quantization is None and model is not None:
        draft, draft_arch = model, arch  # shares weights; only the KV cache is separate
    else:
        # A quantized copy of the target ("self" + quantization) is a cheap, well
        # aligned draft; any other folder must share the target's tokenizer.
        draft_path = path if spec.model == "self" else resolve_model_path(spec.model)
        draft, draft_arch = load_model(draft_path, DTYPES[resolve_dtype(mc.dtype, device)], device,
                                       max_model_len + spec.num_speculative_tokens + 1,
                                       quantization=spec.quantization, kernels=config.kernels)
        if draft_arch.vocab_size != arch.vocab_size:
            raise ConfigError(
                f"speculative.model: draft vocab {draft_arch.vocab_size} != target vocab "
                f"{arch.vocab_size}; a draft must share the target's tokenizer")
    runner = ModelRunner(draft, draft_arch, config.cache.block_size, num_blocks, device,
                         seed=mc.seed + 1, attention_backend=config.attention_backend, kernels=config.kernels,
                         kv_quant=kvq.resolve(config.cache.kv_cache_dtype, device),
                         kv_populate=config.cache.kv_cache_populate)
    return DraftModelProposer(runner, spec.num_speculative_tokens)


def _auto_num_blocks(config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    # gpu_memory_utilization (vLLM's flag): of the free memory on CUDA, of the GiB budget on CPU.
    util = config.cache.gpu_memory_utilization
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * (util if util is not None else config.cache.kv_cache_memory_fraction))
    else:
        budget = int(config.cache.kv_cache_memory_gb * (util if util is not None else 1.0) * (1 << 30))
    return max(budget // spec.bytes_per_block, 2)


def _eos_token_ids(path: Path, tokenizer, arch: ArchConfig) -> tuple[int, ...]:
    """Every id that ends a generation: the tokenizer's eos, config.json's and
    generation_config.json's `eos_token_id` (an id or a list), as vLLM reads them."""
    ids = [_eos_token_id(tokenizer, arch), *arch.eos_token_ids]
    try:
        gen = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        gen = None
    ids += gen if isinstance(gen, list) else [gen]
    return tuple(dict.fromkeys(int(t) for t in ids if t is not None))


def _eos_token_id(tokenizer, arch: ArchConfig) -> int | None:
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return arch.eos_token_ids[0] if arch.eos_token_ids else None
