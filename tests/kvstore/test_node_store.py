"""The node store's bookkeeping: leases, change log, hot prefixes, export/import."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore import presence
from kvstore.block_hash import BlockHash
from kvstore.node_store import ChangeLog, Changes, LayoutMismatch, NodeStore

H = [BlockHash(bytes([i]) * 32) for i in range(16)]
PAGE = 64


@pytest.fixture
def store() -> Iterator[NodeStore]:
    s = NodeStore(f"moe-test-{uuid.uuid4().hex[:8]}", 4 * PAGE)
    s.open(PAGE, "layout-a")
    yield s
    s.close()


def put(store: NodeStore, hashes: list[BlockHash], fill: int = 1) -> None:
    assert store.arena is not None
    slots = store.reserve(hashes)
    store.commit(
        (slot, store.arena.write(slot, np.full(PAGE, fill + i, np.uint8)))
        for i, slot in enumerate(slots)
        if slot is not None
    )


def test_the_first_engine_sizes_the_arena_and_others_must_match() -> None:
    s = NodeStore(f"moe-test-{uuid.uuid4().hex[:8]}", 1000)
    with pytest.raises(RuntimeError, match="no arena"):
        s.lookup("r", H[:1])
    try:
        info = s.open(300, "a")
        assert (info.num_pages, info.page_bytes) == (3, 300)  # 900 of 1000 bytes
        assert s.open(300, "a") == info
        with pytest.raises(LayoutMismatch):
            s.open(300, "b")
        with pytest.raises(LayoutMismatch):
            s.open(200, "a")
    finally:
        s.close()
    with pytest.raises(ValueError, match="holds no page"):
        NodeStore("x", 10).open(64, "a")


def test_a_lease_pins_what_a_lookup_found_until_released(store: NodeStore) -> None:
    put(store, H[:4])
    found = store.lookup("req-1", [H[0], H[1], H[9]])
    assert [r.page_hash for r in found] == H[:2]
    assert store.reserve([H[5], H[6]]) != [None, None]  # evicts H2, H3 only
    assert H[0] in store.index and H[1] in store.index  # type: ignore[operator]
    store.release("req-1")
    store.release("req-1")  # idempotent
    assert store.reserve([H[7]]) != [None]  # now H0 may go


def test_a_new_lookup_under_the_same_lease_replaces_its_pins(store: NodeStore) -> None:
    put(store, H[:4])
    store.lookup("r", H[:4])
    store.lookup("r", H[:1])
    assert store.summary()["leases"] == 1
    slots = store.reserve(H[4:7])
    assert None not in slots  # H1..H3 were unpinned and evicted


def test_changes_report_additions_removals_and_evictions(store: NodeStore) -> None:
    put(store, H[:3])
    c = store.changes(0)
    assert (c.full, c.added, c.removed) == (False, tuple(H[:3]), ())
    put(store, H[3:6])  # 4 pages: H0 and H1 are evicted (least recently used)
    store.drop([H[2]])
    c2 = store.changes(c.seq)
    assert set(c2.added) == set(H[3:6]) and set(c2.removed) == set(H[:3])
    full = store.changes(-1)
    assert full.full and set(full.added) == set(H[3:6])


def test_a_change_log_reader_too_far_behind_gets_everything() -> None:
    items = {1, 2, 3}
    log: ChangeLog[int] = ChangeLog(lambda: sorted(items), limit=2)
    for i in (1, 2, 3):
        log.record(True, i)
    assert log.since(1) == Changes(3, False, (2, 3))
    assert log.since(0) == Changes(3, True, (1, 2, 3))  # entry 1 was trimmed
    assert log.since(7) == Changes(3, True, (1, 2, 3))  # another incarnation's seq
    log.record(False, 2)
    assert log.since(3) == Changes(4, False, (), (2,))
    assert log.since(2) == Changes(4, False, (3,), (2,))  # 2 added, then removed


def test_hot_prefixes_count_hits_and_keep_the_most_seen() -> None:
    s = NodeStore(f"moe-test-{uuid.uuid4().hex[:8]}", 4 * PAGE)
    s.open(PAGE, "a")
    s.hot.limit = 2
    try:
        put(s, H[:2])
        tokens = list(range(40))
        for _ in range(3):
            s.lookup("r", H[:2], "t1", tokens, 16)
        s.lookup("r", H[:1], "", tokens, 16)
        s.lookup("r", H[:1], "t2", tokens, 16)  # replaces the least seen
        top = s.hot.top(5)
        assert top[0] == (("t1", tuple(range(32))), 3)
        assert len(top) == 2 and top[1][0] == ("t2", tuple(range(16)))
        s.drop([H[1]])  # t1's prefix ended on H1: nothing left to warm up
        assert [k for k, _ in s.hot.top(5)] == [("t2", tuple(range(16)))]
    finally:
        s.close()


def test_export_stops_at_a_corrupt_page_and_drops_it(store: NodeStore) -> None:
    put(store, H[:3])
    assert store.arena is not None
    ref = store.index.lookup([H[1]])[0]  # type: ignore[union-attr]
    store.arena.page(ref.index)[0] ^= 0xFF
    got, pages = store.export(H[:3])
    assert got == [H[0]] and pages.shape == (1, PAGE)
    assert int(pages[0, 0]) == 1
    assert H[1] not in store.index  # type: ignore[operator]
    assert store.summary()["dropped_pages"] == 1


def test_import_stores_new_pages_only(store: NodeStore) -> None:
    put(store, H[:1])
    pages = np.stack([np.full(PAGE, 9, np.uint8), np.full(PAGE, 8, np.uint8)])
    assert store.import_pages([H[0], H[1]], pages) == 1
    got, out = store.export(H[:2])
    assert got == H[:2] and int(out[0, 0]) == 1 and int(out[1, 0]) == 8


def test_a_lookup_waiting_for_a_fetch_pins_and_counts_nothing(
    store: NodeStore,
) -> None:
    put(store, H[:1])
    asked: list[int] = []

    def fetching(hashes: object, first: int) -> bool:
        asked.append(first)
        return True

    before = store.summary()
    assert store.lookup("r", H[:3], "t", list(range(48)), 16, fetching) is None
    assert asked == [1]
    after = store.summary()
    assert after["leases"] == 0 and after["lookups"] == before["lookups"]
    assert store.hot.top(1) == []  # counted once the pages are here, not twice
    assert store.lookup("r", H[:1], on_miss=fetching) == store.index.lookup(H[:1])  # type: ignore[union-attr]
    assert asked == [1]  # nothing missing: not asked


def test_a_caching_engine_is_offered_and_counted_only_what_the_store_adds(
    store: NodeStore,
) -> None:
    put(store, [H[1], H[2]])  # H0 was evicted here; the engine still holds it
    before = store.summary()
    found = store.lookup("r", [H[0], H[1], H[2], H[3]], skip=1)
    assert [r.page_hash for r in found] == [H[1], H[2]]  # not hidden by H0
    after = store.summary()
    assert after["hit_pages"] - before["hit_pages"] == 2
    assert after["miss_pages"] - before["miss_pages"] == 1  # H3 only
    # Told where the store's run ends, counted from the prompt's first block.
    misses: list[int] = []
    store.lookup(
        "r", [H[0], H[1], H[3]], skip=1, on_miss=lambda h, at: bool(misses.append(at))
    )
    assert misses == [2]
    assert store.lookup("r", [H[0], H[1]], skip=2) == []
    # A prefix the engine served itself is hot all the same (its last page is
    # here); one whose last page is not is not.
    tokens = list(range(8))
    store.lookup("r", [H[0], H[1]], "", tokens, 4, skip=2)
    store.lookup("r", [H[0], H[5]], "", tokens, 4, skip=2)
    assert store.hot.top(2) == [(("", tuple(tokens)), 1)]
    with pytest.raises(ValueError, match="skip"):
        store.lookup("r", [H[0]], skip=2)


def test_the_presence_filter_holds_what_a_lookup_could_be_answered_from() -> None:
    elsewhere = [BlockHash(bytes([99]) * 32)]  # another node's page
    s = NodeStore(f"moe-test-{uuid.uuid4().hex[:8]}", 4 * PAGE, lambda: elsewhere)
    try:
        s.open(PAGE, "layout-a")
        assert s.presence is not None and s.arena is not None
        view = presence.attach(s.arena.name)
        assert view is not None
        try:
            assert view.may_hold(H[0])  # not renewed yet: every page may be held
            s.maintain_presence(60)
            assert view.may_hold(elsewhere[0]) and not view.may_hold(H[0])
            put(s, H[:2])  # in the filter once committed
            assert view.may_hold(H[0]) and view.may_hold(H[1])
            s.add_elsewhere(H[9])  # the directory says another node has it now
            assert view.may_hold(H[9])
            # More pages than the arena holds evict the first: once more pages
            # have gone than it holds (and at least 64), the next renewal
            # rebuilds the filter from what is held.
            more = [BlockHash(bytes([200, i]) * 16) for i in range(66)]
            for at in range(0, len(more), 4):
                put(s, more[at : at + 4])
            assert view.may_hold(H[0])  # gone, still in the filter
            s.maintain_presence(60)
            assert s.presence.generation == 1  # built at open; 64 gone: not yet
            s.gone_elsewhere()  # and the other node's H[9]
            s.maintain_presence(60)
            assert s.presence.generation == 2
            assert not view.may_hold(H[0]) and not view.may_hold(H[9])
            assert all(view.may_hold(h) for h in more[-4:])
            assert view.may_hold(elsewhere[0])
            # Lookups an engine answered from the filter count as misses.
            before = s.summary()
            s.count_unasked(3, 7)
            after = s.summary()
            assert after["lookups"] - before["lookups"] == 3
            assert after["miss_pages"] - before["miss_pages"] == 7
            s.close()  # engines stop trusting it at once
            assert view.may_hold(H[0])
        finally:
            view.close()
    finally:
        s.close()
