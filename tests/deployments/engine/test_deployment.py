"""The engine deployment's own logic, on a scripted engine and no cluster."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest

from cluster.config import ClusterConfig
from deployments.engine.deployment import EXIT_DELAY_S, EngineServer, Placement
from deployments.engine.vllm_engine import VLLMEngine
from deployments.protocol import (
    EngineLost,
    EngineRequest,
    Finish,
    HandOff,
    Sampling,
    Started,
)
from tests.deployments.engine.fakes import FakeAsyncLLM, Step

HERE = Placement("replica-a", "node-1")


def config(**sections: Any) -> ClusterConfig:
    # Serve's transport: no direct-stream server (tests/deployments/test_direct.py).
    base: dict[str, Any] = {
        "router": {"enabled": False},
        "kvstore": {"enabled": False},
        "server": {"engine_transport": "grpc"},
    }
    return ClusterConfig.model_validate(base | sections)


class ScriptedEngine(VLLMEngine):
    """``VLLMEngine`` on a ``FakeAsyncLLM``; ``started`` records each start."""

    llm = FakeAsyncLLM()
    started: ClassVar[list[tuple[Any, ...]]] = []

    @classmethod
    def start(cls, config: Any, replica_id: str, *args: Any) -> VLLMEngine:
        cls.started.append((replica_id, *args))
        return cls(cls.llm, replica_id)  # type: ignore[arg-type]


async def start(cfg: ClusterConfig, llm: FakeAsyncLLM, **kw: Any) -> EngineServer:
    ScriptedEngine.llm, ScriptedEngine.started = llm, []
    server = EngineServer.__new__(EngineServer)  # as Serve builds it
    await server.__init__(cfg, engine_cls=ScriptedEngine, placement=HERE, **kw)  # type: ignore[misc]
    return server


async def stop(server: EngineServer) -> None:
    """As Serve stops a replica: ``__del__``, awaiting what it returns."""
    closing = server.__del__()  # type: ignore[func-returns-value]
    if closing is not None:
        await closing


async def test_without_router_or_store_the_engine_starts_alone() -> None:
    llm = FakeAsyncLLM()
    server = await start(config(), llm)
    # No KV event endpoint, no page store socket, no EP group: nothing runs
    # beside the engine but the refresh of its metrics.
    assert ScriptedEngine.started == [("replica-a", None, None, None)]
    assert [t.get_name() for t in server._tasks] == ["metrics"]
    stats = await server.stats()
    assert (stats.replica_id, stats.node_id, stats.group) == ("replica-a", "node-1", "")
    await stop(server)
    assert llm.shut_down


async def test_expert_load_is_installed_and_polled_only_while_there_is_work() -> None:
    llm = FakeAsyncLLM([Step([1], finish="length")])
    cfg = config(
        engine={"measure_expert_load": True, "enforce_eager": True},
        router={"enabled": False, "report_interval_s": 0.05},
    )
    server = await start(cfg, llm)
    assert ("collective_rpc", "moe_expert_load_install") in llm.calls

    def polls() -> int:
        return llm.calls.count(("collective_rpc", "moe_expert_load_take"))

    await asyncio.sleep(0.3)
    assert polls() == 0  # idle: the workers are left asleep
    req = EngineRequest("r1", (1, 2, 3), Sampling(max_tokens=1))
    assert [e async for e in server.generate(req)]
    await asyncio.sleep(0.3)
    assert polls() >= 1  # the request's counts, once after it ran
    settled = polls()
    await asyncio.sleep(0.3)
    assert polls() == settled
    for task in server._tasks:
        task.cancel()


async def test_a_dead_engine_ends_the_stream_then_exits_the_replica() -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    llm = FakeAsyncLLM([Step([1]), Step([2])], fail_after=1, failure=EngineDeadError())
    exits: list[int] = []
    server = await start(config(), llm, exit_process=exits.append)
    req = EngineRequest("r1", (1, 2, 3), Sampling(max_tokens=4))
    seen = [event async for event in server.generate(req)]
    assert isinstance(seen[0], Started)
    # The stream's last event says so (the ingress resumes it elsewhere) ...
    assert seen[-1] == EngineLost(server._engine.replica_id)
    assert exits == []  # ... and reaches the caller before the replica exits
    # A request that arrives meanwhile ends the same way; the replica exits once.
    late = [e async for e in server.generate(EngineRequest("r2", (1,), req.sampling))]
    assert late[-1] == EngineLost(server._engine.replica_id)
    await asyncio.sleep(EXIT_DELAY_S + 0.2)
    assert exits == [1]


async def test_an_ep_config_outside_a_gang_is_refused_before_the_engine_starts() -> (
    None
):
    cfg = config(expert_parallel={"ranks": 2})
    with pytest.raises(RuntimeError, match="gang-scheduled"):
        await start(cfg, FakeAsyncLLM())
    assert ScriptedEngine.started == []


async def _events(server: EngineServer, rid: str, into: list[Any]) -> None:
    req = EngineRequest(rid, (1, 2, 3), Sampling(max_tokens=3))
    async for event in server.generate(req):
        into.append(event)


async def test_a_stopping_replica_hands_off_what_outlives_its_drain_timeout() -> None:
    hold = asyncio.Event()
    steps = [Step([1], "a"), Step([2], "b"), Step([3], "c", finish="length")]
    llm = FakeAsyncLLM(steps, hold=hold)
    server = await start(config(deployment={"drain_timeout_s": 0.3}), llm)
    seen: list[Any] = []
    stream = asyncio.create_task(_events(server, "r1", seen))
    while len(seen) < 2:  # Started, then its first token; then it waits
        await asyncio.sleep(0.01)
    server._draining(True)  # the router's answer: Serve is stopping this replica
    await asyncio.sleep(0.2)
    assert not stream.done() and llm.aborted == []  # it may still finish
    await asyncio.wait_for(stream, 2)
    assert isinstance(seen[0], Started)
    # Its first token, then the hand-off instead of more.
    assert [e.token_ids for e in seen[1:-1]] == [(1,)]
    assert seen[-1] == HandOff("replica-a")
    assert llm.aborted == ["r1"]  # its engine slot is freed
    # A request that still reaches it is handed off before it starts.
    late: list[Any] = []
    await _events(server, "late", late)
    assert late == [HandOff("replica-a")]
    assert [c[2] for c in llm.calls if len(c) == 4] == ["r1"]
    await stop(server)


async def test_streams_that_finish_within_the_drain_timeout_are_not_handed_off() -> (
    None
):
    hold = asyncio.Event()
    steps = [Step([1], "a"), Step([2], "b", finish="length")]
    llm = FakeAsyncLLM(steps, hold=hold)
    server = await start(config(deployment={"drain_timeout_s": 5}), llm)
    seen: list[Any] = []
    stream = asyncio.create_task(_events(server, "r1", seen))
    while len(seen) < 2:
        await asyncio.sleep(0.01)
    server._draining(True)
    await asyncio.sleep(0.05)
    hold.set()  # it runs to its end
    await asyncio.wait_for(stream, 2)
    assert isinstance(seen[-1], Finish) and seen[-1].reason == "length"
    await asyncio.sleep(0.2)  # the drain saw it idle and handed off nothing
    assert server._drain_task is not None and server._drain_task.done()
    assert llm.aborted == []
    await stop(server)


async def test_a_replica_serve_keeps_after_all_stops_draining() -> None:
    server = await start(config(deployment={"drain_timeout_s": 5}), FakeAsyncLLM())
    server._draining(True)
    task = server._drain_task
    server._draining(False)
    await asyncio.sleep(0)
    assert task is not None and task.cancelled() and server._drain_task is None
    assert [e async for e in server.generate(EngineRequest("r", (1,), Sampling(1)))]
    await stop(server)
