"""The node store's local socket: how engines on the node reach its index.

Page bytes never travel here (they are in the shared-memory arena); only hashes,
slots and checksums do, as msgpack frames over a Unix socket: a lookup's round
trip is about 0.1 ms between two idle cores, 0.2 ms where they sleep between
calls, more where the store shares a busy core.

    frame:    | length: u32 big-endian | msgpack [method, args] |
    answer:   | length | msgpack [true, result] |  or  [false, "message"]

Answers that name slots (``lookup``, ``reserve``) also name the arena they are in,
and a ``commit`` names the arena its pages were written into. A connection's
calls are answered in the order they came, so a client may send a call and read
its answer later, with other calls in between (``StoreClient.send``).

The server keeps per connection what the connection took: leases it created and
slots it reserved. A connection that goes away (its engine died) gives them back,
so a crashed engine never leaves pages pinned or slots half-written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from kvstore.block_hash import BlockHash
from kvstore.node_store import ArenaInfo, MissHook, NodeStore

logger = logging.getLogger("moe_cluster.kvstore")

_LEN = struct.Struct(">I")
MAX_FRAME = 64 << 20


class StoreError(Exception):
    """The store refused a call or could not be reached."""


# What crosses the socket, by name. ``array_like``: each is a msgpack array on
# the wire, in field order.


class PageRef(msgspec.Struct, array_like=True, frozen=True):
    """A stored page pinned for a request: its slot in the arena, its name and
    the checksum its bytes must have."""

    slot: int
    page_hash: bytes
    checksum: int


class Fetch(msgspec.Struct, array_like=True, frozen=True):
    """A fetch of pages from another node's store, as the lookups it served
    report it."""

    node: str
    pages: int
    nbytes: int
    seconds: float


# Pages found -> the recent fetch that brought one of them here, if any.
FetchedHook = Callable[[Sequence[BlockHash]], Fetch | None]


class Found(msgspec.Struct, array_like=True, frozen=True):
    """``lookup``'s answer: the pinned run of pages, or ``pending`` when another
    node's pages are being fetched (ask again), and the arena the slots are in;
    ``fetch``: the cross-node fetch that brought some of the pages, if recent."""

    refs: list[PageRef]
    pending: bool
    arena: str
    fetch: Fetch | None = None


class Query(NamedTuple):
    """A lookup: pin, under ``lease``, the longest stored run of ``hashes`` past
    the first ``skip`` (those the engine holds itself). The prefix's ``tokens``
    (``block_size`` a page) and tenant ``salt`` count it among the hot ones."""

    lease: str
    hashes: Sequence[bytes]
    salt: str
    tokens: Sequence[int]
    block_size: int
    skip: int

    def wire(self) -> list[Any]:
        h, t = list(self.hashes), list(self.tokens)
        return [self.lease, h, self.salt, t, self.block_size, self.skip]


class Reserved(msgspec.Struct, array_like=True, frozen=True):
    """``reserve``'s answer: a slot to write per page (``None``: stored already, or
    no room), in ``arena``."""

    slots: list[int | None]
    arena: str


class Written(msgspec.Struct, array_like=True, frozen=True):
    """A reserved slot, written, with its bytes' checksum (``commit``)."""

    slot: int
    checksum: int


@dataclass
class _Conn:
    leases: set[str] = field(default_factory=set)
    reserved: set[int] = field(default_factory=set)


class StoreServer:
    def __init__(
        self,
        store: NodeStore,
        path: str,
        on_miss: MissHook | None = None,
        fetched: FetchedHook | None = None,
    ) -> None:
        self.store, self.path, self._on_miss = store, path, on_miss
        self._fetched = fetched
        self._server: asyncio.AbstractServer | None = None
        self._open: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()

    async def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)  # left by a store that died
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def stop(self) -> None:
        """Stops listening and closes every engine's connection."""
        if self._server is not None:
            self._server.close()
        # Connections first: from Python 3.12 on, ``wait_closed`` also waits
        # for every connection to end.
        for writer in self._open.values():
            writer.close()
        await asyncio.gather(*self._open, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if os.path.exists(self.path):
            os.unlink(self.path)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        conn = _Conn()
        task = asyncio.current_task()
        assert task is not None
        self._open[task] = writer
        try:
            while True:
                head = await reader.readexactly(_LEN.size)
                (n,) = _LEN.unpack(head)
                if n > MAX_FRAME:
                    raise StoreError(f"frame of {n} bytes")
                method, args = self._dec.decode(await reader.readexactly(n))
                try:
                    answer = [True, self.handle(conn, method, args)]
                except Exception as e:  # answered, not fatal to the connection
                    answer = [False, f"{type(e).__name__}: {e}"]
                body = self._enc.encode(answer)
                writer.write(_LEN.pack(len(body)) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:
            logger.exception("kv store connection failed")
        finally:
            self._open.pop(task, None)
            self._disconnect(conn)
            writer.close()

    def handle(self, conn: _Conn, method: str, args: list[Any]) -> Any:
        s = self.store
        if method == "open":
            info = s.open(int(args[0]), str(args[1]))
            return [info.name, info.num_pages, info.page_bytes]
        if method == "lookup":  # -> [refs, pending, arena]
            lease, hashes, salt, tokens, block_size, *rest = args
            hashes = [BlockHash(h) for h in hashes]
            skip = int(rest[0]) if rest else 0  # pages the engine has itself
            refs = s.lookup(
                lease, hashes, salt, tokens, block_size, self._on_miss, skip
            )
            if refs is None:  # being fetched: asked again once the pages are here
                return Found([], True, self._arena_name())
            if refs:
                conn.leases.add(lease)
            pinned = [PageRef(r.index, r.page_hash, r.checksum) for r in refs]
            fetch = None
            if refs and self._fetched is not None:
                fetch = self._fetched([r.page_hash for r in refs])
            return Found(pinned, False, self._arena_name(), fetch)
        if method == "release":
            for lease in args:
                s.release(lease)
                conn.leases.discard(lease)
            return None
        if method == "reserve":
            slots = s.reserve([BlockHash(h) for h in args[0]])
            conn.reserved.update(x for x in slots if x is not None)
            return Reserved(slots, self._arena_name())
        if method == "commit":
            written = [(w.slot, w.checksum) for w in msgspec.convert(args[0], _WRITTEN)]
            if len(args) > 1 and args[1] != self._arena_name():
                # Written into the arena of a store that has since restarted:
                # these slots are not the ones this store reserved.
                raise StoreError(
                    f"pages written into arena {args[1]!r}, not this store's "
                    f"{self._arena_name()!r}"
                )
            if foreign := [slot for slot, _ in written if slot not in conn.reserved]:
                # Reserved on a connection since lost, which gave them back: they
                # may be another engine's now.
                raise StoreError(
                    f"slots {foreign} were not reserved on this connection"
                )
            s.commit(written)
            conn.reserved.difference_update(slot for slot, _ in written)
            return None
        if method == "abandon":
            s.abandon(args[0])
            conn.reserved.difference_update(args[0])
            return None
        if method == "drop":
            return s.drop([BlockHash(h) for h in args[0]])
        if method == "unasked":  # lookups answered from the presence filter
            s.count_unasked(int(args[0]), int(args[1]))
            return None
        if method == "summary":
            return s.summary()
        raise StoreError(f"unknown method {method!r}")

    def _arena_name(self) -> str:
        # Slots are only meaningful in this arena: an engine that maps another
        # (the store restarted) must attach this one first.
        return self.store.arena.name if self.store.arena is not None else ""

    def _disconnect(self, conn: _Conn) -> None:
        for lease in conn.leases:
            self.store.release(lease)
        if conn.reserved and self.store.index is not None:
            self.store.abandon(conn.reserved)


_WRITTEN = list[Written]


class ConnectionLost(StoreError):
    """The connection failed with the call in flight (or could not be made).
    ``reused``: it was opened before the call."""

    def __init__(self, message: str, reused: bool) -> None:
        super().__init__(message)
        self.reused = reused


@dataclass(frozen=True)
class Pending:
    """A call sent on connection ``conn`` as its ``seq``-th frame, its answer not
    yet read (``StoreClient.answer``)."""

    conn: int
    seq: int
    reused: bool  # the connection was open before the call


class StoreClient:
    """Blocking client for engine processes, safe to share between threads.

    ``call`` sends a call and waits for its answer. ``send`` and ``answer`` split
    it, so a call can be in flight while its caller works (an engine's step
    sends its ``reserve`` before the forward pass and reads the slots after it).
    The server answers a connection's calls in the order they came, so answers
    are matched to calls by their place: a thread reading the next answer keeps
    another thread's for it. A connection that fails fails every call in flight
    on it; the next call opens a new one."""

    def __init__(self, path: str, timeout_s: float = 5.0) -> None:
        self.path, self._timeout = path, timeout_s
        self._sock: socket.socket | None = None
        self._conn = 0  # which connection: each failure or close moves it on
        self._sent = self._read = 0  # frames sent and answers read on it
        self._answers: dict[int, tuple[bool, Any]] = {}  # read, not yet taken
        self._state = threading.Lock()  # the fields above
        self._sending = threading.Lock()  # a frame goes out whole, in seq order
        self._reading = threading.Lock()  # one reader at a time
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()

    def call(self, method: str, *args: Any) -> Any:
        try:
            return self.answer(self.send(method, *args))
        except ConnectionLost as e:
            # A connection kept from a store that has since restarted fails on
            # first use: the server never ran the call (or undid it when the
            # connection dropped), so try a new one.
            if not e.reused:
                raise
        return self.answer(self.send(method, *args))

    def send(self, method: str, *args: Any) -> Pending:
        """Sends a call without waiting for its answer; every ``Pending`` must
        be answered (or the connection closed), in any order."""
        with self._sending:
            payload = self._enc.encode([method, list(args)])
            with self._state:
                reused = self._sock is not None
                try:
                    sock = self._connect_locked()
                except OSError as e:
                    raise ConnectionLost(f"kv store at {self.path}: {e}", False) from e
                pending = Pending(self._conn, self._sent, reused)
                self._sent += 1
            try:
                sock.sendall(_LEN.pack(len(payload)) + payload)
            except OSError as e:
                self._lose(pending.conn)
                raise ConnectionLost(f"kv store at {self.path}: {e}", reused) from e
        return pending

    def answer(self, pending: Pending) -> Any:
        """The result of a call sent with ``send``: StoreError if the store
        refused it or the connection failed before its answer came."""
        with self._reading:
            while True:
                with self._state:
                    if pending.conn != self._conn:
                        raise ConnectionLost(
                            f"kv store at {self.path}: connection lost",
                            pending.reused,
                        )
                    if pending.seq in self._answers:
                        ok, result = self._answers.pop(pending.seq)
                        break
                    sock = self._sock
                    assert sock is not None  # open while its calls are in flight
                try:
                    (n,) = _LEN.unpack(self._recv(sock, _LEN.size))
                    answer = self._dec.decode(self._recv(sock, n))
                except OSError as e:
                    self._lose(pending.conn)
                    raise ConnectionLost(
                        f"kv store at {self.path}: {e}", pending.reused
                    ) from e
                with self._state:
                    if self._conn == pending.conn:
                        self._answers[self._read] = answer
                        self._read += 1
        if not ok:
            raise StoreError(result)
        return result

    def open(self, page_bytes: int, layout: str) -> ArenaInfo:
        name, num_pages, arena_bytes = self.call("open", page_bytes, layout)
        return ArenaInfo(str(name), int(num_pages), int(arena_bytes))

    def lookup(self, query: Query) -> Found:
        """Pins the run ``query`` asks for; ``Found`` says which pages."""
        return msgspec.convert(self.call("lookup", *query.wire()), Found)

    def send_lookup(self, query: Query) -> Pending:
        """``lookup``, its answer read later with ``found``."""
        return self.send("lookup", *query.wire())

    def found(self, pending: Pending) -> Found:
        """The answer to a ``send_lookup``."""
        return msgspec.convert(self.answer(pending), Found)

    def release(self, *leases: str) -> None:
        self.call("release", *leases)

    def reserve(self, hashes: Sequence[bytes]) -> Reserved:
        return msgspec.convert(self.call("reserve", list(hashes)), Reserved)

    def send_reserve(self, hashes: Sequence[bytes]) -> Pending:
        """``reserve``, its answer read later with ``reserved``."""
        return self.send("reserve", list(hashes))

    def reserved(self, pending: Pending) -> Reserved:
        return msgspec.convert(self.answer(pending), Reserved)

    def commit(self, written: Sequence[Written], arena: str) -> None:
        """Publishes pages written into ``arena``'s slots that this connection
        reserved (refused if the store's arena is another, as after a restart,
        or a slot was reserved on a connection since lost)."""
        self.call("commit", list(written), arena)

    def abandon(self, slots: Sequence[int]) -> None:
        self.call("abandon", list(slots))

    def drop(self, hashes: Sequence[bytes]) -> None:
        self.call("drop", list(hashes))

    def send_unasked(self, lookups: int, pages: int) -> Pending:
        """Reports lookups answered from the presence filter (nothing found), to
        be counted as made; the answer says only that it arrived."""
        return self.send("unasked", lookups, pages)

    def close(self) -> None:
        """Closes the connection; calls in flight on it fail."""
        with self._state:
            conn = self._conn
        self._lose(conn)

    def _lose(self, conn: int) -> None:
        """Closes connection ``conn`` if it is still the current one."""
        with self._state:
            if conn != self._conn:
                return
            self._conn += 1
            sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked on it
            sock.close()

    def _connect_locked(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
            self._sent = self._read = 0
            self._answers.clear()
        return self._sock

    @staticmethod
    def _recv(sock: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the store closed the connection")
            buf += chunk
        return bytes(buf)
