"""The engine deployment: the Ray Serve shell around one ``VLLMEngine``.

``EngineServer`` joins the replica's EP group, opens its KV event endpoint,
attaches the node's page store, reports to the DeepSeekRouter and warms the engine
before traffic. When Serve stops it, it drains: the router (told by the ingresses)
sends it nothing new, and what still runs after ``deployment.drain_timeout_s`` is
handed off, to be resumed on another replica. The engine class and where the
replica runs are injected, so this logic is unit-tested with a scripted engine and
no cluster; ``EngineDeployment`` is the class Serve runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from cluster import gc_pauses, tracing
from cluster.config import ClusterConfig
from cluster.loops import every
from deployments.direct import DirectServer, Endpoint, ServeRequestMetrics
from deployments.engine import kv_events
from deployments.engine.reporter import Reporter
from deployments.engine.vllm_engine import VLLMEngine
from deployments.ep import group as ep_group
from deployments.ep.group import GroupRank
from deployments.protocol import (
    EngineEvent,
    EngineLost,
    EngineRequest,
    EngineStats,
    HandOff,
    Pin,
)

logger = logging.getLogger("moe_cluster.engine")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a replica runs: Serve's replica id, its Ray node, its gang (the EP
    group's scheduling context; ``None`` outside one) and the node's address."""

    replica_id: str
    node_id: str
    gang: Any = None
    host: str = "127.0.0.1"  # the node's address, for direct streams

    @staticmethod
    def of_this_replica() -> Placement:
        context = serve.get_replica_context()
        return Placement(
            context.replica_id.unique_id,
            ray.get_runtime_context().get_node_id(),
            getattr(context, "gang_context", None),
            ray.util.get_node_ip_address(),
        )


class EngineServer:
    """One engine replica; Serve restarts it when unhealthy."""

    engine_cls: type[VLLMEngine] = VLLMEngine

    async def __init__(
        self,
        config: ClusterConfig,
        *,
        engine_cls: type[VLLMEngine] | None = None,
        placement: Placement | None = None,
        exit_process: Callable[[int], object] = os._exit,
    ) -> None:
        tracing.install_log_context()
        where = placement or Placement.of_this_replica()
        replica_id = where.replica_id
        self._node_id = where.node_id
        self._exit_process = exit_process
        self._drain_timeout_s = config.deployment.drain_timeout_s
        self._drain_task: asyncio.Task[None] | None = None
        self._handing_off = False
        self._exit_timer: asyncio.TimerHandle | None = None  # the engine died
        self._group: GroupRank | None = None
        if config.expert_parallel.enabled:
            if where.gang is None:
                raise RuntimeError(
                    "expert_parallel.ranks > 1 needs the engine deployment gang-"
                    "scheduled (build it with deployments.app.build_app)"
                )
            self._group = await ep_group.join(
                where.gang, config.expert_parallel.master_timeout_s
            )
        endpoint = listen = None
        if config.router.enabled:
            rank = self._group.rank if self._group else 0
            endpoint, listen = kv_events.rank_endpoints(replica_id, rank)
        self._kv_endpoint = endpoint
        self._tasks: list[asyncio.Task[None]] = []
        self._reporter: Reporter | None = None
        store, socket = None, None
        if config.kvstore.enabled:
            store, socket = await _node_store(config)
        self._engine = (engine_cls or self.engine_cls).start(
            config, replica_id, endpoint, socket, self._group
        )
        self._engine.span_attributes |= _span_attributes(self._node_id, self._group)
        loop = asyncio.get_running_loop()
        if config.engine.measures_expert_load:
            await self._engine.measure_expert_load(config.engine.expert_load_window_s)
            self._tasks.append(loop.create_task(self._poll_expert_load(config)))
        self._tasks.append(loop.create_task(self._refresh_metrics(), name="metrics"))
        listener = kv_events.KVEventListener(listen)
        if store is not None:
            self._tasks.append(loop.create_task(_watch_store(config, store)))
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
                node_id=self._node_id,
                connect=lambda: actor.get_or_create(
                    config.router,
                    config.server.app_name,
                    config.model.path,
                    follow_stores=config.kvstore.enabled,
                ),
                interval_s=config.router.report_interval_s,
                # Three idle heartbeats before the router drops it for silence.
                heartbeat_s=config.router.replica_stale_s / 3,
                on_draining=self._draining,
            )
            self._reporter = reporter
            self._tasks += [
                loop.create_task(listener.run()),
                loop.create_task(reporter.run()),
            ]
        if config.kvstore.enabled:
            await self._warmup(config)
        self._direct: DirectServer | None = None
        if config.server.engine_transport == "direct":
            self._direct = await _direct_server(replica_id, self.generate, where.host)
        if self._reporter is not None:
            # Serve adds the replica to the handles' sets once this returns (and
            # a health check passes); the ingress waits for a replica it was told
            # of but does not know yet (deployments.engine.pinned_router).
            self._reporter.started()
        gc_pauses.settle(f"engine replica {replica_id}", freeze=False)  # Serve does
        logger.info("engine replica %s ready", replica_id)

    async def _refresh_metrics(self) -> None:
        from deployments.engine.stat_logger import REFRESH_S

        async def step() -> None:
            self._engine.refresh_metrics()

        await every(REFRESH_S, step, what="metrics refresh", logger=logger)

    async def _poll_expert_load(self, config: ClusterConfig) -> None:
        # NOTE: a collective_rpc wakes vLLM's workers, whose message queue then
        # busy-polls for a second (shm_broadcast's busy_loop_s): polling an idle
        # engine every 0.5 s kept each worker at ~90% CPU. An idle engine routes
        # no tokens, so its workers are asked only while it has work, and once
        # more after it runs out (the last steps' counts).
        busy = False

        async def step() -> None:
            nonlocal busy
            now_busy = self._engine.has_work()
            if busy or now_busy:
                busy = now_busy
                # A dead engine fails this: the health check's business.
                await self._engine.poll_expert_load()

        await every(
            config.router.report_interval_s,
            step,
            what="expert load poll",
            logger=logger,
        )

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

    def _draining(self, draining: bool) -> None:
        """The router says Serve is stopping this replica (or, rarely, kept it)."""
        if draining and self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        elif not draining and self._drain_task is not None and not self._handing_off:
            self._drain_task.cancel()
            self._drain_task = None
            logger.info("replica %s serves again", self._engine.replica_id)

    async def _drain(self) -> None:
        """Lets the streams run for the drain timeout, then hands off the rest (the
        ingress resumes each on another replica, its KV from the page store).
        Serve's own drain then finds no request left and shuts the engine down."""
        rid, engine = self._engine.replica_id, self._engine
        logger.info(
            "replica %s is stopping: %d streams have %.0f s to finish",
            rid,
            engine.running_requests(),
            self._drain_timeout_s,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_timeout_s
        while engine.running_requests() and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self._handing_off = True
        if handed := await engine.hand_off():
            logger.warning(
                "replica %s: drain timeout; handed off %d streams: %s",
                rid,
                len(handed),
                ", ".join(handed),
            )

    async def prefill(self, tokens: list[int], tenant: str = "") -> int:
        """Runs a prompt for one token (its pages are loaded or computed and
        saved); returns the tokens that came from cache."""
        return await self._engine.prefill(tokens, tenant=tenant)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._handing_off:  # a late arrival at a replica past its drain
            yield HandOff(self._engine.replica_id)
            return
        try:
            async for event in self._engine.generate(request):
                yield event
        except EngineDeadError:
            self._exit_soon()
            yield EngineLost(self._engine.replica_id)

    def _exit_soon(self) -> None:
        # A dead engine never recovers in-process. Exiting makes Serve route away
        # and start a replacement at once instead of at the next health check;
        # the short delay lets each stream's last event reach its caller first.
        if self._exit_timer is not None:  # another stream saw it first
            return
        logger.error("engine of replica %s is dead; exiting", self._engine.replica_id)
        loop = asyncio.get_running_loop()
        self._exit_timer = loop.call_later(EXIT_DELAY_S, self._exit_process, 1)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def direct_endpoint(self, pin: Pin | None = None) -> Endpoint | None:
        """Where this replica takes direct streams (``pin`` chose the replica; see
        ``Pin``); None with another transport."""
        return self._direct.endpoint if self._direct is not None else None

    async def stats(self, pin: Pin | None = None) -> EngineStats:
        """This replica's stats (``pin`` chose the replica; see ``Pin``)."""
        return self._engine.stats(self._node_id, self._group)

    async def check_health(self) -> None:
        await asyncio.wait_for(self._engine.check_health(), timeout=10)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler gets from this replica (deployment.autoscaling):
        the router's view of the load in its last answer to this replica's
        report (``router.autoscaling.LoadSignals``); nothing before the first."""
        return dict(self._reporter.load) if self._reporter is not None else {}

    def __del__(self) -> Awaitable[None] | None:
        """Serve calls this when it stops the replica, after the requests it
        counts have ended, and awaits what it returns. With direct streams
        (which Serve does not count) that is their drain first."""
        direct = getattr(self, "_direct", None)
        if direct is not None and _loop_running():
            self._direct = None
            return self._close_after(direct)
        self._close()
        return None

    async def _close_after(self, direct: DirectServer) -> None:
        """Lets the direct streams finish or hand off (``_drain``), then closes."""
        try:
            if direct.in_flight:
                self._draining(True)
                if self._drain_task is not None:
                    await asyncio.shield(self._drain_task)
            await direct.stop(DIRECT_GRACE_S)  # the hand-offs' last events
        finally:
            self._close()

    def _close(self) -> None:
        # Its loops first: a poll of an engine already shut down only logs noise.
        for task in getattr(self, "_tasks", ()):
            task.cancel()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
        group = getattr(self, "_group", None)
        if group is not None:
            ep_group.leave(group)
        endpoint = getattr(self, "_kv_endpoint", None)
        if endpoint is not None:
            kv_events.remove_endpoint(endpoint)


EngineDeployment = serve.deployment(name="Engine")(EngineServer)
EXIT_DELAY_S = 0.5
DRAIN_POLL_S = 0.1
DIRECT_GRACE_S = 2.0


async def _direct_server(
    replica_id: str,
    generate: Callable[[EngineRequest], AsyncIterator[EngineEvent]],
    host: str,
) -> DirectServer | None:
    """The replica's direct-stream server, started; None (its streams then go
    through Serve's handle) where it cannot listen."""
    server = DirectServer(replica_id, generate, host, ServeRequestMetrics())
    try:
        endpoint = await server.start()
    except Exception as e:
        logger.warning(
            "replica %s takes no direct streams (%r): they go through Serve",
            replica_id,
            e,
        )
        return None
    logger.info("replica %s: direct streams at %s", replica_id, endpoint.address)
    return server


def _loop_running() -> bool:
    """Whether this thread runs an event loop (Serve's call; not the collector's
    at the process's exit, where there is nothing to wait for)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _span_attributes(node_id: str, group: GroupRank | None) -> dict[str, Any]:
    A = tracing.Attr
    attributes: dict[str, Any] = {A.NODE: node_id}
    if group is not None:
        attributes |= {A.EP_GROUP: group.group_id, A.EP_RANK: group.rank}
        attributes[A.EP_SIZE] = group.size
    return attributes


async def _node_store(config: ClusterConfig) -> tuple[Any, str]:
    """This node's page store (started if it is not running) and its socket."""
    from kvstore import actor as kv_actor

    store = kv_actor.get_or_create_store(
        config.server.app_name,
        ray.get_runtime_context().get_node_id(),
        config.kvstore,
    )
    return store, await store.start.remote()


async def _watch_store(config: ClusterConfig, store: Any) -> None:
    """Starts a new store on the node when this one died: the engines' connectors
    re-attach to its arena. (What the store holds reaches the router through the
    kvstore directory, not through this replica.) One call that only the store's
    death answers watches it, not a poll: an idle node's processes stay asleep."""

    async def step() -> None:
        nonlocal store
        try:
            if store is None:
                store, _ = await _node_store(config)
            await store.until_gone.remote()
        except Exception:
            store = None  # start another next time
            raise

    await every(
        config.router.report_interval_s,
        step,
        what="the node's page store (starting another)",
        logger=logger,
    )
