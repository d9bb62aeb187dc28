"""Direct streams (``server.engine_transport: direct``): an engine replica's socket
and the ingress's client, over a real connection, on a scripted engine."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import ssl
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from ray.serve.exceptions import RequestCancelledError

from deployments import direct
from deployments.direct import DirectStreamFailed, DirectStreams, Endpoint
from deployments.engine import deployment as engine_deployment
from deployments.engine.deployment import EngineServer, Placement
from deployments.protocol import (
    EngineRequest,
    Finish,
    HandOff,
    RequestRejected,
    Sampling,
    Started,
    TokenDelta,
)
from tests.deployments.engine.fakes import FakeAsyncLLM, Step
from tests.deployments.engine.test_deployment import (
    ScriptedEngine,
    config,
    start,
    stop,
)
from tests.tls_certs import use_tls, write_certs
from tests.waiting import until

STEPS = [Step([1], "a"), Step([2], "b"), Step([3], "c", finish="length")]


def direct_config(**sections: Any) -> Any:
    return config(server={"engine_transport": "direct"}, **sections)


def request(rid: str = "r1", replica: str = "replica-a") -> EngineRequest:
    return EngineRequest(rid, (1, 2, 3), Sampling(max_tokens=3), replica_id=replica)


async def streams_to(server: EngineServer) -> DirectStreams:
    """An ingress's client that knows ``server``'s endpoint."""
    asked: list[str] = []

    async def ask(replica_id: str) -> Endpoint | None:
        asked.append(replica_id)
        return await server.direct_endpoint()

    streams = DirectStreams(ask)
    assert streams.open(request(), {}) is None  # unknown: asked for, not waited on
    await until(lambda: streams.known() == ["replica-a"], "the endpoint")
    assert asked == ["replica-a"]
    return streams


async def test_events_arrive_as_the_replica_yields_them() -> None:
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS)))
    streams = await streams_to(server)
    stream = streams.open(request(), {})
    assert stream is not None
    seen = [e async for e in stream]
    assert seen[0] == Started("replica-a")
    deltas = [e.token_ids for e in seen if isinstance(e, TokenDelta)]
    assert deltas == [(1,), (2,), (3,)]
    assert isinstance(seen[-1], Finish) and seen[-1].reason == "length"
    # What a call through Serve would have carried: the replica's own stream.
    assert seen == [e async for e in server.generate(request("r2"))]
    await streams.close()
    await stop(server)


async def test_without_direct_transport_the_replica_serves_no_endpoint() -> None:
    server = await start(config(server={"engine_transport": "grpc"}), FakeAsyncLLM())
    assert await server.direct_endpoint() is None
    assert server.__del__() is None


async def test_a_replica_without_direct_streams_is_asked_once() -> None:
    asked: list[str] = []

    async def ask(replica_id: str) -> Endpoint | None:
        asked.append(replica_id)
        return None  # another transport configured there

    streams = DirectStreams(ask)
    assert streams.open(request(), {}) is None
    await until(lambda: asked == ["replica-a"], "the question")
    await asyncio.sleep(0.05)
    assert streams.open(request(), {}) is None  # Serve's handle, not asked again
    await asyncio.sleep(0.05)
    assert asked == ["replica-a"] and streams.known() == []


async def test_a_replica_that_cannot_listen_serves_through_serve() -> None:
    ScriptedEngine.llm = FakeAsyncLLM(list(STEPS))
    server = EngineServer.__new__(EngineServer)
    away = Placement("replica-a", "node-1", host="203.0.113.1")  # not this host's
    await server.__init__(  # type: ignore[misc]
        direct_config(), engine_cls=ScriptedEngine, placement=away
    )
    assert await server.direct_endpoint() is None
    events = [e async for e in server.generate(request())]
    assert events[0] == Started("replica-a") and isinstance(events[-1], Finish)
    assert server.__del__() is None


async def test_an_endpoint_from_another_replica_is_not_kept() -> None:
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS)))

    async def ask(replica_id: str) -> Endpoint | None:
        return await server.direct_endpoint()  # replica-a answers for replica-b

    streams = DirectStreams(ask)
    assert streams.open(request(replica="replica-b"), {}) is None
    await asyncio.sleep(0.2)
    assert streams.known() == []
    await stop(server)


HEAD = struct.Struct(">II")


def frame(stream: int, payload: bytes) -> bytes:
    return HEAD.pack(len(payload), stream) + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    length, stream = HEAD.unpack(await reader.readexactly(HEAD.size))
    return stream, await reader.readexactly(length)


async def connect(
    endpoint: Endpoint, token: str = "", context: ssl.SSLContext | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection to ``endpoint``, opened with its token (or ``token``)."""
    host, _, port = endpoint.address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
    writer.write(frame(0, b"H" + (token or endpoint.token).encode()))
    return reader, writer


async def raw_frames(server: EngineServer, req: EngineRequest) -> list[bytes]:
    """The frames (tag and body) of one stream from ``server``, as sent, up to
    its handler's end (``D``)."""
    endpoint = await server.direct_endpoint()
    assert endpoint is not None
    reader, writer = await connect(endpoint)
    assert await read_frame(reader) == (0, b"H")
    writer.write(frame(1, b"O" + pickle.dumps((req, "", {}))))
    frames = []
    while (got := await read_frame(reader))[1] != b"D":
        assert got[0] == 1
        frames.append(got[1])
    writer.close()
    return frames


async def test_a_connection_without_the_token_is_dropped_before_it_is_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    llm = FakeAsyncLLM(list(STEPS))
    server = await start(direct_config(), llm)
    endpoint = await server.direct_endpoint()
    assert endpoint is not None
    with caplog.at_level(logging.WARNING, "moe_cluster.direct"):
        reader, writer = await connect(endpoint, token="guess")
        writer.write(frame(1, b"O" + pickle.dumps((request(), "", {}))))
        assert await reader.read() == b""  # closed, unanswered
    writer.close()
    assert "without the token" in caplog.text
    await asyncio.sleep(0.05)
    assert llm.calls == []  # its request never reached the engine
    await stop(server)


async def test_a_connection_whose_first_frame_is_large_is_dropped_unread() -> None:
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS)))
    endpoint = await server.direct_endpoint()
    assert endpoint is not None
    host, _, port = endpoint.address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(HEAD.pack(64 << 20, 0))  # "a token" of 64 MiB, not sent
    assert await asyncio.wait_for(reader.read(), 5) == b""  # dropped at once
    writer.close()
    await stop(server)


async def test_under_rays_tls_streams_are_encrypted_both_ends_certified(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = use_tls(monkeypatch, tmp_path / "cluster")
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS)))
    streams = await streams_to(server)
    endpoint = await server.direct_endpoint()
    assert endpoint is not None and endpoint.encrypted
    stream = streams.open(request(), {})
    assert stream is not None
    seen = [e async for e in stream]
    assert seen[0] == Started("replica-a") and isinstance(seen[-1], Finish)

    ca = env["RAY_TLS_CA_CERT"]
    stranger = write_certs(tmp_path / "other", "another-ca")  # another CA's node
    no_certificate = ssl.create_default_context(cafile=ca)
    another_ca = ssl.create_default_context(cafile=ca)
    another_ca.load_cert_chain(
        stranger["RAY_TLS_SERVER_CERT"], stranger["RAY_TLS_SERVER_KEY"]
    )
    callers = {
        "plaintext": None,
        "no certificate": no_certificate,
        "another CA's certificate": another_ca,
    }
    for caller, context in callers.items():
        # Even with the token, the connection is refused: no answer to it.
        with pytest.raises(
            (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)
        ):
            reader, writer = await connect(endpoint, context=context)
            try:
                await asyncio.wait_for(read_frame(reader), 5)
            finally:
                writer.close()
        assert server._direct is not None and server._direct.in_flight == 0, caller
    await streams.close()
    await stop(server)


async def test_an_ingress_without_the_tls_files_streams_through_serve(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    use_tls(monkeypatch, tmp_path)
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS)))
    endpoint = await server.direct_endpoint()
    assert endpoint is not None and endpoint.encrypted
    monkeypatch.delenv("RAY_USE_TLS")  # the ingress's node has no TLS set up
    asked: list[str] = []

    async def ask(replica_id: str) -> Endpoint | None:
        asked.append(replica_id)
        return endpoint

    streams = DirectStreams(ask)
    with caplog.at_level(logging.WARNING, "moe_cluster.direct"):
        assert streams.open(request(), {}) is None
        await until(lambda: asked and not streams._asking, "the answer")
    assert streams.known() == []
    assert "RAY_USE_TLS is not set here" in caplog.text
    assert streams.open(request(), {}) is None  # Serve's handle, not asked again
    await asyncio.sleep(0.05)
    assert asked == ["replica-a"]
    await streams.close()
    await stop(server)


async def test_the_replicas_error_is_raised_at_the_ingress_as_it_was() -> None:
    from vllm.exceptions import VLLMValidationError

    failure = VLLMValidationError("bad top_k", parameter="top_k")
    llm = FakeAsyncLLM(list(STEPS), fail_after=0, failure=failure)
    server = await start(direct_config(), llm)
    streams = await streams_to(server)
    stream = streams.open(request(), {})
    assert stream is not None
    with pytest.raises(RequestRejected) as e:
        async for _ in stream:
            pass
    assert e.value.parameter == "top_k"
    assert streams.known() == ["replica-a"]  # the client's error, not the replica's
    await stop(server)


async def test_a_cancelled_stream_aborts_its_engine_request() -> None:
    hold = asyncio.Event()
    llm = FakeAsyncLLM(list(STEPS), hold=hold)
    server = await start(direct_config(), llm)
    streams = await streams_to(server)
    stream = streams.open(request(), {})
    assert stream is not None
    events = aiter(stream)
    assert await anext(events) == Started("replica-a")
    assert isinstance(await anext(events), TokenDelta)  # then it waits on hold
    stream.cancel()
    with pytest.raises(RequestCancelledError):
        await anext(events)
    await until(lambda: llm.aborted == ["r1"], "the abort")
    await stop(server)


async def test_a_channel_let_go_closes_only_after_its_last_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(direct, "CHANNELS_KEPT", 1)
    hold = asyncio.Event()
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS), hold=hold))

    async def ask(replica_id: str) -> Endpoint | None:
        endpoint = await server.direct_endpoint()
        assert endpoint is not None
        return dataclasses.replace(endpoint, replica_id=replica_id)

    streams = DirectStreams(ask)
    assert streams.open(request(), {}) is None
    await until(lambda: streams.known() == ["replica-a"], "the endpoint")
    kept = streams._known["replica-a"][1]
    stream = streams.open(request(), {})
    assert stream is not None
    events = aiter(stream)
    assert await anext(events) == Started("replica-a")
    assert isinstance(await anext(events), TokenDelta)  # then it waits on hold
    # A second replica's endpoint pushes the first one's channel out...
    assert streams.open(request("r2", replica="replica-b"), {}) is None
    await until(lambda: streams.known() == ["replica-b"], "the oldest let go")
    assert kept.dropped and not kept.closed
    # ...and the stream on it goes on to its end, then the channel closes.
    hold.set()
    rest = [event async for event in events]
    assert [type(e) for e in rest] == [TokenDelta, TokenDelta, Finish]
    assert kept.closed and kept.streams == 0
    await streams.close()
    await stop(server)


async def test_a_replica_gone_fails_the_stream_and_is_forgotten() -> None:
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS)))
    streams = await streams_to(server)
    assert server._direct is not None
    await server._direct.stop(0)  # as when its process died
    stream = streams.open(request(), {})
    assert stream is not None
    with pytest.raises(DirectStreamFailed, match="replica-a: UNAVAILABLE"):
        async for _ in stream:
            pass
    await until(lambda: streams.known() == [], "the endpoint forgotten")
    assert streams.open(request(), {}) is None  # asked for again
    await streams.close()
    await stop(server)


async def test_a_replica_lost_mid_stream_fails_its_streams_and_is_forgotten() -> None:
    hold = asyncio.Event()
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS), hold=hold))
    streams = await streams_to(server)
    opened = [streams.open(request(f"r{i}"), {}) for i in range(2)]
    firsts = []
    for stream in opened:
        assert stream is not None
        events = aiter(stream)
        assert await anext(events) == Started("replica-a")
        firsts.append(events)
    assert server._direct is not None
    for connection in list(server._direct._connections):
        connection.writer.transport.abort()  # as when its node went away
    for events in firsts:
        with pytest.raises(DirectStreamFailed, match="replica-a: UNAVAILABLE"):
            async for _ in events:
                pass
    assert streams.known() == []
    await streams.close()
    hold.set()
    await stop(server)


async def test_a_stale_token_fails_the_stream_and_its_endpoint_is_asked_again() -> None:
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS)))
    streams = await streams_to(server)
    endpoint = await server.direct_endpoint()
    assert endpoint is not None
    stale = dataclasses.replace(endpoint, token="stale")  # a restarted replica's
    streams._known["replica-a"] = (stale, direct._Channel(stale, None))
    stream = streams.open(request(), {})
    assert stream is not None
    with pytest.raises(DirectStreamFailed, match="did not take the connection"):
        async for _ in stream:
            pass
    assert streams.known() == []
    assert streams.open(request(), {}) is None  # asked for again
    await until(lambda: streams.known() == ["replica-a"], "the endpoint again")
    stream = streams.open(request("r2"), {})
    assert stream is not None
    assert isinstance([e async for e in stream][-1], Finish)
    await streams.close()
    await stop(server)


async def test_a_stopping_replica_opens_no_new_streams() -> None:
    hold = asyncio.Event()
    server, streams = await serving(held_generate(hold), _Recorded())
    running = streams.open(request("r1"), {})
    assert running is not None
    events = aiter(running)
    assert await anext(events) == Started("replica-a")
    stopping = asyncio.create_task(server.stop(5))
    await asyncio.sleep(0.05)
    late = streams.open(request("r2"), {})
    assert late is not None
    with pytest.raises(DirectStreamFailed, match="UNAVAILABLE it is stopping"):
        async for _ in late:
            pass
    hold.set()  # the running stream still ends as it would
    assert isinstance([e async for e in events][-1], Finish)
    await asyncio.wait_for(stopping, 5)
    await streams.close()


async def test_shutdown_waits_for_direct_streams_and_hands_off_the_rest() -> None:
    # Serve waits only for the calls it counts; the replica waits for its own.
    hold = asyncio.Event()
    llm = FakeAsyncLLM(list(STEPS), hold=hold)
    server = await start(direct_config(deployment={"drain_timeout_s": 0.3}), llm)
    streams = await streams_to(server)
    stream = streams.open(request(), {})
    assert stream is not None
    seen: list[Any] = []

    async def read() -> None:
        async for event in stream:
            seen.append(event)

    reading = asyncio.create_task(read())
    # Started, its first token; then it waits.
    await until(lambda: len(seen) == 2, "the first token")
    closing = asyncio.create_task(stop(server))
    await asyncio.sleep(0.1)
    assert not llm.shut_down  # the stream still has its drain timeout
    await asyncio.wait_for(reading, 5)
    assert seen[-1] == HandOff("replica-a")
    await asyncio.wait_for(closing, 5)
    assert llm.shut_down
    assert await server.direct_endpoint() is None


def test_an_unpicklable_error_still_reaches_the_ingress() -> None:
    class Local(Exception):  # not importable by name: does not pickle
        pass

    frame = direct._frame_error(Local("boom"))
    error = pickle.loads(frame[1:])
    assert isinstance(error, RuntimeError) and "Local: boom" in str(error)


class _Recorded:
    """Serve's per-request series as the replica records them: (route, latency
    in ms, the error's type or None)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, str | None]] = []

    def record(
        self, route: str, latency_ms: float, error: BaseException | None
    ) -> None:
        self.calls.append((route, latency_ms, type(error).__name__ if error else None))


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> _Recorded:
    into = _Recorded()
    monkeypatch.setattr(engine_deployment, "ServeRequestMetrics", lambda: into)
    return into


async def test_serve_metrics_count_every_direct_stream(recorded: _Recorded) -> None:
    # Serve counts the calls it carries; the replica counts those it does not,
    # under the route of the ingress's request, as Serve's replica would.
    failure = RuntimeError("engine broke")
    llm = FakeAsyncLLM(list(STEPS))
    server = await start(direct_config(), llm)
    streams = await streams_to(server)
    stream = streams.open(request("ok"), {}, "/v1/completions")
    assert stream is not None
    assert isinstance([e async for e in stream][-1], Finish)
    await until(lambda: len(recorded.calls) == 1, "the stream's record")
    route, latency_ms, error = recorded.calls[0]
    assert (route, error) == ("/v1/completions", None)
    assert 0 < latency_ms < 10_000

    llm.fail_after, llm.failure = 0, failure
    stream = streams.open(request("failed"), {}, "/moecluster.v1.Inference/Generate")
    assert stream is not None
    with pytest.raises(RuntimeError, match="engine broke"):
        async for _ in stream:
            pass
    await until(lambda: len(recorded.calls) == 2, "the failure's record")
    assert recorded.calls[1][0::2] == (
        "/moecluster.v1.Inference/Generate",
        "RuntimeError",
    )
    await streams.close()
    await stop(server)


async def test_a_cancelled_direct_stream_is_recorded_as_serve_records_one(
    recorded: _Recorded,
) -> None:
    hold = asyncio.Event()
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS), hold=hold))
    streams = await streams_to(server)
    stream = streams.open(request(), {}, "/v1/chat/completions")
    assert stream is not None
    events = aiter(stream)
    await anext(events)
    stream.cancel()
    await until(lambda: len(recorded.calls) == 1, "the cancelled stream's record")
    assert recorded.calls[0][0::2] == ("/v1/chat/completions", "CancelledError")
    await stop(server)


async def serving(
    generate: Any, recorded: _Recorded
) -> tuple[direct.DirectServer, DirectStreams]:
    """A replica's direct server on ``generate`` (recording into ``recorded``),
    and an ingress's client that knows its endpoint."""
    server = direct.DirectServer("replica-a", generate, "127.0.0.1", recorded)
    endpoint = await server.start()

    async def ask(replica_id: str) -> Endpoint | None:
        return endpoint

    streams = DirectStreams(ask)
    streams.open(request(), {})
    await until(lambda: streams.known() == ["replica-a"], "the endpoint")
    return server, streams


async def test_a_stream_closed_by_its_caller_after_its_last_event_is_a_success() -> (
    None
):
    # The ingress lets a call go once it has the last event, which may reach the
    # replica before its generator has returned: Serve would count that a success.
    recorded = _Recorded()
    after_last = asyncio.Event()

    async def generate(req: EngineRequest) -> AsyncIterator[Any]:
        yield Started("replica-a")
        if req.request_id == "finished":
            yield Finish("length", 3, 3, 0, "replica-a")
        after_last.set()
        await asyncio.Event().wait()  # its clean-up, or a stall: never returns

    server, streams = await serving(generate, recorded)
    for rid, outcome in (("finished", None), ("cut", "CancelledError")):
        after_last.clear()
        stream = streams.open(request(rid), {}, "/v1/completions")
        assert stream is not None
        events = aiter(stream)
        await anext(events)
        if rid == "finished":
            assert isinstance(await anext(events), Finish)
        await after_last.wait()
        stream.cancel()
        await until(lambda: len(recorded.calls) == 1, f"{rid}'s record")
        assert recorded.calls.pop()[0::2] == ("/v1/completions", outcome)
    await streams.close()
    await server.stop(0)


async def test_a_stream_ends_at_its_last_event_and_leaves_the_call_to_end() -> None:
    # After its last event the replica's handler still has work (its records;
    # here it never returns): the ingress's stream ends with the event, and
    # the call is left to end on its own, not cancelled.
    recorded = _Recorded()

    async def generate(req: EngineRequest) -> AsyncIterator[Any]:
        yield Started("replica-a")
        yield Finish("length", 3, 3, 0, "replica-a")
        await asyncio.Event().wait()

    server, streams = await serving(generate, recorded)
    stream = streams.open(request("r"), {}, "/v1/completions")
    assert stream is not None

    async def read() -> list[Any]:
        return [e async for e in stream]

    seen = await asyncio.wait_for(read(), 10)
    assert isinstance(seen[-1], Finish)
    await asyncio.sleep(0.2)
    assert recorded.calls == []  # its handler runs on: nothing cancelled it
    await streams.close()
    await until(lambda: len(recorded.calls) == 1, "the call's record")
    assert recorded.calls[0][0::2] == ("/v1/completions", None)
    await server.stop(0)


async def test_the_last_tokens_travel_in_one_message_with_the_finish() -> None:
    # The engine marks the delta its Finish follows at once; the wire carries
    # the two as one message, and the ingress yields them as two events.
    server = await start(direct_config(), FakeAsyncLLM(list(STEPS)))
    frames = await raw_frames(server, request())
    assert [f[:1] for f in frames] == [b"E", b"E", b"E", b"M"]
    last, finish = pickle.loads(frames[-1][1:])
    assert last == TokenDelta((3,), "c", finishing=True)
    assert isinstance(finish, Finish) and finish.reason == "length"

    streams = await streams_to(server)
    stream = streams.open(request("r2"), {})
    assert stream is not None
    seen = [e async for e in stream]
    assert [type(e) for e in seen] == [
        Started,
        TokenDelta,
        TokenDelta,
        TokenDelta,
        Finish,
    ]
    assert [e.finishing for e in seen if isinstance(e, TokenDelta)] == [
        False,
        False,
        True,
    ]
    await streams.close()
    await stop(server)


async def test_last_tokens_whose_stream_then_fails_still_reach_the_ingress() -> None:
    recorded = _Recorded()

    async def generate(req: EngineRequest) -> AsyncIterator[Any]:
        yield Started("replica-a")
        yield TokenDelta((7,), "x", finishing=True)
        raise RuntimeError("the finish failed")

    server, streams = await serving(generate, recorded)
    stream = streams.open(request("r"), {})
    assert stream is not None
    seen: list[Any] = []
    with pytest.raises(RuntimeError, match="the finish failed"):
        async for event in stream:
            seen.append(event)
    assert seen == [Started("replica-a"), TokenDelta((7,), "x", finishing=True)]
    await streams.close()
    await server.stop(0)


async def test_a_stream_closed_from_another_task_leaves_no_context_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica whose engine died closes its open streams' handlers from other
    tasks than the ones that ran them (the call torn down, the loop's generator
    finalizer): the trace context a handler took on stays with its own task and
    nothing logs an error for it."""

    async def generate(req: EngineRequest) -> AsyncIterator[Any]:
        yield Started("replica-a")
        await asyncio.Event().wait()  # the engine never answers again
        yield TokenDelta((1,), "never")

    server = direct.DirectServer("replica-a", generate, "127.0.0.1")
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    handler = server._frames(request(), {"traceparent": traceparent})
    first = await asyncio.create_task(handler.__anext__())  # type: ignore[arg-type]
    assert pickle.loads(first[1:]) == Started("replica-a")
    assert server.in_flight == 1
    with caplog.at_level(logging.ERROR):
        await asyncio.create_task(handler.aclose())  # type: ignore[arg-type]
    assert server.in_flight == 0
    assert not [r for r in caplog.records if "detach" in r.getMessage()]


def held_generate(hold: asyncio.Event) -> Any:
    """A replica's ``generate``: Started, then its Finish once ``hold`` is set."""

    async def generate(req: EngineRequest) -> AsyncIterator[Any]:
        yield Started("replica-a")
        await hold.wait()
        yield Finish("length", 3, 3, 0, "replica-a")

    return generate
