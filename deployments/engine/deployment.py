"""One engine replica: a vLLM ``AsyncLLM`` with priority scheduling.

``VLLMEngine`` owns the engine and speaks the ``protocol`` dataclasses;
``EngineDeployment`` is the thin Ray Serve shell around it. vLLM is imported here
and in no module the ingress loads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import ray
from ray import serve

from cluster import platform
from cluster.config import ClusterConfig, EngineConfig
from cluster.platform import Backend, EnginePlatform
from cluster.qos import QoS
from deployments.engine import kv_events
from deployments.engine.expert_load import ExpertLoadWindow
from deployments.engine.reporter import Reporter
from deployments.engine.stream_batcher import DeltaBatcher
from deployments.ep import group as ep_group
from deployments.ep.group import GroupRank
from deployments.protocol import (
    EngineEvent,
    EngineRequest,
    EngineStats,
    Finish,
    Sampling,
    Started,
)
from router.types import ExpertLoad, RequestProgress

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("moe_cluster.engine")


def engine_env(config: EngineConfig) -> dict[str, str]:
    """Environment the engine's processes need (set before vLLM spawns them)."""
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": config.cpu_omp_threads_bind,
        # KV events carry the full block digests the router computes.
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",
    }
    if config.omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = str(config.omp_num_threads)
    return env


WORKER_EXTENSION = "deployments.engine.expert_load.ExpertLoadExtension"


def engine_args(
    model_path: str,
    served_name: str,
    config: EngineConfig,
    kv_events_endpoint: str | None = None,
    kv_store_socket: str | None = None,
    parallel: dict[str, Any] | None = None,
) -> Any:
    """vLLM's arguments; ``parallel`` adds the EP group rank's data-parallel and
    expert-parallel ones (``ep_group``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    events = None
    if kv_events_endpoint is not None and config.enable_prefix_caching:
        events = kv_events.events_config(kv_events_endpoint)
    transfer = None
    if kv_store_socket is not None:
        from kvstore.connector import transfer_config

        transfer = transfer_config(kv_store_socket)

    backend = config.attention_backend
    return AsyncEngineArgs(
        model=model_path,
        served_model_name=[served_name],
        attention_backend=None if backend == "auto" else backend,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        block_size=config.kv_block_size,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        tensor_parallel_size=config.tensor_parallel_size,
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=config.enable_prefix_caching,
        scheduling_policy="priority",
        disable_log_stats=True,
        kv_events_config=events,
        kv_transfer_config=transfer,
        worker_extension_cls=WORKER_EXTENSION if config.measures_expert_load else "",
        **(parallel or {}),
    )


def check_platform(config: EngineConfig) -> Backend:
    """The attention backend this process gets: the resolved one, checked again
    with vLLM's own AMX test here (``cluster.platform`` read the CPU of the machine
    that loaded the config, which may not be this engine's node). Fails at once,
    naming what to set, where this node refuses it."""
    if config.attention_backend not in (Backend.AMX_MLA, Backend.CPU_MLA):
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
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        ignore_eos=s.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        detokenize=True,
    )


@dataclass(slots=True)
class _Running:
    request: EngineRequest
    output_tokens: int = 0


class VLLMEngine:
    """Streams ``EngineEvent``s for ``EngineRequest``s from one ``AsyncLLM``.

    Invariant: every stream opens with ``Started`` and ends with exactly one
    ``Finish``, unless the engine fails (the stream raises); a stream whose
    consumer goes away (cancellation) aborts its engine request before returning.
    """

    def __init__(
        self,
        engine: AsyncLLM,
        replica_id: str,
        stream_interval_s: float = 0.0,
        background_stream_interval_s: float = 0.0,
    ) -> None:
        self._engine = engine
        self.replica_id = replica_id
        self._stream_interval_s = stream_interval_s
        self._background_interval_s = background_stream_interval_s
        self._running: dict[str, _Running] = {}
        self.tokens_generated = 0
        self.warmed = (0, 0)  # prefixes run before taking traffic, tokens loaded
        self.expert_load: ExpertLoadWindow | None = None
        self._started = 0  # requests (and warmup prefills) begun since has_work
        self.platform: EnginePlatform | None = None  # as vLLM runs it, once started

    @classmethod
    def start(
        cls,
        config: ClusterConfig,
        replica_id: str,
        kv_events_endpoint: str | None,
        kv_store_socket: str | None = None,
        group: GroupRank | None = None,
    ) -> VLLMEngine:
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.update(engine_env(config.engine))
        backend = check_platform(config.engine)
        parallel = None
        if group is not None:
            parallel = group.engine_kwargs() | ep_group.gpu_engine_kwargs(config)
        args = engine_args(
            config.model.path,
            config.model.served_name,
            config.engine,
            kv_events_endpoint,
            kv_store_socket,
            parallel,
        )
        engine = AsyncLLM.from_engine_args(args)
        try:
            check_started(config.engine, engine.vllm_config)
        except RuntimeError:
            engine.shutdown()
            raise
        started = cls(
            engine,
            replica_id,
            config.engine.stream_interval_ms / 1000,
            config.engine.background_stream_interval_ms / 1000,
        )
        cache = engine.vllm_config.cache_config
        started.platform = EnginePlatform(
            backend,
            str(engine.vllm_config.model_config.dtype).removeprefix("torch."),
            cache.block_size,
            bool(cache.enable_prefix_caching),
        )
        logger.info("engine %s: %s", replica_id, started.platform.describe())
        return started

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        from vllm.inputs import TokensPrompt

        rid = request.request_id
        running = self._running[rid] = _Running(request)
        self._started += 1
        completion = 0
        finished = False
        try:
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
            if request.tenant:  # tenants never share (or time) cached prefixes
                prompt["cache_salt"] = request.tenant
            outputs = self._engine.generate(
                prompt,
                sampling_params(request.sampling),
                rid,
                priority=int(request.qos),
            )
            yield Started(self.replica_id)
            batcher = DeltaBatcher(
                self._background_interval_s
                if request.qos == QoS.BACKGROUND
                else self._stream_interval_s
            )
            clock = asyncio.get_running_loop().time
            async for out in outputs:
                seq = out.outputs[0]
                completion += len(seq.token_ids)
                running.output_tokens = completion
                self.tokens_generated += len(seq.token_ids)
                delta = batcher.add(list(seq.token_ids), seq.text, clock())
                if delta is not None:
                    yield delta
                if out.finished:
                    finished = True
                    if (rest := batcher.flush(clock())) is not None:
                        yield rest
                    yield Finish(
                        reason=_finish_reason(seq.finish_reason),
                        prompt_tokens=len(request.prompt_token_ids),
                        completion_tokens=completion,
                        cached_tokens=out.num_cached_tokens or 0,
                        replica_id=self.replica_id,
                    )
        finally:
            self._running.pop(rid, None)
            if not finished:
                # Consumer cancelled or closed the stream: free the engine slot.
                await self._engine.abort(rid)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def prefill(
        self, tokens: list[int] | None = None, text: str = "", tenant: str = ""
    ) -> int:
        """Runs a prompt for one token so its pages are loaded (or computed and
        saved); returns how many of its tokens came from cache."""
        from vllm import SamplingParams
        from vllm.inputs import TextPrompt, TokensPrompt

        prompt: Any = (
            TokensPrompt(prompt_token_ids=tokens) if tokens else TextPrompt(prompt=text)
        )
        if tenant:
            prompt["cache_salt"] = tenant
        self._started += 1
        cached = 0
        async for out in self._engine.generate(
            prompt,
            SamplingParams(max_tokens=1),
            f"warmup-{uuid.uuid4().hex}",
            priority=int(QoS.BACKGROUND),
        ):
            if out.finished:
                cached = out.num_cached_tokens or 0
        return cached

    async def warm(
        self, prompts: list[tuple[list[int] | None, str, str]], timeout_s: float
    ) -> None:
        """Prefills (token ids or text, tenant) prompts before the replica takes
        traffic; ``warmed`` records how many ran and the tokens they loaded."""
        if not prompts:
            return
        t = time.monotonic()
        jobs = [self.prefill(ids, text, tenant) for ids, text, tenant in prompts]
        try:
            cached = await asyncio.wait_for(asyncio.gather(*jobs), timeout_s)
        except TimeoutError:
            logger.warning("warmup cut short after %.0f s", timeout_s)
            return
        self.warmed = (len(jobs), sum(cached))
        logger.info(
            "warmed %d prefixes (%d tokens from the page store) in %.2f s",
            len(jobs),
            sum(cached),
            time.monotonic() - t,
        )

    async def check_health(self) -> None:
        """Raises when the engine core is dead."""
        await self._engine.check_health()

    async def measure_expert_load(self, window_s: float) -> None:
        """Hooks the workers' MoE routers and keeps a rolling window of their
        counts (see ``expert_load``); returns once the hooks are in."""
        [(layers, experts), *_] = await self._engine.collective_rpc(
            "moe_expert_load_install"
        )
        if layers:
            self.expert_load = ExpertLoadWindow(tuple(layers), experts, window_s)

    async def poll_expert_load(self) -> None:
        """Adds the workers' counts since the last poll to the window."""
        if self.expert_load is None:
            return
        [counts, *_] = await self._engine.collective_rpc("moe_expert_load_take")
        self.expert_load.add(time.monotonic(), counts)

    def has_work(self) -> bool:
        """Whether a request has run since the last call (or still runs)."""
        started, self._started = self._started, 0
        return started > 0 or self._engine.get_num_unfinished_requests() > 0

    def expert_load_snapshot(self) -> ExpertLoad | None:
        if self.expert_load is None:
            return None
        return self.expert_load.snapshot(time.monotonic())

    def stats(self) -> EngineStats:
        stats = EngineStats(
            replica_id=self.replica_id,
            running=self._engine.get_num_unfinished_requests(),
            request_ids=tuple(sorted(self._running)),
            pid=os.getpid(),
            warmed_prefixes=self.warmed[0],
            warmed_cached_tokens=self.warmed[1],
        )
        if (p := self.platform) is None:
            return stats
        return replace(
            stats,
            attention_backend=p.backend.value,
            dtype=p.dtype,
            block_size=p.block_size,
            prefix_caching=p.prefix_caching,
        )

    def progress(self) -> tuple[RequestProgress, ...]:
        return tuple(
            RequestProgress(
                rid,
                len(r.request.prompt_token_ids),
                r.output_tokens,
                r.request.sampling.max_tokens,
                r.request.qos,
            )
            for rid, r in self._running.items()
        )

    def shutdown(self) -> None:
        self._engine.shutdown()


def _finish_reason(reason: str | None) -> Any:
    # vLLM says "stop" for EOS/stop strings, "length" for max_tokens, "abort".
    return reason if reason in ("stop", "length", "abort") else "stop"


@serve.deployment(name="Engine")
class EngineDeployment:
    """Ray Serve shell of one ``VLLMEngine``; Serve restarts it when unhealthy."""

    async def __init__(self, config: ClusterConfig) -> None:  # type: ignore[misc]
        context = serve.get_replica_context()
        replica_id = context.replica_id.unique_id
        self._group: GroupRank | None = None
        self._node_id = ray.get_runtime_context().get_node_id()
        gang = getattr(context, "gang_context", None)
        if config.expert_parallel.enabled:
            if gang is None:
                raise RuntimeError(
                    "expert_parallel.ranks > 1 needs the engine deployment gang-"
                    "scheduled (build it with deployments.app.build_app)"
                )
            self._group = await ep_group.join(
                gang, config.expert_parallel.master_timeout_s
            )
        router_on = config.router.enabled
        endpoint = listen = None
        if router_on:
            rank = self._group.rank if self._group else 0
            endpoint, listen = kv_events.rank_endpoints(replica_id, rank)
        self._kv_endpoint = endpoint
        self._tasks: list[asyncio.Task[None]] = []
        store, socket = None, None
        if config.kvstore.enabled:
            store, socket = await _node_store(config)
        self._engine = VLLMEngine.start(
            config, replica_id, endpoint, socket, self._group
        )
        loop = asyncio.get_running_loop()
        if config.engine.measures_expert_load:
            await self._engine.measure_expert_load(config.engine.expert_load_window_s)
            self._tasks.append(loop.create_task(self._poll_expert_load(config)))
        listener = kv_events.KVEventListener(listen)
        if store is not None:
            self._tasks.append(loop.create_task(_follow_store(config, store, listener)))
        if endpoint is not None:
            from router import actor

            g = self._group
            reporter = Reporter(
                replica_id,
                progress=self._engine.progress,
                tokens_generated=lambda: self._engine.tokens_generated,
                kv_events=listener.drain,
                expert_load=self._engine.expert_load_snapshot,
                group=(g.group_id, g.rank, g.size) if g else ("", 0, 1),
                connect=lambda: actor.get_or_create(
                    config.router, config.server.app_name, config.model.path
                ),
                interval_s=config.router.report_interval_s,
            )
            self._tasks += [
                loop.create_task(listener.run()),
                loop.create_task(reporter.run()),
            ]
        if config.kvstore.enabled:
            await self._warmup(config)
        logger.info("engine replica %s ready", replica_id)

    async def _poll_expert_load(self, config: ClusterConfig) -> None:
        # NOTE: a collective_rpc wakes vLLM's workers, whose message queue then
        # busy-polls for a second (shm_broadcast's busy_loop_s): polling an idle
        # engine every 0.5 s kept each worker at ~90% CPU. An idle engine routes
        # no tokens, so its workers are asked only while it has work, and once
        # more after it runs out (the last steps' counts).
        busy = False
        while True:
            await asyncio.sleep(config.router.report_interval_s)
            now_busy = self._engine.has_work()
            if not (busy or now_busy):
                continue
            busy = now_busy
            try:
                await self._engine.poll_expert_load()
            except Exception as e:  # a dead engine is the health check's business
                logger.debug("expert load poll failed: %r", e)

    async def _warmup(self, config: ClusterConfig) -> None:
        """Runs the configured warmup prompts and the cluster's hottest prefixes,
        so their pages are on this node and the engine has run, before traffic."""
        from kvstore import actor as kv_actor

        kv = config.kvstore
        prompts: list[tuple[list[int] | None, str, str]] = [
            (None, p.text, p.tenant) for p in kv.warmup_prompts
        ]
        if kv.warmup_hot_prefixes:
            d = kv_actor.directory(config.server.app_name)
            hot = await d.hottest.remote(kv.warmup_hot_prefixes)
            prompts += [(list(tokens), "", salt) for salt, tokens in hot]
        await self._engine.warm(prompts, kv.warmup_timeout_s)

    async def prefill(self, tokens: list[int], tenant: str = "") -> int:
        """Runs a prompt for one token (its pages are loaded or computed and
        saved); returns the tokens that came from cache."""
        return await self._engine.prefill(tokens, tenant=tenant)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            async for event in self._engine.generate(request):
                yield event
        except EngineDeadError:
            self._exit_soon()
            raise

    def _exit_soon(self) -> None:
        # A dead engine never recovers in-process. Exiting makes Serve route away
        # and start a replacement at once instead of at the next health check;
        # the short delay lets this request's error reach the caller first.
        logger.error("engine of replica %s is dead; exiting", self._engine.replica_id)
        asyncio.get_running_loop().call_later(0.5, os._exit, 1)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def stats(self) -> EngineStats:
        stats = replace(self._engine.stats(), node_id=self._node_id)
        if (g := self._group) is not None:
            stats = replace(stats, group=g.group_id, rank=g.rank, group_size=g.size)
        return stats

    async def check_health(self) -> None:
        await asyncio.wait_for(self._engine.check_health(), timeout=10)

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
        group = getattr(self, "_group", None)
        if group is not None:
            ep_group.leave(group)
        endpoint = getattr(self, "_kv_endpoint", None)
        if endpoint is not None:
            kv_events.remove_endpoint(endpoint)


async def _node_store(config: ClusterConfig) -> tuple[Any, str]:
    """This node's page store (started if it is not running) and its socket."""
    from kvstore import actor as kv_actor

    store = kv_actor.get_or_create_store(
        config.server.app_name,
        ray.get_runtime_context().get_node_id(),
        config.kvstore,
    )
    return store, await store.start.remote()


async def _follow_store(
    config: ClusterConfig, store: Any, listener: kv_events.KVEventListener
) -> None:
    """Feeds the node store's page changes to the router reports (a replica can
    serve from cache whatever its node's store holds), and starts a new store on
    the node if this one died: the engines' connectors re-attach to its arena."""
    from kvstore.block_hash import BlockHash
    from router.types import KVEvent

    incarnation, seq = "", -1
    while True:
        try:
            if store is None:
                store, _ = await _node_store(config)
            inc, changes = await store.changes.remote(incarnation, seq)
            if changes.full:
                listener.apply([KVEvent("cleared")], kv_events.STORE)
            events = []
            if changes.added:
                added = tuple(BlockHash(h) for h in changes.added)
                events.append(KVEvent("stored", added))
            if changes.removed:
                removed = tuple(BlockHash(h) for h in changes.removed)
                events.append(KVEvent("removed", removed))
            listener.apply(events, kv_events.STORE)
            incarnation, seq = inc, changes.seq
        except Exception as e:
            logger.warning("the node's page store failed (%s); starting another", e)
            store, incarnation, seq = None, "", -1
        await asyncio.sleep(config.router.report_interval_s)
