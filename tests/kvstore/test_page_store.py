import pytest

from kvstore.block_hash import BlockHash
from kvstore.page_store import PageIndex, PageRef

H = [BlockHash(bytes([i]) * 32) for i in range(8)]


def _store(idx: PageIndex, h: BlockHash, checksum: int = 7) -> PageRef:
    slot = idx.allocate(h)
    assert slot is not None
    return idx.commit(slot, checksum)


def test_pages_are_visible_only_once_committed() -> None:
    idx = PageIndex(4)
    slot = idx.allocate(H[0])
    assert slot == 0
    assert idx.lookup([H[0]]) == [] and idx.allocate(H[0]) is None  # being written
    ref = idx.commit(slot, 123)
    assert ref == PageRef(0, H[0], 123)
    assert idx.lookup([H[0]]) == [ref] and idx.allocate(H[0]) is None  # stored


def test_lookup_returns_the_longest_prefix() -> None:
    idx = PageIndex(4)
    a, b, d = _store(idx, H[0]), _store(idx, H[1]), _store(idx, H[3])
    assert idx.lookup([H[0], H[1], H[2], H[3]]) == [a, b]  # H[2] missing: stop
    assert idx.lookup([H[3]]) == [d]


def test_lru_eviction_skips_pinned_pages_and_recently_used_ones() -> None:
    idx = PageIndex(3)
    refs = [_store(idx, H[i]) for i in range(3)]  # slots 0, 1, 2
    idx.lookup([H[0]])  # LRU order now H1, H2, H0
    idx.pin([refs[1]])
    assert idx.allocate(H[3]) == 2  # evicts H2: H1 is pinned, H0 was just used
    assert H[2] not in idx and idx.evictions == 1
    idx.commit(2, 1)  # LRU: H1, H0, H3
    idx.pin([refs[0]])
    assert idx.allocate(H[4]) == 2  # H1 and H0 pinned: H3 goes
    assert H[3] not in idx and idx.evictions == 2
    idx.pin([idx.commit(2, 1)])
    assert idx.allocate(H[5]) is None  # every page pinned: no room, nothing lost
    assert sorted(idx.hashes()) == sorted([H[0], H[1], H[4]])


def test_unpin_balances_pins() -> None:
    idx = PageIndex(1)
    ref = _store(idx, H[0])
    idx.pin([ref])
    idx.pin([ref])
    idx.unpin([ref])
    assert idx.allocate(H[1]) is None  # still pinned once
    idx.unpin([ref])
    assert idx.allocate(H[1]) == 0
    with pytest.raises(ValueError, match="not pinned"):
        idx.unpin([ref])


def test_dropping_a_pinned_page_frees_its_slot_at_unpin() -> None:
    idx = PageIndex(1)
    ref = _store(idx, H[0])
    idx.pin([ref])
    assert idx.drop(H[0]) and H[0] not in idx
    assert idx.allocate(H[1]) is None  # a reader still holds the slot
    idx.unpin([ref])
    assert idx.allocate(H[1]) == 0
    assert not idx.drop(H[7])


def test_pin_is_all_or_nothing() -> None:
    idx = PageIndex(2)
    a = _store(idx, H[0])
    stale = PageRef(1, H[1], 0)
    with pytest.raises(KeyError):
        idx.pin([a, stale])
    idx.drop(H[0])  # not pinned by the failed call: freed at once
    assert idx.allocate(H[2]) is not None
