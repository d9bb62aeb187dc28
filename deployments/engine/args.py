"""vLLM's side of an engine replica's configuration: its environment, its
``AsyncEngineArgs``, the platform checks before and after it starts, and the
``SamplingParams`` of a request. vLLM is imported inside the functions only.
"""

from __future__ import annotations

from typing import Any

from cluster import platform, tracing
from cluster.config import EngineConfig
from cluster.platform import Backend
from deployments.engine import kv_events
from deployments.protocol import Sampling


def engine_env(config: EngineConfig) -> dict[str, str]:
    """Environment the engine's processes need (set before vLLM spawns them)."""
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": config.cpu_omp_threads_bind,
        # KV events carry the full block digests the router computes.
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",
    }
    if config.omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = str(config.omp_num_threads)
    if config.attention_backend in CPU_BACKENDS:
        # torch backs its large host allocations (the paged KV cache, weights)
        # with transparent huge pages: a page loaded from the store writes one
        # block of each layer, scattered through the cache, and with 4 KiB pages
        # each costs TLB misses (loads: 0.76x -> 0.83x memcpy on CPU_MLA's pages,
        # tests/perf/page_copy.py). Only where the kernel allows it on request
        # (transparent_hugepage "madvise" or "always").
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    if config.executor == "uni" and config.attention_backend in CPU_BACKENDS:
        # vLLM's CPU platform turns a uni executor into mp unless this is off
        # (AsyncLLM runs its engine core in a process of its own either way).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


CPU_BACKENDS = (Backend.AMX_MLA.value, Backend.CPU_MLA.value)


WORKER_EXTENSION = "deployments.engine.expert_load.ExpertLoadExtension"
# engine.realtime_batch_mates, engine.background_cpu_yield,
# engine.background_prefill_tokens: vLLM's scheduler with the guard, and its
# settings.
GUARDED_SCHEDULER = "deployments.engine.scheduler.guarded_scheduler"
BATCH_MATES_KEY = "moe_cluster_realtime_batch_mates"
CPU_YIELD_KEY = "moe_cluster_background_cpu_yield"
PREFILL_CAP_KEY = "moe_cluster_background_prefill_tokens"


def engine_args(
    model_path: str,
    served_name: str,
    config: EngineConfig,
    kv_events_endpoint: str | None = None,
    kv_store_socket: str | None = None,
    parallel: dict[str, Any] | None = None,
    *,
    kv_staging_bytes: int | None = None,
    gpu_memory_bytes: int | None = None,
) -> Any:
    """vLLM's arguments; ``parallel`` adds the EP group rank's data-parallel and
    expert-parallel ones (``ep_group``). An engine on the node's page store with
    its cache on a GPU of ``gpu_memory_bytes`` gives the connector's staging
    buffers (``kv_staging_bytes`` each) their memory out of its KV cache."""
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    events = None
    if kv_events_endpoint is not None and config.enable_prefix_caching:
        events = kv_events.events_config(kv_events_endpoint)
    transfer = None
    utilization = config.gpu_memory_utilization
    if kv_store_socket is not None:
        from kvstore.connector import transfer_config
        from kvstore.page_layer import DeviceCopier

        staging = kv_staging_bytes or DeviceCopier.CHUNK_BYTES
        transfer = transfer_config(kv_store_socket, staging)
        if gpu_memory_bytes is not None and config.kv_cache_memory_bytes is None:
            utilization = utilization_beside(
                utilization, DeviceCopier.budget(staging), gpu_memory_bytes
            )

    backend = config.attention_backend
    guard: dict[str, Any] = {}
    if config.realtime_batch_mates is not None:
        guard[BATCH_MATES_KEY] = config.realtime_batch_mates
    if config.background_cpu_yield > 0:
        guard[CPU_YIELD_KEY] = config.background_cpu_yield
    if config.background_prefill_tokens is not None:
        guard[PREFILL_CAP_KEY] = config.background_prefill_tokens
    if guard:
        guard = {"scheduler_cls": GUARDED_SCHEDULER, "additional_config": guard}
    executor = {}
    if config.executor != "auto":
        executor["distributed_executor_backend"] = config.executor
    return AsyncEngineArgs(
        model=model_path,
        served_model_name=[served_name],
        attention_backend=None if backend == "auto" else backend,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        block_size=config.kv_block_size,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        kv_cache_dtype=config.kv_cache_dtype,
        quantization=config.quantization,
        # xgrammar alone (no fallback to another backend), one behaviour
        # whatever the schema: what it cannot enforce is refused.
        structured_outputs_config=StructuredOutputsConfig(
            backend="xgrammar",
            disable_any_whitespace=config.json_whitespace == "compact",
        ),
        gpu_memory_utilization=utilization,
        tensor_parallel_size=config.tensor_parallel_size,
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=config.enable_prefix_caching,
        scheduling_policy="priority",
        # Stats on: vLLM's Prometheus metrics (re-exported through Ray by the
        # engine's RayPrometheusStatLogger) are computed from them.
        disable_log_stats=False,
        # Set only when tracing is on: vLLM drops trace headers without it.
        otlp_traces_endpoint=tracing.traces_endpoint(),
        kv_events_config=events,
        kv_transfer_config=transfer,
        worker_extension_cls=WORKER_EXTENSION if config.measures_expert_load else "",
        # An EP rank's own (parallel) wins.
        **(guard | executor | (parallel or {})),
    )


def utilization_beside(utilization: float, reserved: int, device_bytes: int) -> float:
    """vLLM's ``gpu_memory_utilization`` that leaves ``reserved`` bytes of a
    device of ``device_bytes`` to what the KV connector allocates once vLLM has
    sized its cache (vLLM 0.32 builds its connector after profiling, so it does
    not count it): the cache is smaller by exactly that."""
    left = utilization - reserved / device_bytes
    if left <= 0:
        raise ValueError(
            f"engine.gpu_memory_utilization {utilization} leaves nothing once the "
            f"page store's staging buffers ({reserved / 2**20:.0f} MiB of the "
            f"device's {device_bytes / 2**30:.1f} GiB, 8 x kvstore.gpu_staging_mib) "
            "are reserved"
        )
    return left


def check_platform(config: EngineConfig) -> Backend:
    """The attention backend this process gets: the resolved one, checked again
    with vLLM's own AMX test here (``cluster.platform`` read the CPU of the machine
    that loaded the config, which may not be this engine's node). Fails at once,
    naming what to set, where this node refuses it."""
    if config.attention_backend not in CPU_BACKENDS:
        return Backend.GPU  # vLLM picks among its kernels
    import torch

    try:
        resolved = platform.resolve(
            config.attention_backend,
            config.dtype,
            config.kv_block_size,
            config.enable_prefix_caching,
            gpu=False,
            amx=torch.cpu._is_amx_tile_supported(),
        )
    except ValueError as e:
        raise RuntimeError(f"on this engine's node: {e}") from None
    return resolved.backend


def check_started(config: EngineConfig, vllm_config: Any) -> None:
    """The engine must use the block size the ingress hashes prompts with."""
    actual = vllm_config.cache_config.block_size
    if actual != config.kv_block_size:
        raise RuntimeError(
            f"vLLM chose KV blocks of {actual} tokens where the config says "
            f"{config.kv_block_size}: set engine.block_size: {actual}"
        )


def sampling_params(s: Sampling) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    if (c := s.structured) is not None:
        kwargs: dict[str, Any] = {
            "json": c.value,
            "regex": c.value,
            "grammar": c.value,
            "choice": list(c.choices),
            "json_object": True,
        }
        structured = StructuredOutputsParams(**{c.kind: kwargs[c.kind]})
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        ignore_eos=s.ignore_eos,
        structured_outputs=structured,
        logprobs=s.logprobs,
        output_kind=RequestOutputKind.DELTA,
        detokenize=True,
    )
