"""The node store's Unix socket: calls, errors, and cleanup when an engine dies."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import presence
from kvstore.arena import Arena
from kvstore.block_hash import BlockHash
from kvstore.node_store import NodeStore
from kvstore.rpc import Found, Query, StoreClient, StoreError, StoreServer, Written
from tests.waiting import wait_until

H = [BlockHash(bytes([i]) * 32) for i in range(8)]
PAGE = 128


class Running:
    """A node store served on its own event loop thread, as the store actor does."""

    def __init__(
        self,
        path: str,
        on_miss: Any = None,
        capacity_bytes: int = 4 * PAGE,
        sync_interval_s: float = 0.0,
    ) -> None:
        """``sync_interval_s``: keep the presence filter up as the store actor
        does, every that many seconds (0: never, so engines look every prompt up)."""
        self.store = NodeStore(f"moe-test-{uuid.uuid4().hex[:8]}", capacity_bytes)
        self.server = StoreServer(self.store, path, on_miss)
        self.loop = asyncio.new_event_loop()
        self._maintainer: asyncio.Task[None] | None = None
        started = threading.Event()

        async def maintain() -> None:
            while True:
                self.store.maintain_presence(sync_interval_s)
                await asyncio.sleep(sync_interval_s)

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.start())
            if sync_interval_s > 0:
                self._maintainer = self.loop.create_task(maintain())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(5)

    def stop(self) -> None:
        if self._maintainer is not None:
            self.loop.call_soon_threadsafe(self._maintainer.cancel)
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.store.close()


def published(
    client: StoreClient, hashes: Sequence[bytes], block_size: int, timeout_s: float
) -> Found:
    """The stored run of ``hashes``, once all are published (or the time is up):
    an engine's connector publishes from a background thread."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = client.lookup(Query("probe", hashes, "", [], block_size, 0))
        client.release("probe")
        if len(found.refs) == len(hashes) or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[NodeStore, str, list[int]]]:
    misses: list[int] = []

    def on_miss(hashes: list[BlockHash], first: int) -> bool:
        misses.append(first)
        return hashes[first] == H[1]  # pretend another node holds H1

    path = str(tmp_path / "store.sock")
    running = Running(path, on_miss)
    yield running.store, path, misses
    running.stop()


@contextmanager
def connected(path: str) -> Iterator[tuple[StoreClient, Arena]]:
    """A client that opened the store, and the arena it maps (as an engine),
    both closed at the end."""
    c = StoreClient(path)
    arena = Arena.attach(*c.call("open", PAGE, "layout"))
    try:
        yield c, arena
    finally:
        c.close()
        arena.close()


def test_an_engine_opens_writes_commits_and_finds_pages(
    served: tuple[NodeStore, str, list[int]],
) -> None:
    store, path, misses = served
    with connected(path) as (c, arena):
        slots, name = c.call("reserve", [H[0], H[2]])
        assert name == arena.name
        crcs = [arena.write(s, np.full(PAGE, 7, np.uint8)) for s in slots]
        c.call("commit", list(zip(slots, crcs, strict=True)))
        refs, pending, name, fetch = c.call("lookup", "r1", [H[0], H[3]], "", [], 16)
        assert name == arena.name
        assert [r[1] for r in refs] == [H[0]] and not pending  # nobody has H3
        assert fetch is None  # nothing here was fetched from another node
        assert misses == [1]
        refs, pending, _, _ = c.call("lookup", "r2", [H[0], H[1]], "", [], 16)
        assert refs == [] and pending  # fetching: nothing held meanwhile
        assert store.summary()["leases"] == 1
        c.call("release", "r1")
        assert store.summary()["leases"] == 0
        with pytest.raises(StoreError, match="unknown method"):
            c.call("nonsense")
        with pytest.raises(StoreError, match="LayoutMismatch"):
            c.call("open", PAGE, "another model")


def test_a_dead_engines_pins_and_reservations_are_given_back(
    served: tuple[NodeStore, str, list[int]],
) -> None:
    store, path, _ = served
    with connected(path) as (c, arena):
        slot = c.call("reserve", [H[0]])[0][0]
        c.call("commit", [[slot, arena.write(slot, np.zeros(PAGE, np.uint8))]])
        c.call("lookup", "r", [H[0]], "", [], 16)
        c.call("reserve", [H[1], H[2], H[3]])  # never committed
        c.close()  # the engine dies
        for _ in range(100):
            if store.summary()["leases"] == 0:
                break
            threading.Event().wait(0.02)
        assert store.summary()["leases"] == 0
        other = StoreClient(path)
        assert None not in other.call("reserve", [H[4], H[5], H[6]])[0]
        other.close()


def test_an_unreachable_store_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        StoreClient(str(tmp_path / "none.sock")).call("summary")


def test_a_client_reconnects_to_a_store_that_restarted(tmp_path: Path) -> None:
    path = str(tmp_path / "store.sock")
    first = Running(path)
    c = StoreClient(path)
    name1 = c.call("open", PAGE, "layout")[0]
    first.stop()
    second = Running(path)
    try:
        name2 = c.call("open", PAGE, "layout")[0]  # the old connection is dead
        assert name2 != name1
    finally:
        c.close()
        second.stop()


def test_calls_in_flight_from_two_threads_each_get_their_own_answer(
    served: tuple[NodeStore, str, list[int]],
) -> None:
    _, path, _ = served
    with connected(path) as (c, arena):
        first = c.send_reserve([H[0]])  # in flight while another thread calls
        second = c.send_reserve([H[2], H[3]])
        answers: list[Any] = []
        thread = threading.Thread(target=lambda: answers.append(c.reserve([H[5]])))
        thread.start()  # reads the two answers before its own, and keeps them
        thread.join(5)
        [other] = answers
        assert len(other.slots) == 1 and other.arena == arena.name
        assert len(c.reserved(second).slots) == 2
        assert len(c.reserved(first).slots) == 1
        with pytest.raises(StoreError, match="unknown method"):
            c.answer(c.send("nonsense"))  # a refusal is this call's alone
        assert c.call("summary")["writing"] == 4  # every slot of the arena


def test_calls_in_flight_fail_with_their_connection_and_the_next_opens_another(
    served: tuple[NodeStore, str, list[int]],
) -> None:
    store, path, _ = served
    with connected(path) as (c, _):
        pending = c.send_reserve([H[0]])
        c.close()
        with pytest.raises(StoreError, match="connection lost"):
            c.reserved(pending)
        for _ in range(100):  # the server gives the lost call's slot back
            if store.summary()["writing"] == 0:
                break
            threading.Event().wait(0.02)
        assert store.summary()["writing"] == 0
        assert c.reserve([H[0]]).slots == [0]  # on a new connection


def test_a_commit_into_another_arena_is_refused(
    served: tuple[NodeStore, str, list[int]],
) -> None:
    store, path, _ = served
    with connected(path) as (c, arena):
        [slot] = c.reserve([H[0]]).slots
        assert slot is not None
        written = [Written(slot, arena.write(slot, np.ones(PAGE, np.uint8)))]
        with pytest.raises(StoreError, match="not this store's"):
            c.commit(written, "an arena of a store that restarted")
        assert store.summary()["pages"] == 0
        c.commit(written, arena.name)
        assert store.summary()["pages"] == 1


def test_a_commit_of_slots_reserved_on_another_connection_is_refused(
    served: tuple[NodeStore, str, list[int]],
) -> None:
    store, path, _ = served
    other = StoreClient(path)
    with connected(path) as (c, arena):
        [slot] = c.reserve([H[0]]).slots
        assert slot is not None
        written = [Written(slot, arena.write(slot, np.ones(PAGE, np.uint8)))]
        # A connection lost after its reserve gives the slot back, and the
        # slot may be another engine's by the time a new connection commits it.
        with pytest.raises(StoreError, match="not reserved on this connection"):
            other.commit(written, arena.name)
        assert store.summary()["pages"] == 0
        c.commit(written, arena.name)
        assert store.summary()["pages"] == 1
    other.close()


def test_a_committed_page_is_in_the_filter_before_the_commit_is_answered(
    tmp_path: Path,
) -> None:
    running = Running(str(tmp_path / "store.sock"), sync_interval_s=0.05)
    try:
        with connected(running.server.path) as (c, arena):
            view = presence.attach(arena.name)
            assert view is not None
            try:
                wait_until(lambda: not view.may_hold(H[0]), 5, "the filter renewed")
                [slot] = c.reserve(H[:1]).slots
                assert slot is not None and not view.may_hold(H[0])
                page = np.full(PAGE, 5, np.uint8)
                c.commit([Written(slot, arena.write(slot, page))], arena.name)
                assert view.may_hold(H[0])
                # Lookups an engine answered from the filter count as misses.
                c.send_unasked(2, 5)
                summary = c.call("summary")
                assert (summary["lookups"], summary["miss_pages"]) == (2, 5)
            finally:
                view.close()
    finally:
        running.stop()
    # A store that stopped removed its filter (and told readers first).
    assert presence.attach(arena.name) is None
