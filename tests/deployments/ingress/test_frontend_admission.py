"""Frontend with the DeepSeekRouter's service in the loop (in-process, real core)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from cluster.config import RouterConfig
from cluster.qos import QoS
from deployments.ingress import deployment, frontend
from deployments.ingress.errors import (
    INVALID,
    OVERLOADED,
    EngineUnavailable,
    status_of,
)
from deployments.ingress.frontend import Frontend
from deployments.ingress.openai_api import ResponseShape
from deployments.ingress.validation import InvalidRequest, Limits
from deployments.protocol import (
    EngineFailed,
    EngineLost,
    EngineRequest,
    Finish,
    HandOff,
    RequestRejected,
    Sampling,
    Started,
    TokenDelta,
)
from router.core import RouterCore
from router.experts import ExpertPredictor
from router.service import RouterService
from router.settings import CoreSettings
from router.tickets import TicketMaker
from router.types import ReplicaId, ReplicaReport, Shed
from tests.deployments.ingress.test_frontend import FACTS, ScriptedStream
from tests.router.clock import Clock
from tests.waiting import until


class LocalAdmission:
    """``frontend.Admission`` over an in-process RouterService."""

    def __init__(self, service: RouterService) -> None:
        self.service = service
        self.tickets = TicketMaker(block_size=16, hash_blocks=False, predictor=None)

    async def admit(self, ticket: Any) -> Any:
        return await self.service.admit(ticket)

    def release(self, release: Any) -> None:
        self.service.release(release)

    def watch_lost(self, on_lost: Callable[[list[str]], None]) -> None:
        async def follow() -> None:
            since = -1
            while True:
                since, lost = await self.service.lost_replicas(since, 10.0)
                if lost:
                    on_lost(list(lost))

        self.watching = asyncio.get_running_loop().create_task(follow())


def running(service: RouterService) -> int:
    return sum(r.running for r in service.snapshot().replicas.values())


def setup(
    *scripts: list[Any],
    slots: int = 1,
    queue: int = 8,
    migration_limit: int = 0,
    breaker_failures: int = 2,
    clock: Callable[[], float] = lambda: 0.0,
    replicas: tuple[str, ...] = ("a", "b"),
) -> tuple[Frontend, RouterService, list[EngineRequest]]:
    cfg = RouterConfig.model_validate(
        {
            "max_running_per_replica": slots,
            "realtime_reserved_slots": 0,
            "breaker_failures": breaker_failures,
            "max_queued": dict.fromkeys(("realtime", "normal", "background"), queue),
        }
    )
    service = RouterService(RouterCore(CoreSettings.of(cfg), clock=clock))
    for r in replicas:
        service.report(ReplicaReport(ReplicaId(r)))
    opened: list[EngineRequest] = []
    streams = iter([ScriptedStream(s) for s in scripts])

    def open_stream(req: EngineRequest) -> ScriptedStream:
        opened.append(req)
        return next(streams)

    fe = Frontend(
        tokenizer=None,
        facts=FACTS,
        limits=Limits(64, 100, 1000),
        api_keys=(),
        open_stream=open_stream,
        admission=LocalAdmission(service),
        migration_limit=migration_limit,
    )
    return fe, service, opened


def req(rid: str, qos: QoS = QoS.NORMAL) -> EngineRequest:
    return EngineRequest(rid, (1, 2, 3), Sampling(max_tokens=2), qos)


def ok(replica: str) -> list[Any]:
    return [
        Started(replica),
        TokenDelta((5, 6), "ab"),
        Finish("length", 3, 2, 0, replica),
    ]


async def drain(fe: Frontend, r: EngineRequest) -> list[Any]:
    return [e async for e in fe.stream(r)]


async def test_requests_run_where_the_router_placed_them_and_release() -> None:
    fe, service, opened = setup(ok("a"), ok("b"))
    await drain(fe, req("1"))
    await drain(fe, req("2"))
    assert [r.replica_id for r in opened] == ["a", "a"]  # released before the next
    snap = service.snapshot()
    assert snap.admitted["normal"] == 2
    assert snap.replicas["a"].running == 0
    assert snap.ttft_estimate_s < 0.05  # measured, no longer the 50 ms prior


async def test_a_shed_reaches_the_client_as_itself_with_the_routers_retry_hint() -> (
    None
):
    fe, service, _ = setup(["hang"], ["hang"], slots=1, queue=0)
    first = asyncio.create_task(drain(fe, req("1")))
    second = asyncio.create_task(drain(fe, req("2")))
    await until(lambda: running(service) == 2, "both replicas busy")
    with pytest.raises(Shed, match="queue is full") as e:
        await drain(fe, req("3"))
    assert e.value.retry_after_s == 1.0 and e.value.reason == "queue-full"
    assert status_of(e.value) == OVERLOADED  # RESOURCE_EXHAUSTED / 429
    fe.abort("1")
    fe.abort("2")
    await asyncio.gather(first, second)


async def test_abort_while_queued_leaves_the_router_queue() -> None:
    fe, service, _ = setup(["hang"], ["hang"], slots=1)
    busy = [asyncio.create_task(drain(fe, req(f"busy{i}"))) for i in range(2)]
    await until(lambda: running(service) == 2, "both replicas busy")
    queued = asyncio.create_task(drain(fe, req("q")))
    await until(lambda: service.snapshot().queued["normal"] == 1, "q queued")
    assert fe.abort("q")
    events = await queued
    assert events == [Finish("abort", 3, 0, 0, "")]
    assert service.snapshot().queued["normal"] == 0
    for b in busy:
        b.cancel()
    await asyncio.gather(*busy, return_exceptions=True)


async def test_failures_before_output_are_readmitted_and_open_the_breaker() -> None:
    boom = RuntimeError("engine died")
    fe, service, opened = setup(
        [Started("a"), boom], ok("b"), [Started("a"), boom], ok("b")
    )
    for rid in ("1", "2"):
        events = await drain(fe, req(rid))
        assert isinstance(events[-1], Finish) and events[-1].replica_id == "b"
    # Each placed again away from the replica that failed it; two failures in a
    # row open its breaker.
    assert [r.replica_id for r in opened] == ["a", "b", "a", "b"]
    assert service.snapshot().replicas["a"].breaker == "open"


async def test_what_the_engine_refuses_is_the_clients_error_not_the_replicas() -> None:
    refused = RequestRejected("temperature must be in [0, 2], got 3.0", "temperature")
    fe, service, opened = setup(*([Started("a"), refused] for _ in range(6)))
    for rid in range(6):  # more than enough failures to open a breaker
        with pytest.raises(
            InvalidRequest, match=r"temperature must be in \[0, 2\]"
        ) as e:
            await drain(fe, req(str(rid)))
        assert e.value.field == "temperature"
        assert status_of(e.value) == INVALID  # INVALID_ARGUMENT / 400
    assert len(opened) == 6  # never retried: it would be refused again
    snap = service.snapshot()
    assert {r.breaker for r in snap.replicas.values()} == {"closed"}
    assert running(service) == 0


async def test_failure_mid_stream_is_reported_against_the_replica() -> None:
    boom = RuntimeError("engine died")
    fe, service, _ = setup(
        [Started("a"), TokenDelta((5,), "a"), boom],
        [Started("a"), TokenDelta((5,), "a"), boom],
    )
    for rid in ("1", "2"):
        with pytest.raises(EngineUnavailable):
            await drain(fe, req(rid))
    assert service.snapshot().replicas["a"].breaker == "open"


async def http_response(fe: Frontend, r: EngineRequest, streamed: bool) -> None:
    """Serves ``r`` as the OpenAI HTTP handlers do: they stop reading its events
    at the Finish and close the stream there."""
    events = fe.stream(r)
    first = await deployment._first_output(events)
    if not streamed:
        got = await deployment._collect(first, events)
        assert got.finish.reason == "length"
        return
    shape = ResponseShape("completion", r.request_id, "m")
    body = b"".join([c async for c in deployment._sse(shape, first, events, True)])
    assert body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "whole"])
async def test_an_http_response_is_a_success_of_its_replica(streamed: bool) -> None:
    # A failure, a success served over HTTP, a failure: the success reset the
    # count, so the two failures are not in a row and the breaker stays closed
    # (were it taken for a client gone away, it would open).
    boom = RuntimeError("engine died")
    failing = [Started("a"), TokenDelta((5,), "a"), boom]
    fe, service, opened = setup(failing, ok("a"), failing, replicas=("a",))
    with pytest.raises(EngineUnavailable):
        await drain(fe, req("1"))
    await http_response(fe, req("2"), streamed)
    with pytest.raises(EngineUnavailable):
        await drain(fe, req("3"))
    assert [r.replica_id for r in opened] == ["a", "a", "a"]
    assert service.snapshot().replicas["a"].breaker == "closed"
    assert running(service) == 0


async def test_an_http_response_is_the_probe_that_closes_a_breaker() -> None:
    now = [0.0]
    boom = RuntimeError("engine died")
    failing = [Started("a"), TokenDelta((5,), "a"), boom]
    fe, service, opened = setup(
        failing, failing, ["hang"], ok("a"), clock=lambda: now[0]
    )
    for rid in ("1", "2"):
        with pytest.raises(EngineUnavailable):
            await drain(fe, req(rid))
    assert service.snapshot().replicas["a"].breaker == "open"
    # b is busy, a has cooled down: the next request is a's probe.
    busy = asyncio.create_task(drain(fe, req("busy")))
    await until(lambda: running(service) == 1, "b busy")
    now[0] += 3600.0
    await http_response(fe, req("probe"), streamed=True)
    assert [r.replica_id for r in opened] == ["a", "a", "b", "a"]
    assert service.snapshot().replicas["a"].breaker == "closed"
    fe.abort("busy")
    await busy


async def test_the_predicted_expert_histogram_is_recorded_on_the_request(
    tiny_model: Path,
) -> None:
    predictor = ExpertPredictor.from_checkpoint(tiny_model)
    fe, _service, _ = setup(ok("a"))
    admission = fe._admission
    assert isinstance(admission, LocalAdmission)
    admission.tickets = TicketMaker(
        block_size=16, hash_blocks=False, predictor=predictor
    )
    events = await drain(fe, req("1"))
    assert events[-1].expert_hist == predictor.histogram([1, 2, 3])
    assert sum(events[-1].expert_hist) == 3 * 2  # 3 prompt tokens x top-2


class Tokens:
    """A tokenizer whose every token is one letter (its text never cut)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def tokens(*ids: int) -> TokenDelta:
    return TokenDelta(ids, Tokens().decode(list(ids)))


async def test_a_stream_whose_engine_fails_goes_on_on_another_replica() -> None:
    boom = RuntimeError("engine died")
    fe, service, opened = setup(
        [Started("a"), tokens(5), tokens(6, 7), boom],
        [Started("b"), TokenDelta((8,), "engine's"), Finish("length", 6, 1, 3, "b")],
        migration_limit=1,
        breaker_failures=1,
    )
    fe.tokenizer = Tokens()
    r = EngineRequest("m1", (1, 2, 3), Sampling(max_tokens=4, seed=9, stop=("zz",)))
    events = await drain(fe, r)
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    # One uninterrupted stream: every position once, the text made whole.
    assert [t for d in deltas for t in d.token_ids] == [5, 6, 7, 8]
    assert "".join(d.text for d in deltas) == "fghi"
    assert events[-1] == Finish("length", 3, 4, 3, "b", migrations=1)
    # The continuation: the prompt plus what was sent, the rest of max_tokens.
    first, resumed = opened
    assert resumed.prompt_token_ids == (1, 2, 3, 5, 6, 7)
    assert resumed.sampling == Sampling(max_tokens=1, seed=12, stop=())
    assert (first.replica_id, resumed.replica_id) == ("a", "b")  # a is busy
    # The failure counted against the replica that failed (one opens it here).
    assert service.snapshot().replicas["a"].breaker == "open"
    assert running(service) == 0


async def test_past_the_migration_limit_the_client_keeps_what_it_got() -> None:
    boom = RuntimeError("engine died")
    fe, _service, opened = setup(
        [Started("a"), tokens(5), boom],
        [Started("b"), tokens(6), boom],
        migration_limit=1,
    )
    fe.tokenizer = Tokens()
    got: list[Any] = []
    with pytest.raises(EngineUnavailable, match="could not be resumed"):
        async for event in fe.stream(req("m2")):
            got.append(event)
    assert [t for e in got if isinstance(e, TokenDelta) for t in e.token_ids] == [5, 6]
    assert len(opened) == 2 and fe.in_flight() == []


async def test_with_no_replica_to_resume_on_the_stream_fails_unavailable() -> None:
    fe, service, _ = setup([], queue=0, migration_limit=2)
    fe.tokenizer = Tokens()

    class LastReplicaDies(ScriptedStream):
        async def _events(self) -> Any:
            yield Started("a")
            yield tokens(5)
            for r in ("a", "b"):  # every replica leaves the router
                service.core.replicas.pop(ReplicaId(r))
            raise RuntimeError("engine died")

    fe._open_stream = lambda _req: LastReplicaDies([])
    got: list[Any] = []
    with pytest.raises(EngineUnavailable, match="could not be resumed"):
        async for event in fe.stream(req("m3")):
            got.append(event)
    assert [t for e in got if isinstance(e, TokenDelta) for t in e.token_ids] == [5]


async def test_migration_is_off_at_limit_zero() -> None:
    boom = RuntimeError("engine died")
    fe, _service, opened = setup([Started("a"), tokens(5), boom])
    with pytest.raises(EngineUnavailable):
        await drain(fe, req("m4"))
    assert len(opened) == 1


async def test_a_stream_handed_off_by_a_stopping_replica_goes_on_elsewhere() -> None:
    fe, service, opened = setup(
        [Started("a"), tokens(5), HandOff("a")],
        [Started("b"), TokenDelta((6,), "g"), Finish("length", 4, 1, 3, "b")],
        migration_limit=1,
        breaker_failures=1,
    )
    fe.tokenizer = Tokens()
    r = EngineRequest("h1", (1, 2, 3), Sampling(max_tokens=2))
    events = await drain(fe, r)
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    assert [t for d in deltas for t in d.token_ids] == [5, 6]
    assert events[-1] == Finish("length", 3, 2, 3, "b", migrations=1)
    assert opened[1].prompt_token_ids == (1, 2, 3, 5)
    # A hand-off is not a failure: one failure would have opened "a"'s breaker.
    assert service.snapshot().replicas["a"].breaker == "closed"
    assert running(service) == 0


async def test_a_stream_whose_engine_died_goes_on_elsewhere_and_counts_a_failure() -> (
    None
):
    fe, service, opened = setup(
        [Started("a"), tokens(5), EngineLost("a")],
        [Started("b"), TokenDelta((6,), "g"), Finish("length", 4, 1, 3, "b")],
        [Started("a"), EngineLost("a")],
        ok("b"),
        migration_limit=1,
        breaker_failures=2,
    )
    fe.tokenizer = Tokens()
    r = EngineRequest("d1", (1, 2, 3), Sampling(max_tokens=2))
    events = await drain(fe, r)
    assert [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids] == [
        5,
        6,
    ]
    assert events[-1] == Finish("length", 3, 2, 3, "b", migrations=1)
    assert opened[1].prompt_token_ids == (1, 2, 3, 5)
    assert service.snapshot().replicas["a"].breaker == "closed"  # one failure
    # Before any output: placed again, and the second failure opens the breaker.
    events = await drain(fe, req("d2"))
    assert events[-1] == Finish("length", 3, 2, 0, "b")
    assert service.snapshot().replicas["a"].breaker == "open"
    # Each time placed away from the replica it failed on (least-loaded alone
    # would pick "a" again: both idle, "a" first).
    assert [r.replica_id for r in opened] == ["a", "b", "a", "b"]
    assert running(service) == 0


async def test_a_request_handed_off_before_its_first_token_is_placed_again() -> None:
    fe, service, opened = setup(
        [Started("a"), HandOff("a")],
        ok("b"),
        breaker_failures=1,
    )
    events = await drain(fe, req("h2"))
    assert events[-1] == Finish("length", 3, 2, 0, "b")  # no migration counted
    assert len(opened) == 2
    assert service.snapshot().replicas["a"].breaker == "closed"


def lose(service: RouterService, clock: Clock, replica: str, alive: str) -> None:
    """``replica`` stops reporting long enough for the router to drop it."""
    clock.advance(60.0)
    service.report(ReplicaReport(ReplicaId(alive)))
    service.tick()
    assert replica not in service.snapshot().replicas


@pytest.fixture
def quick_lost_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frontend, "LOST_SILENCE_S", 0.1)
    monkeypatch.setattr(frontend, "LOST_SWEEP_S", 0.01)


@pytest.mark.usefixtures("quick_lost_sweep")
async def test_a_stream_waiting_on_a_lost_replica_goes_on_elsewhere() -> None:
    """A lost node's replica answers nothing and no cancel reaches it: once the
    router drops it, its silent stream resumes on another replica."""
    clock = Clock()
    fe, service, opened = setup(
        [Started("a"), tokens(5), "dead"],
        [Started("b"), TokenDelta((6,), "g"), Finish("length", 4, 1, 3, "b")],
        migration_limit=1,
        clock=clock,
    )
    fe.tokenizer = Tokens()
    got: list[Any] = []

    async def client() -> None:
        async for event in fe.stream(EngineRequest("l1", (1, 2, 3), Sampling(2))):
            got.append(event)

    task = asyncio.create_task(client())
    await until(lambda: any(isinstance(e, TokenDelta) for e in got), "a token")
    lose(service, clock, "a", alive="b")
    await asyncio.wait_for(task, 5)
    assert [t for e in got if isinstance(e, TokenDelta) for t in e.token_ids] == [5, 6]
    assert got[-1] == Finish("length", 3, 2, 3, "b", migrations=1)
    assert [r.replica_id for r in opened] == ["a", "b"]
    assert opened[1].prompt_token_ids == (1, 2, 3, 5)
    assert running(service) == 0


@pytest.mark.usefixtures("quick_lost_sweep")
async def test_a_request_yet_to_start_on_a_lost_replica_is_placed_again() -> None:
    clock = Clock()
    fe, service, opened = setup([Started("a"), "dead"], ok("b"), clock=clock)
    task = asyncio.create_task(drain(fe, req("l2")))
    await until(lambda: opened, "the stream opened")
    lose(service, clock, "a", alive="b")
    events = await asyncio.wait_for(task, 5)
    assert events[-1] == Finish("length", 3, 2, 0, "b")  # nothing sent: no migration
    assert [r.replica_id for r in opened] == ["a", "b"]


@pytest.mark.usefixtures("quick_lost_sweep")
async def test_a_stream_still_flowing_from_a_dropped_replica_is_left_alone() -> None:
    """Dropped for silence is a judgement on its reports: a stream that still
    gets tokens from it is not moved."""
    clock = Clock()
    pace = [x for i in range(5, 15) for x in (0.03, tokens(i))]
    fe, service, opened = setup(
        [Started("a"), *pace, Finish("length", 3, 10, 0, "a")],
        migration_limit=1,
        clock=clock,
    )
    fe.tokenizer = Tokens()
    task = asyncio.create_task(
        drain(fe, EngineRequest("l3", (1, 2, 3), Sampling(max_tokens=10)))
    )
    await until(lambda: opened, "the stream opened")
    lose(service, clock, "a", alive="b")
    events = await asyncio.wait_for(task, 5)
    assert events[-1] == Finish("length", 3, 10, 0, "a")
    assert len(opened) == 1


async def _waiting_on_a_dead_replica() -> tuple[asyncio.Task[Any], Any]:
    watch = frontend._Placement("a", 0.0)
    events = aiter(ScriptedStream(["dead"]))
    task = asyncio.create_task(frontend._next_event(events, None, watch))
    await until(lambda: watch.waiting_since is not None, "the wait")
    return task, watch


async def test_a_wait_cut_for_a_lost_replica_ends_as_that_engines_failure() -> None:
    task, watch = await _waiting_on_a_dead_replica()
    watch.cut = True
    task.cancel()
    with pytest.raises(EngineFailed, match="replica a was lost"):
        await task
    assert not watch.cut and watch.waiting_since is None


async def test_a_wait_cut_and_cancelled_for_itself_stays_cancelled() -> None:
    """The client went away as the replica was lost: its cancel wins."""
    task, watch = await _waiting_on_a_dead_replica()
    watch.cut = True
    task.cancel()  # the cut
    task.cancel()  # the task's own
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cut_the_engine_stream_absorbs_lets_the_stream_go_on() -> None:
    """A cancel swallowed on the way (the wait went on and an event came) is
    taken back: the stream continues, and its task is not left cancelling."""
    watch = frontend._Placement("a", 0.0)

    async def absorbing() -> AsyncIterator[Any]:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        yield Started("a")

    task = asyncio.create_task(frontend._next_event(absorbing(), None, watch))
    await until(lambda: watch.waiting_since is not None, "the wait")
    watch.cut = True
    task.cancel()
    assert await task == Started("a")
    assert not watch.cut and task.cancelling() == 0
