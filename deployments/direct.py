"""Engine streams straight from the ingress to the engine replica the router chose
(``server.engine_transport: direct``), past Serve's handle.

The DeepSeekRouter has already decided each request's replica, so the handle's
work on the way (its router's own event loop and replica choice, the replica's
request bookkeeping and its hand-over to the user code's thread) adds only
latency. Here the engine replica listens on a socket of its own, on the event
loop its engine runs on, and the ingress streams from it on its own: one
process hop each way.

- **Wire.** One TCP connection from an ingress to each replica it streams from,
  its streams multiplexed on it. Every frame is ``| length: u32 | stream: u32 |``
  then ``length`` bytes: a one-byte tag and its body.

  ======  ===============================  ==========================================
  tag     from                             body
  ======  ===============================  ==========================================
  ``H``   ingress, stream 0, first         the replica's token; answered ``H`` (empty)
  ``O``   ingress                          opens a stream: a pickled ``EngineRequest``,
                                           the ingress request's route, its trace
                                           context
  ``C``   ingress                          cancels the stream (the client left)
  ``E``   replica                          one pickled ``EngineEvent``
  ``M``   replica                          a stream's last tokens and its ``Finish``,
                                           as a pickled pair: the client's last token
                                           and the end of its answer leave the
                                           ingress together rather than a frame apart
  ``X``   replica                          the exception the replica's stream raised,
                                           pickled; the ingress raises it again as it
                                           is (``RequestRejected`` stays the client's
                                           error)
  ``D``   replica                          the stream's handler has ended
  ``U``   replica                          the replica is stopping: the stream was
                                           not opened
  ======  ===============================  ==========================================

  A stream's frames are few (its tokens come batched: ``stream_interval_ms``),
  and a connection carries any number of streams: opening one is a write, not a
  call set up. gRPC, which carried these streams before, cost the two processes
  ~1 ms of CPU for a call of eight messages, and this wire ~0.15 ms.
- **Trust.** Each replica draws a random token when its socket opens, and a
  connection that does not open with it is dropped before anything else on it is
  read (no request is unpickled). The ingress gets the replica's address and token
  from the replica itself, through Serve (``EngineServer.direct_endpoint``), the
  first time the router places a request there; that request, and any while the
  answer is on its way, go through Serve's handle as before.
- **TLS.** Where the cluster runs with Ray's TLS (``cluster.tls``: the files Ray's
  own gRPC servers and channels use), the replica's socket takes TLS connections
  only, each with a certificate that CA signed, as Ray's servers do; its
  endpoint says so, and the ingress connects with the same files. An ingress
  that cannot (no TLS files there) sends that replica's streams through Serve,
  whose own calls follow Ray's TLS, and says why once. Without ``RAY_USE_TLS``
  the socket is plaintext, as Ray's own traffic then is.
- **Failures.** A stream whose replica cannot be reached, or whose connection
  fails, raises ``DirectStreamFailed``, which the ingress treats as any engine
  failure: retried elsewhere before output, resumed elsewhere after it. The
  replica's address is then forgotten, and asked for again when the router next
  places a request there; its connection closes once the streams still on it
  have ended. A replica that is stopping opens no new streams (``U``), and the
  ingress forgets it the same way.
- **Shutdown.** Serve waits only for the calls it counts, so the replica waits for
  its direct streams itself (its drain, then a hand-off) before its engine stops.
- **Serve's metrics.** Serve counts only the calls it carries, so the replica
  records each direct stream in Serve's own per-request series for it
  (``serve_deployment_request_counter``, ``..._error_counter`` and
  ``..._processing_latency_ms``, tagged with the ingress request's route), as
  Serve's replica does for a handle call: the Ray dashboard's Serve views count
  every request whichever way it came.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import itertools
import logging
import pickle
import secrets
import ssl
import struct
import time
from collections import OrderedDict
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
)
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import context as otel_context
from ray.serve.exceptions import RequestCancelledError

from cluster import tls, tracing
from deployments.protocol import (
    EngineEvent,
    EngineLost,
    EngineRequest,
    Finish,
    HandOff,
    TokenDelta,
)

logger = logging.getLogger("moe_cluster.direct")

_HEAD = struct.Struct(">II")  # the frame's length (its tag and body), its stream
_HELLO, _OPEN, _CANCEL = b"H", b"O", b"C"
_EVENT, _EVENTS, _ERROR = b"E", b"M", b"X"  # one event, several, an error
_DONE, _STOPPING = b"D", b"U"
_LAST = (Finish, HandOff, EngineLost)  # a stream's last event
# Requests carry whole prompts (and tool schemas): up to the ingress's own limits.
MAX_FRAME_BYTES = 256 << 20
# Connections the ingress keeps open (one per replica it streamed to); the oldest
# beyond this is dropped (replicas come and go over a long run), and closes once
# the streams still open on it have ended.
CHANNELS_KEPT = 256
ASK_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0  # a connection, its TLS handshake and its token's answer
HELLO_MAX_BYTES = 1024  # a connection's first frame (its token), before it is trusted


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an engine replica takes direct streams."""

    replica_id: str
    address: str  # host:port
    token: str
    encrypted: bool = False  # Ray's TLS: the caller must connect with it


class DirectStreamFailed(Exception):
    """A direct stream's connection failed (the replica, its socket or the
    network): an engine failure, as a failed Serve call is."""


def _frame(stream: int, payload: bytes) -> bytes:
    return _HEAD.pack(len(payload), stream) + payload


async def _read_frame(
    reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES
) -> tuple[int, bytes]:
    length, stream = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    if not 0 < length <= limit:
        raise ConnectionError(f"a frame of {length} bytes")
    return stream, await reader.readexactly(length)


def _frame_error(e: BaseException) -> bytes:
    try:
        return _ERROR + pickle.dumps(e, protocol=5)
    except Exception:  # an exception that does not pickle: its type and text
        return _ERROR + pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))


class RequestMetrics(Protocol):
    def record(
        self, route: str, latency_ms: float, error: BaseException | None
    ) -> None: ...


class ServeRequestMetrics:
    """Serve's per-request series of this replica (the names, tags and buckets
    its replica records a handle call under; Ray keeps one series per name, so
    these add to Serve's own), for the calls Serve does not carry. Only inside a
    Serve replica, whose deployment, replica and application tags they take."""

    def __init__(self) -> None:
        from ray.serve import metrics
        from ray.serve._private.constants import REQUEST_LATENCY_BUCKETS_MS

        self._requests = metrics.Counter(
            "serve_deployment_request_counter",
            description=(
                "The number of queries that have been processed in this replica."
            ),
            tag_keys=("route",),
        )
        self._errors = metrics.Counter(
            "serve_deployment_error_counter",
            description="The number of exceptions that have occurred in this replica.",
            tag_keys=("route", "exception_type"),  # type: ignore[arg-type]
        )
        self._latency = metrics.Histogram(
            "serve_deployment_processing_latency_ms",
            description="The latency for queries to be processed.",
            boundaries=REQUEST_LATENCY_BUCKETS_MS,
            tag_keys=("route",),
        )

    def record(
        self, route: str, latency_ms: float, error: BaseException | None
    ) -> None:
        """As Serve's replica records a call: its latency, then an error (a
        cancelled call is one, of type ``CancelledError``) or a success."""
        self._latency.observe(latency_ms, tags={"route": route})
        if error is not None:
            kind = type(error).__name__
            self._errors.inc(tags={"route": route, "exception_type": kind})
        else:
            self._requests.inc(tags={"route": route})


class _Connection:
    """The replica's side of one ingress's connection: its streams' tasks."""

    __slots__ = ("streams", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.streams: dict[int, asyncio.Task[None]] = {}

    def send(self, stream: int, payload: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(_frame(stream, payload))


class DirectServer:
    """The engine replica's side: serves ``generate`` on the running event loop,
    recording each stream in ``metrics`` (Serve's series, in a Serve replica)."""

    def __init__(
        self,
        replica_id: str,
        generate: Callable[[EngineRequest], AsyncIterator[EngineEvent]],
        host: str,
        metrics: RequestMetrics | None = None,
    ) -> None:
        self._replica_id = replica_id
        self._generate = generate
        self._host = host
        self._metrics = metrics
        self._token = secrets.token_hex(16)
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._stopping = False
        self.endpoint: Endpoint | None = None
        self.in_flight = 0

    async def start(self) -> Endpoint:
        context = tls.server_context()
        try:
            server = await asyncio.start_server(
                self._serve, self._host, 0, ssl=context, limit=1 << 20
            )
        except OSError as e:
            raise RuntimeError(
                f"direct streams: cannot listen on {self._host}: {e}"
            ) from None
        port = server.sockets[0].getsockname()[1]
        host = f"[{self._host}]" if ":" in self._host else self._host  # IPv6
        self._server = server
        self.endpoint = Endpoint(
            self._replica_id, f"{host}:{port}", self._token, context is not None
        )
        return self.endpoint

    async def stop(self, grace_s: float) -> None:
        """Stops taking streams; those running get ``grace_s`` to end."""
        if self._server is None:
            return
        self._stopping = True
        self._server.close()  # no new connections
        self._server = None
        running = [t for c in self._connections for t in c.streams.values()]
        if running:
            _, late = await asyncio.wait(running, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for connection in list(self._connections):
            connection.writer.close()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        connection = _Connection(writer)
        try:
            if not await self._hello(reader, writer):
                return
            self._connections.add(connection)
            while True:
                stream, payload = await _read_frame(reader)
                tag, body = payload[:1], payload[1:]
                if tag == _OPEN:
                    self._open(connection, stream, body)
                elif tag == _CANCEL:
                    task = connection.streams.get(stream)
                    if task is not None:
                        task.cancel()
                else:
                    raise ConnectionError(f"unknown frame {tag!r}")
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError):
            pass  # the ingress went away, or spoke nonsense: drop it
        except asyncio.CancelledError:
            pass  # the loop is closing: asyncio's stream callback would log it
        finally:
            self._connections.discard(connection)
            for task in connection.streams.values():
                task.cancel()  # its client is gone
            writer.close()

    async def _hello(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Whether the connection opened with this replica's token (answered);
        anything else is dropped before another frame is read."""
        stream, payload = await asyncio.wait_for(
            _read_frame(reader, HELLO_MAX_BYTES), CONNECT_TIMEOUT_S
        )
        token = payload[1:] if payload[:1] == _HELLO and stream == 0 else b""
        if not hmac.compare_digest(token, self._token.encode()):
            peer = writer.get_extra_info("peername")
            logger.warning("direct streams: dropped %s, without the token", peer)
            return False
        writer.write(_frame(0, _HELLO))
        return True

    def _open(self, connection: _Connection, stream: int, body: bytes) -> None:
        if self._stopping:
            connection.send(stream, _STOPPING)
            return
        if stream in connection.streams:
            raise ConnectionError(f"stream {stream} opened twice")
        task = asyncio.get_running_loop().create_task(
            self._run(connection, stream, body)
        )
        connection.streams[stream] = task

    async def _run(self, connection: _Connection, stream: int, body: bytes) -> None:
        """One stream: its frames written as they come, then ``D``."""
        frames: AsyncGenerator[bytes, None] | None = None
        try:
            request, route, trace = pickle.loads(body)
            if not isinstance(request, EngineRequest):
                raise TypeError(f"not a request: {type(request).__name__}")
            frames = self._frames(request, trace, route)
            async for payload in frames:
                connection.send(stream, payload)
                await connection.writer.drain()  # a client that reads slowly
            connection.send(stream, _DONE)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the ingress left, or cancelled it: nobody to tell
        except Exception as e:  # a request that does not unpickle
            connection.send(stream, _frame_error(e))
        finally:
            connection.streams.pop(stream, None)
            if frames is not None:
                await frames.aclose()  # ended while a frame was being written

    async def _frames(
        self, request: EngineRequest, trace: Mapping[str, str], route: str = ""
    ) -> AsyncGenerator[bytes, None]:
        """A stream's frames (tag and body) as ``generate`` yields its events."""
        parent = tracing.context_of(dict(trace))
        attached = otel_context.attach(parent) if parent is not None else None
        task = asyncio.current_task()
        self.in_flight += 1
        started = time.perf_counter()
        error: BaseException | None = None
        ended = False  # its last event sent: the caller may close the call first
        held: TokenDelta | None = None  # the last tokens, sent with the Finish
        try:
            async for event in self._generate(request):
                if isinstance(event, TokenDelta) and event.finishing:
                    held = event
                    continue
                if held is not None:
                    frame = _EVENTS + pickle.dumps((held, event), protocol=5)
                    held = None  # sent with this frame, whatever happens to it
                else:
                    frame = _EVENT + pickle.dumps(event, protocol=5)
                yield frame
                ended = isinstance(event, _LAST)
            if held is not None:
                yield _EVENT + pickle.dumps(held, protocol=5)
        except Exception as e:
            error = e
            if held is not None:
                yield _EVENT + pickle.dumps(held, protocol=5)
            yield _frame_error(e)
        except BaseException as e:  # cancelled: the caller left
            if isinstance(e, GeneratorExit):  # closed between two of its frames
                e = asyncio.CancelledError()
            error = None if ended else e
            raise
        finally:
            self.in_flight -= 1
            # Closed from another task (the connection torn down, the loop's
            # finalizer), the stream leaves the context it took on to the task
            # that ran it, which ends with it: it cannot be undone from here.
            if attached is not None and asyncio.current_task() is task:
                otel_context.detach(attached)
            if self._metrics is not None:
                self._metrics.record(
                    route, (time.perf_counter() - started) * 1000, error
                )


_Item = tuple[bytes, bytes]  # a frame's tag and body, as a stream receives it


class _Channel:
    """The ingress's connection to one replica and the streams open on it,
    connected when its first stream opens. Dropped (the oldest past
    ``CHANNELS_KEPT``, or its replica unreachable), it closes once the last of
    them ends: a stream is never cut because its channel was let go."""

    def __init__(self, endpoint: Endpoint, context: ssl.SSLContext | None) -> None:
        self.endpoint = endpoint
        self._context = context
        self.streams = 0  # DirectStreams made on it that have not ended
        self.dropped = False
        self.closed = False
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Task[asyncio.StreamWriter] | None = None
        self._reading: asyncio.Task[None] | None = None
        self._inboxes: dict[int, asyncio.Queue[_Item]] = {}
        self._ids = itertools.count(1)

    async def open(self, body: bytes) -> tuple[int, asyncio.Queue[_Item]]:
        """Opens a stream (connecting first if need be): its id and the queue
        its frames arrive in. Raises ``ConnectionError``, or ``OSError`` where
        the replica cannot be reached."""
        writer = await self._connected()
        if self._writer is not writer or writer.is_closing():
            raise ConnectionError("the connection to the replica was lost")
        stream = next(self._ids)
        inbox: asyncio.Queue[_Item] = asyncio.Queue()
        self._inboxes[stream] = inbox
        writer.write(_frame(stream, _OPEN + body))
        return stream, inbox

    def cancel(self, stream: int) -> None:
        """Tells the replica the stream's client left (its handler, even one
        that has sent its last event, is cancelled); nothing more comes."""
        self._inboxes.pop(stream, None)
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(_frame(stream, _CANCEL))

    def finished(self, stream: int) -> None:
        """The stream has had its end: frames for it are dropped from now on."""
        self._inboxes.pop(stream, None)

    async def _connected(self) -> asyncio.StreamWriter:
        if self.closed:
            raise ConnectionError("the connection to the replica was closed")
        if self._writer is not None and not self._writer.is_closing():
            return self._writer
        if self._connecting is None or self._connecting.done():
            # A context of its own, not the first stream's request's: the
            # connection, and the task that reads it, serve every stream after.
            self._connecting = asyncio.get_running_loop().create_task(
                self._connect(), context=contextvars.Context()
            )
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> asyncio.StreamWriter:
        host, _, port = self.endpoint.address.rpartition(":")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                host.strip("[]"), int(port), ssl=self._context, limit=1 << 20
            ),
            CONNECT_TIMEOUT_S,
        )
        try:
            writer.write(_frame(0, _HELLO + self.endpoint.token.encode()))
            stream, payload = await asyncio.wait_for(
                _read_frame(reader), CONNECT_TIMEOUT_S
            )
            if (stream, payload) != (0, _HELLO):
                raise ConnectionError("the replica did not take the connection")
        except asyncio.IncompleteReadError:
            writer.close()
            raise ConnectionRefusedError(
                "the replica did not take the connection (its token?)"
            ) from None
        except BaseException:
            writer.close()
            raise
        self._writer = writer
        self._reading = asyncio.get_running_loop().create_task(
            self._read(reader, writer)
        )
        return writer

    async def _read(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        reason = "the replica closed the connection"
        try:
            while True:
                stream, payload = await _read_frame(reader)
                inbox = self._inboxes.get(stream)
                if inbox is not None:
                    inbox.put_nowait((payload[:1], payload[1:]))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            if not isinstance(e, asyncio.IncompleteReadError):
                reason = f"the connection failed: {e!r}"
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()
            inboxes, self._inboxes = self._inboxes, {}
            for inbox in inboxes.values():
                inbox.put_nowait((b"", reason.encode()))  # lost, with why

    def ended(self) -> None:
        self.streams -= 1
        if self.dropped and self.streams == 0:
            self._close()

    def drop(self) -> None:
        self.dropped = True
        if self.streams == 0:
            self._close()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._connecting is not None and not self._connecting.done():
                self._connecting.cancel()
            if self._writer is not None:
                self._writer.close()

    async def close_now(self) -> None:
        """Closes it, ending the streams still open on it (shutdown)."""
        self.dropped = True
        writer = self._writer
        self._close()
        if writer is not None:
            with contextlib.suppress(Exception):
                await writer.wait_closed()


_CANCELLED: _Item = (b"", b"")  # put by ``cancel``: wakes the reader


class DirectStream:
    """One request's stream from a replica (``EngineStream``)."""

    def __init__(
        self,
        body: bytes,
        replica_id: str,
        on_failed: Callable[[], None],
        channel: _Channel,
    ):
        self._body = body
        self._replica_id = replica_id
        self._on_failed = on_failed
        self._cancelled = False
        self._stream: int | None = None
        self._inbox: asyncio.Queue[_Item] | None = None
        self._channel = channel
        self._counted = True  # among the channel's streams until it ends
        channel.streams += 1

    def _ended(self) -> None:
        if self._counted:
            self._counted = False
            self._channel.ended()

    def cancel(self) -> None:
        self._cancelled = True
        if self._stream is not None:
            self._channel.cancel(self._stream)
        if self._inbox is not None:
            self._inbox.put_nowait(_CANCELLED)
        self._ended()

    def _failed(self, why: str) -> DirectStreamFailed:
        # The replica is unreachable: its channel, which the replica's other
        # streams share, goes (it is asked for again next time).
        self._on_failed()
        return DirectStreamFailed(
            f"direct stream from replica {self._replica_id}: UNAVAILABLE {why}"
        )

    async def __aiter__(self) -> AsyncIterator[EngineEvent]:
        last = False
        try:
            if self._cancelled:
                raise RequestCancelledError()
            try:
                self._stream, self._inbox = await self._channel.open(self._body)
            except (OSError, ConnectionError, TimeoutError) as e:
                raise self._failed(f"cannot connect: {e}") from None
            while True:
                tag, body = await self._inbox.get()
                if self._cancelled:
                    raise RequestCancelledError()
                if tag == _DONE:
                    return
                if tag == _ERROR:
                    raise pickle.loads(body)
                if tag == _STOPPING:
                    raise self._failed("it is stopping")
                if tag not in (_EVENT, _EVENTS):
                    raise self._failed(body.decode(errors="replace"))
                events = pickle.loads(body)
                for event in events if tag == _EVENTS else (events,):
                    last = isinstance(event, _LAST)
                    yield event
                if last:
                    # The stream's handler ends on its own once the replica has
                    # done its bookkeeping: not waited for, so the client's
                    # stream ends with its last event.
                    return
        except asyncio.CancelledError:
            if self._cancelled:  # as a cancelled Serve call ends
                raise RequestCancelledError() from None
            raise
        finally:
            if self._stream is not None:
                if last:
                    self._channel.finished(self._stream)
                else:  # given up before its end: the replica stops it
                    self._channel.cancel(self._stream)
            self._ended()


class DirectStreams:
    """The ingress's side: opens direct streams to the replicas whose endpoints it
    knows, and asks for the others' (``ask``: the replica's answer through
    Serve, None where it serves none)."""

    def __init__(self, ask: Callable[[str], Awaitable[Endpoint | None]]) -> None:
        self._ask = ask
        self._known: OrderedDict[str, tuple[Endpoint, _Channel]] = OrderedDict()
        # Dropped channels whose streams have not all ended (closed with them).
        self._dropped: set[_Channel] = set()
        # Replicas that answered they take no direct streams (another transport
        # configured there, or their server could not start): not asked again.
        self._without: OrderedDict[str, None] = OrderedDict()
        self._asking: dict[str, asyncio.Task[None]] = {}

    def open(
        self, request: EngineRequest, trace: dict[str, str], route: str = ""
    ) -> DirectStream | None:
        """A direct stream for ``request`` (placed by the router), or None when its
        replica's endpoint is not known yet (it is asked for, for the next).
        ``route``: the ingress request's, for the replica's Serve metrics."""
        rid = request.replica_id
        known = self._known.get(rid) if rid else None
        if known is None:
            if rid and rid not in self._asking and rid not in self._without:
                # A context of its own, not the request's: Serve ties a handle
                # call made in a request's context to that request, and such a
                # call here went unanswered past the request's end.
                task = asyncio.get_running_loop().create_task(
                    self._learn(rid), context=contextvars.Context()
                )
                self._asking[rid] = task
            return None
        self._known.move_to_end(rid)
        endpoint, channel = known
        body = pickle.dumps((request, route, trace), protocol=5)
        return DirectStream(body, rid, lambda: self.forget(rid, endpoint), channel)

    async def _learn(self, replica_id: str) -> None:
        try:
            endpoint = await asyncio.wait_for(self._ask(replica_id), ASK_TIMEOUT_S)
            if endpoint is None:  # it serves none: Serve's handle it is
                self._use_serve(replica_id)
                return
            if endpoint.replica_id != replica_id:
                return  # it left, and another replica answered
            try:
                channel = _Channel(endpoint, _client_context(endpoint))
            except Exception as e:  # no TLS here: Serve's handle it is
                logger.warning(
                    "direct streams from %s go through Serve: %s", replica_id, e
                )
                self._use_serve(replica_id)
                return
            self._known[replica_id] = (endpoint, channel)
            while len(self._known) > CHANNELS_KEPT:
                _, (_, oldest) = self._known.popitem(last=False)
                self._drop(oldest)
        except Exception as e:
            logger.info("no direct endpoint for replica %s yet: %r", replica_id, e)
        finally:
            self._asking.pop(replica_id, None)

    def _use_serve(self, replica_id: str) -> None:
        """Its streams go through Serve's handle from now on: not asked again."""
        self._without[replica_id] = None
        while len(self._without) > CHANNELS_KEPT:
            self._without.popitem(last=False)

    def forget(self, replica_id: str, endpoint: Endpoint | None = None) -> None:
        """Drops a replica's endpoint (its connection failed); asked for again on
        its next request."""
        known = self._known.get(replica_id)
        if known is None or (endpoint is not None and known[0] != endpoint):
            return
        del self._known[replica_id]
        self._drop(known[1])

    def _drop(self, channel: _Channel) -> None:
        channel.drop()
        if channel.streams:
            self._dropped.add(channel)
        # Those whose last stream has ended since are closed: forget them.
        self._dropped = {c for c in self._dropped if c.streams}

    def known(self) -> list[str]:
        return list(self._known)

    async def close(self) -> None:
        for task in list(self._asking.values()):
            task.cancel()
        channels = [c for _, c in self._known.values()] + list(self._dropped)
        self._known.clear()
        self._dropped.clear()
        for c in channels:
            await c.close_now()


def _client_context(endpoint: Endpoint) -> ssl.SSLContext | None:
    """The TLS context to connect to ``endpoint`` with, where it takes TLS only;
    raises where it does and this node has no TLS files."""
    if not endpoint.encrypted:
        return None
    context = tls.client_context()
    if context is None:
        raise RuntimeError(
            f"replica {endpoint.replica_id} takes direct streams over TLS, and "
            f"{tls.FLAG} is not set here"
        )
    return context
