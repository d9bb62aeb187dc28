"""A direct socket for the ingress's hot path to the DeepSeekRouter.

Every request is admitted and released through the router. As Ray actor calls,
each costs the router's event loop ~0.7 ms whatever it carries, and a round trip
between two processes ~2 ms on a busy node. Over a TCP connection from each
ingress to the router actor, in msgpack frames, a batch costs tens of µs. Only
``admit_many`` and ``release_many`` travel here, answered by the actor's own
methods, so the QoS order and every decision are the same; everything else
(a queued ticket's answer, single admissions, lost replicas) stays on Ray.

    frame:   | length: u32 big-endian | msgpack [seq, method, payload] |
    answer:  | length | msgpack [seq, [[kind, value], ...]] |    (admissions only)
             | length | msgpack [seq, "message"] |   the router's admit_many raised

A connection opens with the router's token (drawn when its socket opens, and
handed to each ingress with the socket's address through Ray), which the router
checks before it reads anything else; a connection without it is dropped
unanswered. Where the cluster runs with Ray's TLS (``cluster.tls``), the socket
takes TLS connections only, each with a certificate the cluster's CA signed.

    hello:   | length | msgpack [0, "hello", token] |   answered [0, []]

A connection that fails fails the batch in flight on it: the ingress then admits
those tickets again through Ray, as after a router restart (``LinkDown.sent``
says whether the router may have seen the batch). The next batch connects again,
asking the router (through Ray) where it listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import secrets
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from cluster import tls
from router.types import Release, RouteDecision, Shed, Ticket

logger = logging.getLogger("moe_cluster.router")

_LEN = struct.Struct(">I")
MAX_FRAME = 64 << 20
RECONNECT_PAUSE_S = 1.0  # after a failed connection, Ray carries the calls this long
HELLO_TIMEOUT_S = 10.0  # a connection's token, and the router's answer to it

Answer = RouteDecision | Shed | None
AdmitMany = Callable[[list[Ticket]], Awaitable[list[Answer]]]
ReleaseMany = Callable[[list[Release]], Awaitable[None]]

_HELLO, _ADMIT, _RELEASE = "hello", "admit", "release"
_encoder = msgspec.msgpack.Encoder()
_frame_decoder = msgspec.msgpack.Decoder(tuple[int, str, msgspec.Raw])
_tickets = msgspec.msgpack.Decoder(list[Ticket])
_releases = msgspec.msgpack.Decoder(list[Release])
_token = msgspec.msgpack.Decoder(str)
_answers = msgspec.msgpack.Decoder(tuple[int, list[tuple[str, Any]] | str])


@dataclass(frozen=True, slots=True)
class WireEndpoint:
    """Where a router takes admissions: its socket's ``host:port``, the token a
    connection opens with, and whether it takes TLS connections only."""

    address: str
    token: str
    encrypted: bool = False


class RouterError(Exception):
    """The router's ``admit_many`` raised (its message), as a Ray call would."""


class LinkDown(Exception):
    """The socket to the router is not there, or failed. ``sent``: the batch
    went out first, so the router may have acted on it."""

    def __init__(self, message: str, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


def _frame(body: Any) -> bytes:
    data = _encoder.encode(body)
    return _LEN.pack(len(data)) + data


def _encode_answer(a: Answer) -> tuple[str, Any]:
    if a is None:
        return ("w", None)  # waiting in its class queue
    if isinstance(a, Shed):
        return ("s", (a.reason, str(a), a.retry_after_s))
    return ("d", a)


def _decode_answer(kind: str, value: Any) -> Answer:
    if kind == "w":
        return None
    if kind == "s":
        reason, message, retry_after_s = value
        return Shed(reason, message, retry_after_s)
    return msgspec.convert(value, RouteDecision)


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes")
    return await reader.readexactly(n)


class AdmissionServer:
    """The router's end: each frame is handed to the actor's ``admit_many`` or
    ``release_many``; admissions are answered on the same connection."""

    def __init__(self, admit_many: AdmitMany, release_many: ReleaseMany) -> None:
        self._admit_many, self._release_many = admit_many, release_many
        self._token = secrets.token_hex(16)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str) -> WireEndpoint:
        """Listens on ``host`` (a free port), with Ray's TLS where the cluster
        runs with it; returns where, and the token."""
        context = tls.server_context()
        self._server = await asyncio.start_server(self._serve, host, 0, ssl=context)
        port = self._server.sockets[0].getsockname()[1]
        return WireEndpoint(f"{host}:{port}", self._token, context is not None)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._writers.add(writer)
        try:
            if not await self._hello(reader, writer):
                return
            while True:
                seq, method, payload = _frame_decoder.decode(await _read_frame(reader))
                work: Awaitable[None]
                if method == _ADMIT:
                    work = self._admit(seq, _tickets.decode(payload), writer)
                elif method == _RELEASE:
                    work = self._release_many(_releases.decode(payload))
                else:
                    raise ConnectionError(f"unknown method {method!r}")
                task = asyncio.ensure_future(work)  # answered in any order
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            msgspec.DecodeError,
            TimeoutError,
        ):
            pass  # the ingress went away, or spoke nonsense: drop it
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _hello(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Whether the connection opened with this router's token (answered);
        anything else is dropped before another frame is read."""
        frame = await asyncio.wait_for(_read_frame(reader), HELLO_TIMEOUT_S)
        seq, method, payload = _frame_decoder.decode(frame)
        token = _token.decode(payload) if method == _HELLO else ""
        if not hmac.compare_digest(token.encode(), self._token.encode()):
            peer = writer.get_extra_info("peername")
            logger.warning("admission socket: dropped %s, without the token", peer)
            return False
        writer.write(_frame((seq, [])))
        return True

    async def _admit(
        self, seq: int, tickets: list[Ticket], writer: asyncio.StreamWriter
    ) -> None:
        body: Any
        try:
            body = [_encode_answer(a) for a in await self._admit_many(tickets)]
        except Exception as e:  # the batch's callers get it, as over Ray
            logger.warning("admit_many failed: %r", e)
            body = repr(e)
        if not writer.is_closing():
            writer.write(_frame((seq, body)))


class AdmissionLink:
    """The ingress's end: one connection to the router, opened when first
    needed (``endpoint`` asks the router where it listens) and again after a
    failure, at most once per ``RECONNECT_PAUSE_S``."""

    def __init__(self, endpoint: Callable[[], Awaitable[WireEndpoint]]) -> None:
        self._endpoint = endpoint
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Task[asyncio.StreamWriter] | None = None
        self._reading: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[list[Answer]]] = {}
        self._seq = itertools.count(1)
        self._down_until = 0.0

    @property
    def up(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def admit_many(self, tickets: list[Ticket]) -> list[Answer]:
        writer = await self._connected()
        if self._writer is not writer or writer.is_closing():
            raise LinkDown("connection to the router lost", sent=False)
        seq = next(self._seq)
        answer: asyncio.Future[list[Answer]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[seq] = answer
        try:
            writer.write(_frame((seq, _ADMIT, tickets)))
            return await answer
        finally:
            self._pending.pop(seq, None)

    def release_many(self, releases: list[Release]) -> bool:
        """Sends the releases if connected; False if not (send them by Ray)."""
        if not self.up:
            return False
        assert self._writer is not None
        self._writer.write(_frame((0, _RELEASE, releases)))
        return True

    def close(self) -> None:
        self._fail(LinkDown("closed", sent=True))

    async def _connected(self) -> asyncio.StreamWriter:
        if self.up:
            assert self._writer is not None
            return self._writer
        if time.monotonic() < self._down_until:
            raise LinkDown("reconnecting later", sent=False)
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        except Exception as e:
            self._down_until = time.monotonic() + RECONNECT_PAUSE_S
            raise LinkDown(f"cannot connect to the router: {e!r}", sent=False) from e
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> asyncio.StreamWriter:
        endpoint = await self._endpoint()
        host, _, port = endpoint.address.rpartition(":")
        context = tls.client_context() if endpoint.encrypted else None
        if endpoint.encrypted and context is None:
            raise RuntimeError(
                f"the router's admission socket takes TLS only, and {tls.FLAG} "
                "is not set here"
            )
        reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
        try:
            writer.write(_frame((0, _HELLO, endpoint.token)))
            frame = await asyncio.wait_for(_read_frame(reader), HELLO_TIMEOUT_S)
            if _answers.decode(frame) != (0, []):
                raise ConnectionError("the router did not take the connection")
        except BaseException:
            writer.close()
            raise
        self._writer = writer
        self._reading = asyncio.ensure_future(self._read(reader, writer))
        return writer

    async def _read(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                seq, answers = _answers.decode(await _read_frame(reader))
                fut = self._pending.get(seq)
                if fut is None or fut.done():
                    continue
                if isinstance(answers, str):
                    fut.set_exception(RouterError(answers))
                else:
                    fut.set_result([_decode_answer(k, v) for k, v in answers])
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError) as e:
            logger.warning("connection to the router lost (%r); using Ray", e)
        finally:
            if self._writer is writer:
                self._fail(LinkDown("connection to the router lost", sent=True))

    def _fail(self, error: LinkDown) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        self._down_until = time.monotonic() + RECONNECT_PAUSE_S
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)
