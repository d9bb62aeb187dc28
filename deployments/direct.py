"""Engine streams straight from the ingress to the engine replica the router chose
(``server.engine_transport: direct``), past Serve's handle.

The DeepSeekRouter has already decided each request's replica, so the handle's
work on the way (its router's own event loop and replica choice, the replica's
request bookkeeping and its hand-over to the user code's thread) adds only
latency. Here the engine replica serves one gRPC method on the event loop its
engine runs on, and the ingress calls it on its own: one process hop each way.

- **Wire.** ``moecluster.engine.v1.Direct/Generate``, unary-stream. The request is
  a pickled ``EngineRequest``; each response message one pickled ``EngineEvent``
  (tag ``E``) or, last, the exception the replica's stream raised (tag ``X``),
  which the ingress raises again as it is: ``RequestRejected`` stays the client's
  error. A stream's last tokens travel with its ``Finish``, as a pickled pair
  (tag ``M``), so the client's last token and the end of its answer leave the
  ingress together rather than a message apart. The trace context travels in
  the call's metadata.
- **Trust.** Each replica draws a random token when its server starts, and a
  call without it is refused before its request is unpickled. The ingress gets
  the replica's address and token from the replica itself, through Serve
  (``EngineServer.direct_endpoint``), the first time the router places a request
  there; that request, and any while the answer is on its way, go through
  Serve's handle as before.
- **TLS.** Where the cluster runs with Ray's TLS (``cluster.tls``: the files
  Ray's own gRPC servers and channels use), the replica listens with them
  and requires the caller's certificate, signed by that CA, as Ray's servers do;
  its endpoint says so, and the ingress connects with the same files. An ingress
  that cannot (no TLS files there) sends that replica's streams through Serve,
  whose own calls follow Ray's TLS, and says why once. Without ``RAY_USE_TLS``
  the channel is plaintext, as Ray's own traffic then is.
- **Failures.** A call that fails (the replica died, its server stopped) raises
  ``DirectStreamFailed``, which the ingress treats as any engine failure: retried
  elsewhere before output, resumed elsewhere after it. Where the replica is
  unreachable (``UNAVAILABLE``), its address is forgotten, and asked for again
  when the router next places a request there; its channel closes once the
  streams still on it have ended.
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
import logging
import pickle
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
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

SERVICE = "moecluster.engine.v1.Direct"
GENERATE = f"/{SERVICE}/Generate"
TOKEN_KEY = "x-moe-direct-token"
ROUTE_KEY = "x-moe-route"  # the ingress request's route, for Serve's metrics
_EVENT, _EVENTS, _ERROR = b"E", b"M", b"X"  # one event, several, an error
_LAST = (Finish, HandOff, EngineLost)  # a stream's last event
# Requests carry whole prompts (and tool schemas): up to the ingress's own limits.
MAX_MESSAGE_BYTES = 256 << 20
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# Channels the ingress keeps open (one per replica it streamed to); the oldest
# beyond this is dropped (replicas come and go over a long run), and closes once
# the streams still open on it have ended.
CHANNELS_KEPT = 256
ASK_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an engine replica takes direct streams."""

    replica_id: str
    address: str  # host:port
    token: str
    encrypted: bool = False  # Ray's TLS: the caller must connect with it


def _channel(endpoint: Endpoint) -> grpc.aio.Channel:
    """A channel to ``endpoint``, over TLS with this node's files where the
    replica listens with TLS."""
    if not endpoint.encrypted:
        return grpc.aio.insecure_channel(endpoint.address, options=_OPTIONS)
    files = tls.files()
    if files is None:
        raise RuntimeError(
            f"replica {endpoint.replica_id} takes direct streams over TLS, and "
            f"{tls.FLAG} is not set here"
        )
    chain, key, ca = files
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=chain
    )
    return grpc.aio.secure_channel(endpoint.address, credentials, options=_OPTIONS)


class DirectStreamFailed(Exception):
    """A direct stream's call failed (the replica, its server or the network): an
    engine failure, as a failed Serve call is."""


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


class DirectServer:
    """The engine replica's side: serves ``generate`` on the running event loop,
    recording each call in ``metrics`` (Serve's series, in a Serve replica)."""

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
        self._server: grpc.aio.Server | None = None
        self.endpoint: Endpoint | None = None
        self.in_flight = 0

    async def start(self) -> Endpoint:
        server = grpc.aio.server(options=_OPTIONS)
        handler = grpc.unary_stream_rpc_method_handler(self._handle)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Generate": handler}),)
        )
        host = f"[{self._host}]" if ":" in self._host else self._host  # IPv6
        files = tls.files()
        if files is None:
            port = server.add_insecure_port(f"{host}:0")
        else:
            chain, key, ca = files
            credentials = grpc.ssl_server_credentials(
                [(key, chain)], root_certificates=ca, require_client_auth=True
            )
            port = server.add_secure_port(f"{host}:0", credentials)
        if not port:
            raise RuntimeError(f"direct streams: cannot listen on {host}")
        await server.start()
        self._server = server
        address = f"{host}:{port}"
        self.endpoint = Endpoint(
            self._replica_id, address, self._token, files is not None
        )
        return self.endpoint

    async def stop(self, grace_s: float) -> None:
        """Stops taking calls; those running get ``grace_s`` to end."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    async def _handle(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        metadata = {k: v for k, v in context.invocation_metadata() or ()}
        token = metadata.get(TOKEN_KEY, "")
        if not isinstance(token, str) or not hmac.compare_digest(token, self._token):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "bad token")
        request = pickle.loads(raw)
        if not isinstance(request, EngineRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a request")
        parent = tracing.context_of({k: str(v) for k, v in metadata.items()})
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
            error = None if ended else e
            raise
        finally:
            self.in_flight -= 1
            # Closed from another task (the call torn down, the loop's
            # finalizer), the handler leaves the context it took on to the task
            # that ran it, which ends with it: it cannot be undone from here.
            if attached is not None and asyncio.current_task() is task:
                otel_context.detach(attached)
            if self._metrics is not None:
                route = metadata.get(ROUTE_KEY, "")
                self._metrics.record(
                    route if isinstance(route, str) else "",
                    (time.perf_counter() - started) * 1000,
                    error,
                )


class _Channel:
    """A replica's channel and the streams open on it. Dropped (the oldest past
    ``CHANNELS_KEPT``, or its replica unreachable), it closes once the last of
    them ends: a stream is never cut because its channel was let go."""

    __slots__ = ("channel", "closed", "dropped", "streams")

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.streams = 0
        self.dropped = False
        self.closed = False

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
            with contextlib.suppress(RuntimeError):  # no running loop
                asyncio.get_running_loop().create_task(self.channel.close())

    async def close_now(self) -> None:
        """Closes it, cancelling the streams still open on it (shutdown)."""
        self.dropped = True
        if not self.closed:
            self.closed = True
            await self.channel.close()


class DirectStream:
    """One request's stream from a replica (``EngineStream``)."""

    def __init__(
        self,
        call: Any,
        replica_id: str,
        on_failed: Callable[[], None],
        channel: _Channel,
    ):
        self._call = call
        self._replica_id = replica_id
        self._on_failed = on_failed
        self._cancelled = False
        self._channel: _Channel | None = channel
        channel.streams += 1

    def _ended(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.ended()

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()
        self._ended()

    async def __aiter__(self) -> AsyncIterator[EngineEvent]:
        last = False
        try:
            async for frame in self._call:
                body = pickle.loads(memoryview(frame)[1:])
                tag = frame[:1]
                if tag == _ERROR:
                    raise body
                for event in body if tag == _EVENTS else (body,):
                    last = isinstance(event, _LAST)
                    yield event
                if last:
                    # The call ends on its own once the replica's handler has
                    # done its bookkeeping: not waited for, so the client's
                    # stream ends with its last event.
                    return
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            if self._cancelled:  # as a cancelled Serve call ends
                raise RequestCancelledError() from None
            if isinstance(e, asyncio.CancelledError):
                raise
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                # The replica is unreachable: its channel, which the replica's
                # other streams share, goes. Any other code failed this call only.
                self._on_failed()
            raise DirectStreamFailed(
                f"direct stream from replica {self._replica_id}: "
                f"{e.code().name} {e.details() or ''}".rstrip()
            ) from None
        finally:
            if not last and not self._call.done():
                self._call.cancel()
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
        call = channel.channel.unary_stream(GENERATE)(
            pickle.dumps(request, protocol=5),
            metadata=((TOKEN_KEY, endpoint.token), (ROUTE_KEY, route), *trace.items()),
        )
        return DirectStream(call, rid, lambda: self.forget(rid, endpoint), channel)

    async def _learn(self, replica_id: str) -> None:
        try:
            endpoint = await asyncio.wait_for(self._ask(replica_id), ASK_TIMEOUT_S)
            if endpoint is None:  # it serves none: Serve's handle it is
                self._use_serve(replica_id)
                return
            if endpoint.replica_id != replica_id:
                return  # it left, and another replica answered
            try:
                channel = _channel(endpoint)
            except Exception as e:  # no TLS here: Serve's handle it is
                logger.warning(
                    "direct streams from %s go through Serve: %s", replica_id, e
                )
                self._use_serve(replica_id)
                return
            self._known[replica_id] = (endpoint, _Channel(channel))
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
        """Drops a replica's endpoint (its call failed); asked for again on its
        next request."""
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
