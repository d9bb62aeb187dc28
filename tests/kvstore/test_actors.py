"""The store and directory actors as plain objects on one event loop: a node store
serves its socket, publishes its change log to the directory and mirrors it back
(the Ray calls between them replaced by direct calls)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from cluster.config import KVStoreConfig
from kvstore import actor as kv_actor
from kvstore import presence
from kvstore.arena import Arena
from kvstore.block_hash import block_hashes
from kvstore.rpc import StoreClient, Written
from tests.waiting import until

PAGE = 256


class Remote:
    """``handle.method.remote(...)`` on a plain object, awaited as Ray's is;
    ``calls`` counts them."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        method: Callable[..., Any] = getattr(self._target, name)

        async def call(*args: Any) -> Any:
            self.calls += 1
            return method(*args)

        return type("Method", (), {"remote": staticmethod(call)})


def _store(
    sync_interval_s: float,
) -> tuple[kv_actor.NodeStoreActor, kv_actor.KVDirectoryActor, Remote]:
    """A node store of a new app, syncing with a directory through ``Remote``
    (what ``kv_actor.directory(app)`` returns), which counts the calls."""
    app = f"unit-{uuid.uuid4().hex[:8]}"
    directory = kv_actor.KVDirectoryActor()
    config = KVStoreConfig(capacity_bytes=8 * PAGE, sync_interval_s=sync_interval_s)
    store = kv_actor.NodeStoreActor(app, "node-a", config)
    remote = Remote(directory)
    store._directory = remote
    return store, directory, remote


async def test_a_store_publishes_its_pages_and_mirrors_the_directory() -> None:
    store, directory, remote = _store(sync_interval_s=3600)
    try:
        socket = await store.start()
        hashes = list(block_hashes(list(range(3 * 16)), 16))
        rows = np.random.default_rng(0).integers(0, 255, (3, PAGE), dtype=np.uint8)

        def save() -> None:  # an engine's connector, on its own thread
            client = StoreClient(socket)
            info = client.open(PAGE, "layout")
            arena = Arena.attach(info.name, info.num_pages, info.page_bytes)
            reserved = client.reserve(hashes)
            client.commit(
                [
                    Written(slot, arena.write(slot, rows[i]))
                    for i, slot in enumerate(reserved.slots)
                    if slot is not None
                ],
                arena.name,
            )
            client.close()
            arena.close()

        await asyncio.to_thread(save)
        assert store.summary()["pages"] == 3
        inc, changes = store.changes("", -1)
        assert changes.full and set(changes.added) == set(hashes)
        assert store.changes(inc, changes.seq)[1].added == ()  # nothing since

        await store.sync()
        assert directory.summary() == {"node-a": 3}
        assert store.mirror.locate(hashes) == ("node-a", 3)
        _, log = directory.changes("", -1)
        assert set(log.added) == {("node-a", h) for h in hashes}
        # One round trip a sync: the changes since the last, and the mirror's.
        calls = remote.calls
        await store.sync()
        assert remote.calls == calls + 1 and directory.summary() == {"node-a": 3}

        # A directory that restarted holds nothing: the store's changes since
        # its last sync (none) do not follow from that, so it sends everything.
        directory = kv_actor.KVDirectoryActor()
        remote = Remote(directory)
        store._directory = remote
        await store.sync()
        assert remote.calls == 2 and directory.summary() == {"node-a": 3}
        assert store.mirror.locate(hashes) == ("node-a", 3)
        await store.sync()
        assert remote.calls == 3

        got, pages = store.export(hashes)  # what another node fetches
        assert got == hashes and np.array_equal(pages, rows)
        # A flipped byte fails the page's checksum: the page is dropped, and an
        # export ends before it.
        assert store.corrupt(hashes[1])
        got, pages = store.export(hashes)
        assert got == hashes[:1] and np.array_equal(pages[0], rows[0])
        assert store.summary()["pages"] == 2
    finally:
        await store.shutdown()


async def test_a_store_with_nothing_to_publish_syncs_less_often() -> None:
    store, directory, remote = _store(sync_interval_s=0.02)
    hashes = list(block_hashes(list(range(16)), 16))
    try:
        socket = await store.start()
        await asyncio.sleep(0.2)  # 10 intervals; no engine has opened the arena
        assert 1 <= remote.calls <= 10 // kv_actor.IDLE_SYNC_EVERY + 1  # mirroring
        # An engine's connector, on its own thread: it opens the arena...
        client = StoreClient(socket)
        info = await asyncio.to_thread(client.open, PAGE, "layout")
        arena = Arena.attach(info.name, info.num_pages, info.page_bytes)
        opened_at = remote.calls
        await until(lambda: remote.calls > opened_at, "the open arena published")
        calls = remote.calls
        await asyncio.sleep(0.4)  # 20 intervals, nothing new
        quiet = remote.calls - calls
        assert 1 <= quiet <= 2 * 20 // kv_actor.IDLE_SYNC_EVERY

        def save() -> None:  # ...and saves a page
            [slot] = client.reserve(hashes).slots
            assert slot is not None
            page = np.ones(PAGE, np.uint8)
            client.commit([Written(slot, arena.write(slot, page))], arena.name)

        await asyncio.to_thread(save)
        await until(lambda: directory.summary() == {"node-a": 1}, "the page published")
        client.close()
        arena.close()
    finally:
        await store.shutdown()


async def test_the_presence_filter_holds_the_pages_other_nodes_hold() -> None:
    store_a, directory, _ = _store(sync_interval_s=0.05)
    config = KVStoreConfig(capacity_bytes=8 * PAGE, sync_interval_s=0.05)
    store_b = kv_actor.NodeStoreActor(store_a.app, "node-b", config)
    store_b._directory = Remote(directory)
    theirs = list(block_hashes(list(range(2 * 16)), 16))
    nobodys = list(block_hashes(list(range(100, 116)), 16))
    try:
        socket_a, socket_b = await store_a.start(), await store_b.start()

        def open_and_save(socket: str, hashes: list[Any]) -> str:
            client = StoreClient(socket)
            info = client.open(PAGE, "layout")
            arena = Arena.attach(info.name, info.num_pages, info.page_bytes)
            reserved = client.reserve(hashes)
            page = np.ones(PAGE, np.uint8)
            client.commit(
                [
                    Written(s, arena.write(s, page))
                    for s in reserved.slots
                    if s is not None
                ],
                arena.name,
            )
            client.close()
            arena.close()
            return info.name

        arena_a = await asyncio.to_thread(open_and_save, socket_a, [])
        await asyncio.to_thread(open_and_save, socket_b, theirs)
        view = presence.attach(arena_a)
        assert view is not None
        try:
            # Renewed as node-a syncs (until then every page may be held)...
            await until(lambda: not view.may_hold(nobodys[0]), "the filter renewed")
            # ...and node-b's pages come in as node-a's mirror learns them (a
            # lookup could fetch them).
            await until(lambda: view.may_hold(theirs[0]), "node-b's page in the filter")
            assert all(view.may_hold(h) for h in theirs)
            assert not view.may_hold(nobodys[0])
            # node-b's pages go: node-a's filter counts them gone, until a rebuild.
            store_b.store.drop(theirs)
            await store_b.sync()
            await store_a.sync()
            assert store_a.store.presence is not None
            assert store_a.store.presence.stale == len(theirs)
        finally:
            view.close()
    finally:
        await store_b.shutdown()
        await store_a.shutdown()
