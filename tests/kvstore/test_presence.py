"""The page presence filter: never lacks a page added to it, forgets pages only by
a rebuild, and is trusted only while its owner keeps renewing it."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator

import pytest

from kvstore import presence
from kvstore.presence import PresenceFilter, PresenceView, bits_for

PAGES = [hashlib.sha256(str(i).encode()).digest() for i in range(6000)]


@pytest.fixture
def pair() -> Iterator[tuple[PresenceFilter, PresenceView]]:
    name = presence.presence_name(f"moe-test-{uuid.uuid4().hex[:8]}")
    store = PresenceFilter(name, bits_for(1000))
    view = PresenceView(name)
    try:
        yield store, view
    finally:
        view.close()
        store.close()


def test_every_page_added_is_held_and_few_others_seem_to_be(
    pair: tuple[PresenceFilter, PresenceView],
) -> None:
    store, view = pair
    store.renew(60)
    added, others = PAGES[:2000], PAGES[2000:]
    for h in added:
        store.add(h)
    assert all(view.may_hold(h) for h in added)
    # 2,000 pages in 2**16 bits: about 1 in 270 false positives.
    assert sum(view.may_hold(h) for h in others) < 0.01 * len(others)
    # A hash shorter than two words (not vLLM's) is spread out first.
    store.add(b"short")
    assert view.may_hold(b"short")


def test_a_filter_its_owner_does_not_renew_holds_everything(
    pair: tuple[PresenceFilter, PresenceView],
) -> None:
    store, view = pair
    assert view.may_hold(PAGES[0])  # never renewed: not to be trusted yet
    store.renew(60)
    assert not view.may_hold(PAGES[0])
    store.renew(-1)  # its validity ran out: the store stopped renewing it
    assert view.may_hold(PAGES[0])
    store.renew(60)
    store.close()  # closing says so at once, to engines still mapping it
    assert view.may_hold(PAGES[0])


def test_a_rebuild_forgets_what_left_and_keeps_what_is_held(
    pair: tuple[PresenceFilter, PresenceView],
) -> None:
    store, view = pair
    store.renew(60)
    for h in PAGES[:100]:
        store.add(h)
    for _ in range(60):
        store.gone()
    assert not store.due(live=100)
    for _ in range(41):
        store.gone()
    assert store.due(live=100)  # more pages gone than held
    store.rebuild(PAGES[50:100])
    assert store.generation == 1 and not store.due(live=50)
    assert all(view.may_hold(h) for h in PAGES[50:100])
    assert sum(view.may_hold(h) for h in PAGES[:50]) <= 1
    store.add(PAGES[0])  # added to the half now in use
    assert view.may_hold(PAGES[0])
    store.rebuild([])
    assert store.generation == 2 and not view.may_hold(PAGES[0])


def test_pages_added_past_a_32nd_of_the_bits_call_for_a_rebuild(
    pair: tuple[PresenceFilter, PresenceView],
) -> None:
    store, _ = pair
    for h in PAGES[: store.bits // 32]:
        store.add(h)
    assert not store.due(live=len(PAGES))
    store.add(PAGES[-1])
    assert store.due(live=len(PAGES))
    # Rebuilt as full as that (other nodes hold that many pages), it is not due
    # again at once: only once it has taken as many pages more.
    n = store.bits // 32 + 1
    store.rebuild(PAGES[:n])
    assert not store.due(live=n)
    for h in PAGES[n : 2 * n + 1]:
        store.add(h)
    assert store.due(live=n)


def test_a_reader_that_sees_the_generation_move_takes_the_page_as_held(
    pair: tuple[PresenceFilter, PresenceView], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, view = pair
    store.renew(60)
    assert not view.may_hold(PAGES[0])
    real = presence._positions

    def rebuilt_meanwhile(h: bytes, mask: int) -> tuple[int, int]:
        store.rebuild([])  # the store moves the generation on mid-probe
        return real(h, mask)

    monkeypatch.setattr(presence, "_positions", rebuilt_meanwhile)
    assert view.may_hold(PAGES[0])


def test_sizes_and_attaching() -> None:
    assert bits_for(1) == presence.MIN_LOG2
    assert bits_for(1000) == 16  # 64,000 bits wanted
    assert bits_for(1025) == 17
    assert bits_for(1 << 40) == presence.MAX_LOG2
    with pytest.raises(ValueError, match="log2_bits"):
        PresenceFilter("moe-test-bad", presence.MAX_LOG2 + 1)
    assert presence.attach("") is None
    assert presence.attach(f"moe-test-{uuid.uuid4().hex[:8]}") is None  # none there
