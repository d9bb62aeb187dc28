"""The connector's scheduler side on a scripted store: what a request loads, what
each step saves, and that every pin is given back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvstore.connector_scheduler import Loads, PageLoad, PageSave, StoreScheduler
from kvstore.presence import PresenceFilter, bits_for, presence_name
from kvstore.rpc import Found, PageRef, Query, StoreError

B = 4  # tokens per block
H = [bytes([i]) * 32 for i in range(8)]


@dataclass
class ScriptedStore:
    """Answers ``lookup`` with the stored run of the hashes asked past ``skip``."""

    stored: list[bytes] = field(default_factory=list)
    pending: bool = False
    down: bool = False
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    arena: str = "arena-1"

    def lookup(self, q: Query) -> Found:
        hashes, skip = q.hashes, q.skip
        self.calls.append(("lookup", q.lease, tuple(hashes), q.salt, skip))
        if self.down:
            raise StoreError("store is gone")
        if self.pending:
            return Found([], True, self.arena)
        refs = []
        for i, h in enumerate(hashes[skip:]):
            if h not in self.stored:
                break
            refs.append(PageRef(100 + skip + i, h, 7 + i))
        return Found(refs, False, self.arena)

    def release(self, *leases: str) -> None:
        self.calls.append(("release", *leases))

    def send_lookup(self, q: Query) -> Found:
        """Answers at once (the store as it is when the request arrives); the
        answer stands for the pending call, which ``found`` reads."""
        found = self.lookup(q)
        self.calls[-1] = ("send_lookup", *self.calls[-1][1:])
        return found

    def found(self, pending: Found) -> Found:
        self.calls.append(("found",))
        return pending

    def send_unasked(self, lookups: int, pages: int) -> tuple[int, int]:
        self.calls.append(("send_unasked", lookups, pages))
        if self.down:
            raise StoreError("store is gone")
        return lookups, pages

    def answer(self, pending: Any) -> None:
        self.calls.append(("answer", pending))


@dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    block_hashes: list[bytes]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    prompt_token_ids: list[int] | None = None


def scheduler(
    store: ScriptedStore, **kw: Any
) -> tuple[StoreScheduler, list[Exception]]:
    """``kw``: the engine's (``engine_caches``, ``max_running``; by default no
    lookup on arrival)."""
    warnings: list[Exception] = []
    return StoreScheduler(store, B, warnings.append, **kw), warnings  # type: ignore[arg-type]


def kinds(store: ScriptedStore) -> list[str]:
    return [c[0] for c in store.calls]


def released(store: ScriptedStore) -> list[str]:
    return [c[1] for c in store.calls if c[0] == "release"]


def test_stored_blocks_are_offered_leaving_one_prompt_token_to_compute() -> None:
    store = ScriptedStore(stored=H[:4])
    s, _ = scheduler(store)
    # 16 tokens = 4 full blocks, but the last token is computed: 3 are offered.
    req = Req("r1", 4 * B, H[:4], prompt_token_ids=list(range(16)), cache_salt="t")
    assert s.get_num_new_matched_tokens(req, 0) == 3 * B
    assert store.calls[0] == ("lookup", "r1", tuple(H[:3]), "t", 0)
    # Asked again while it waits for room: no second lookup, same answer.
    assert s.get_num_new_matched_tokens(req, 0) == 3 * B
    assert len(store.calls) == 1


def test_only_what_the_engines_own_cache_lacks_is_loaded() -> None:
    store = ScriptedStore(stored=H[:4])
    s, _ = scheduler(store)
    req = Req("r1", 5 * B, H[:5])
    # The engine holds the first block itself: the store offers blocks 1..3.
    assert s.get_num_new_matched_tokens(req, B) == 3 * B
    s.on_new_request(req)
    s.update_state_after_alloc(req, [10, 11, 12, 13, 14], 3 * B)
    req.num_computed_tokens = 4 * B  # its own block and the 3 loaded ones
    loads, saves = s.plan_step({"r1": B}, lambda rid: [10, 11, 12, 13, 14])
    assert loads == {
        "r1": Loads(
            "arena-1",
            [
                PageLoad(101, 7, H[1], 11),
                PageLoad(102, 8, H[2], 12),
                PageLoad(103, 9, H[3], 13),
            ],
        )
    }
    # Loaded blocks are not saved back: only the one this step computes.
    assert saves == [PageSave(H[4], 14)]
    assert s.plan_step({}, None) == ({}, [])  # a load is planned once


def test_a_changed_cache_hit_drops_the_old_pin_and_asks_again() -> None:
    store = ScriptedStore(stored=H[:4])
    s, _ = scheduler(store)
    req = Req("r1", 5 * B, H[:5])
    s.get_num_new_matched_tokens(req, 0)
    assert s.get_num_new_matched_tokens(req, 2 * B) == 2 * B
    assert released(store) == ["r1"]
    assert [c[4] for c in store.calls if c[0] == "lookup"] == [0, 2]


def test_pages_on_their_way_from_another_node_make_the_request_wait() -> None:
    s, _ = scheduler(ScriptedStore(stored=H[:4], pending=True))
    assert s.get_num_new_matched_tokens(Req("r1", 5 * B, H[:5]), 0) is None


def test_an_allocation_that_takes_nothing_external_gives_the_pin_back() -> None:
    store = ScriptedStore(stored=H[:4])
    s, _ = scheduler(store)
    req = Req("r1", 5 * B, H[:5])
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, [0, 1, 2, 3, 4], 0)
    assert released(store) == ["r1"] and s.pinned() == set()


def test_a_request_finished_before_its_load_gives_the_pin_back() -> None:
    store = ScriptedStore(stored=H[:4])
    s, _ = scheduler(store)
    req = Req("r1", 5 * B, H[:5])
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, [0, 1, 2, 3, 4], 4 * B)
    assert s.pinned() == {"r1"}
    s.request_finished(req)
    assert released(store) == ["r1"] and s.pinned() == set()


def test_each_completed_block_is_saved_once_and_again_after_a_failed_load() -> None:
    s, _ = scheduler(ScriptedStore())
    req = Req("r1", 3 * B + 1, H[:3])
    s.on_new_request(req)
    blocks = [20, 21, 22, 23]
    _, saves = s.plan_step({"r1": 2 * B + 1}, lambda rid: blocks)
    assert saves == [PageSave(H[0], 20), PageSave(H[1], 21)]
    req.num_computed_tokens = 2 * B + 1
    _, saves = s.plan_step({"r1": B}, lambda rid: blocks)
    assert saves == [PageSave(H[2], 22)]
    # vLLM moved num_computed_tokens back to block 1 (its load failed): the
    # recomputed blocks are saved again.
    req.num_computed_tokens = B
    _, saves = s.plan_step({"r1": 2 * B}, lambda rid: blocks)
    assert saves == [PageSave(H[1], 21), PageSave(H[2], 22)]


def test_a_store_that_is_gone_costs_hits_not_requests() -> None:
    s, warnings = scheduler(ScriptedStore(stored=H[:4], down=True))
    assert s.get_num_new_matched_tokens(Req("r1", 5 * B, H[:5]), 0) == 0
    assert len(warnings) == 1 and isinstance(warnings[0], StoreError)


@pytest.mark.parametrize("prompt", [1, B])
def test_a_prompt_without_a_full_block_to_spare_asks_nothing(prompt: int) -> None:
    store = ScriptedStore(stored=H[:1])
    s, _ = scheduler(store)
    assert s.get_num_new_matched_tokens(Req("r1", prompt, H[: prompt // B]), 0) == 0
    assert store.calls == []


def test_requests_that_arrive_together_are_looked_up_as_they_arrive() -> None:
    store = ScriptedStore(stored=H[:4])
    s, _ = scheduler(store, max_running=8)
    r1 = Req("r1", 4 * B, H[:4], prompt_token_ids=list(range(16)), cache_salt="t")
    r2 = Req("r2", 3 * B, H[4:7])
    s.on_new_request(r1)
    s.on_new_request(r2)
    assert store.calls == [
        ("send_lookup", "r1", tuple(H[:3]), "t", 0),
        ("send_lookup", "r2", tuple(H[4:6]), "", 0),
    ]
    # The scheduler's asks read those answers: no lookup of their own.
    assert s.get_num_new_matched_tokens(r1, 0) == 3 * B
    assert s.get_num_new_matched_tokens(r2, 0) == 0
    assert s.get_num_new_matched_tokens(r1, 0) == 3 * B  # asked again: pinned
    assert kinds(store) == ["send_lookup", "send_lookup", "found", "found"]
    s.update_state_after_alloc(r1, [10, 11, 12, 13], 3 * B)
    loads, _ = s.plan_step({"r1": B}, lambda rid: [10, 11, 12, 13])
    assert [p.block_id for p in loads["r1"].pages] == [10, 11, 12]


def test_a_block_the_engine_holds_when_scheduled_is_asked_for_past_it() -> None:
    store = ScriptedStore(stored=H[:4])
    s, _ = scheduler(store, max_running=8)
    req = Req("r1", 5 * B, H[:5])
    s.on_new_request(req)  # pins blocks 0..3
    # By the time it is scheduled the engine holds block 0 (another request
    # computed it): what the arrival pinned is given back, and the store asked
    # past the engine's block.
    assert s.get_num_new_matched_tokens(req, B) == 3 * B
    assert kinds(store) == ["send_lookup", "found", "release", "lookup"]
    assert store.calls[-1][-1] == 1


def test_a_request_finished_before_it_was_scheduled_gives_back_its_pins() -> None:
    store = ScriptedStore(stored=H[:4])
    s, _ = scheduler(store, max_running=8)
    hit, miss = Req("r1", 5 * B, H[:5]), Req("r2", 5 * B, H[4:9])
    s.on_new_request(hit)
    s.on_new_request(miss)
    s.request_finished(hit)
    s.request_finished(miss)  # its lookup found (pinned) nothing
    assert released(store) == ["r1"] and s.pinned() == set()
    assert kinds(store).count("found") == 2  # every answer read


def test_an_engine_that_caches_asks_when_scheduled_for_a_first_block_seen_lately() -> (
    None
):
    store = ScriptedStore(stored=H[:4])
    s, _ = scheduler(store, engine_caches=True, max_running=8)
    s.on_new_request(Req("r1", 5 * B, H[:5]))
    s.on_new_request(Req("r2", 5 * B, H[:5]))  # the engine may hold its blocks
    assert [c[1] for c in store.calls if c[0] == "send_lookup"] == ["r1"]
    s.on_new_request(Req("r3", 5 * B, H[1:6]))  # another first block
    assert [c[1] for c in store.calls if c[0] == "send_lookup"] == ["r1", "r3"]


@pytest.mark.parametrize(("engine_blocks", "asked_early"), [(0, True), (5000, False)])
def test_first_blocks_are_remembered_for_as_many_requests_as_the_engine_has_blocks(
    engine_blocks: int, asked_early: bool
) -> None:
    store = ScriptedStore()
    s, _ = scheduler(
        store, engine_caches=True, max_running=10**6, engine_blocks=engine_blocks
    )
    for i in range(4500):  # more than the 4,096 remembered at least
        s.on_new_request(Req(f"r{i}", 2 * B, [i.to_bytes(32, "big")]))
    store.calls.clear()
    s.on_new_request(Req("again", 2 * B, [(0).to_bytes(32, "big")]))
    assert (store.calls != []) is asked_early


def test_a_request_that_may_wait_for_room_is_asked_for_when_scheduled() -> None:
    store = ScriptedStore(stored=H[:4])
    s, _ = scheduler(store, max_running=1)
    s.on_new_request(Req("r1", 5 * B, H[:5]))
    r2 = Req("r2", 5 * B, H[1:6])
    s.on_new_request(r2)  # the engine's batch is full: its pins would wait
    assert [c[1] for c in store.calls if c[0] == "send_lookup"] == ["r1"]
    assert s.get_num_new_matched_tokens(r2, 0) == 3 * B
    assert store.calls[-1][:2] == ("lookup", "r2")


def test_pages_on_their_way_when_it_arrived_are_asked_for_again() -> None:
    store = ScriptedStore(stored=H[:4], pending=True)
    s, _ = scheduler(store, max_running=8)
    req = Req("r1", 5 * B, H[:5])
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) is None
    store.pending = False  # fetched
    assert s.get_num_new_matched_tokens(req, 0) == 4 * B
    assert kinds(store) == ["send_lookup", "found", "lookup"]


def test_a_store_gone_when_a_request_arrives_warns_once_it_is_scheduled() -> None:
    store = ScriptedStore(stored=H[:4], down=True)
    s, warnings = scheduler(store, max_running=8)
    req = Req("r1", 5 * B, H[:5])
    s.on_new_request(req)
    assert warnings == []
    assert s.get_num_new_matched_tokens(req, 0) == 0
    assert len(warnings) == 1


def test_a_traced_request_has_lookup_and_fetch_in_its_trace() -> None:
    from cluster import tracing
    from kvstore.rpc import Fetch
    from tests.spans import named, recorder

    spans = recorder()
    with tracing.tracer().start_as_current_span("engine.generate") as parent:
        headers = tracing.carrier()
    store = ScriptedStore(stored=H[:4], pending=True)
    s, _ = scheduler(store)
    req = Req("r1", 5 * B, H[:5])
    req.trace_headers = headers  # type: ignore[attr-defined]
    assert s.get_num_new_matched_tokens(req, B) is None  # fetching: wait
    store.pending = False
    fetch = Fetch("node-b", 3, 3 * 4096, 0.02)
    lookup = store.lookup

    def answered_after_the_fetch(*args: Any) -> Found:
        found = lookup(*args)
        return Found(found.refs, False, found.arena, fetch)

    store.lookup = answered_after_the_fetch  # type: ignore[method-assign]
    assert s.get_num_new_matched_tokens(req, B) == 3 * B
    waited, done = named(spans, "kvstore.lookup")
    for span in (waited, done):
        assert span.parent is not None
        assert span.parent.span_id == parent.get_span_context().span_id
    assert "fetch.pending" in [e.name for e in waited.events]
    a = done.attributes or {}
    assert a["moe_cluster.kv.pages_asked"] == 4
    assert a["moe_cluster.kv.pages_in_engine"] == 1
    assert a["moe_cluster.kv.pages_found"] == 3
    assert a["moe_cluster.kv.fetch_wait_s"] >= 0
    assert (a["moe_cluster.kv.fetch.from_node"], a["moe_cluster.kv.fetch.bytes"]) == (
        "node-b",
        3 * 4096,
    )
    # The load planned for it carries the trace on to the worker.
    s.update_state_after_alloc(req, [10, 11, 12, 13, 14], 3 * B)
    loads, _ = s.plan_step({}, None)
    assert loads["r1"].trace == headers


def test_an_untraced_request_makes_no_spans() -> None:
    from tests.spans import named, recorder

    spans = recorder()
    s, _ = scheduler(ScriptedStore(stored=H[:4]))
    assert s.get_num_new_matched_tokens(Req("r1", 5 * B, H[:5]), 0) == 4 * B
    assert named(spans, "kvstore.lookup") == []


@pytest.fixture
def filtered() -> Iterator[tuple[ScriptedStore, PresenceFilter]]:
    """A store holding H[0..3] whose presence filter (renewed) says so."""
    arena = f"moe-test-{uuid.uuid4().hex[:8]}"
    presence = PresenceFilter(presence_name(arena), bits_for(16))
    for h in H[:4]:
        presence.add(h)
    presence.renew(60)
    try:
        yield ScriptedStore(stored=H[:4], arena=arena), presence
    finally:
        presence.close()


def test_a_prompt_the_store_surely_lacks_is_answered_with_no_call(
    filtered: tuple[ScriptedStore, PresenceFilter], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = filtered
    s, _ = scheduler(store, max_running=8)
    # Until an answer names the store's arena, the filter is not known.
    s.on_new_request(first := Req("r0", 5 * B, H[:5]))
    assert s.get_num_new_matched_tokens(first, 0) == 4 * B
    assert kinds(store) == ["send_lookup", "found"]
    store.calls.clear()
    new = Req("r1", 3 * B, H[5:8])  # its first block is in no store
    s.on_new_request(new)
    assert s.get_num_new_matched_tokens(new, 0) == 0
    # No lookup, sent or made; the miss is reported to be counted, at once as
    # it is the first, then at most once a second.
    assert store.calls == [("send_unasked", 1, 2)]
    s.request_finished(new)
    again = Req("r2", 3 * B, H[6:8] + H[:1])
    assert s.get_num_new_matched_tokens(again, 0) == 0
    assert store.calls == [("send_unasked", 1, 2)]  # kept for the next report
    monkeypatch.setattr("kvstore.connector_scheduler.UNASKED_REPORT_S", 0.0)
    assert s.get_num_new_matched_tokens(Req("r3", 2 * B, H[7:8]), 0) == 0
    # The last report's answer is read before the next goes, with both misses.
    assert store.calls[1:] == [("answer", (1, 2)), ("send_unasked", 2, 3)]
    s.close()  # the engine stops: the filter's mapping is let go
    store.calls.clear()
    assert s.get_num_new_matched_tokens(Req("r4", 3 * B, H[5:8]), 0) == 0
    assert kinds(store) == ["lookup"]


def test_the_filter_is_not_asked_past_blocks_the_engine_holds(
    filtered: tuple[ScriptedStore, PresenceFilter],
) -> None:
    store, _ = filtered
    s, _ = scheduler(store)
    s.get_num_new_matched_tokens(Req("r0", 2 * B, H[:2]), 0)  # learns the arena
    store.calls.clear()
    # The engine holds the first block: the store counts the prefix as reused
    # (hot) even where it holds nothing past it, so it is asked.
    held = Req("r1", 4 * B, [H[5], H[6], H[7], H[4]], num_computed_tokens=B)
    assert s.get_num_new_matched_tokens(held, B) == 0
    assert kinds(store) == ["lookup"]
    # A first block in the filter (stored here or elsewhere) is asked for.
    assert s.get_num_new_matched_tokens(Req("r2", 3 * B, H[:3]), 0) == 2 * B
    assert kinds(store) == ["lookup", "lookup"]


def test_a_filter_no_longer_renewed_sends_every_prompt_to_the_store(
    filtered: tuple[ScriptedStore, PresenceFilter],
) -> None:
    store, presence = filtered
    s, _ = scheduler(store)
    s.get_num_new_matched_tokens(Req("r0", 2 * B, H[:2]), 0)
    presence.renew(-1)  # the store stopped (or died) and renews it no more
    store.calls.clear()
    assert s.get_num_new_matched_tokens(Req("r1", 3 * B, H[5:8]), 0) == 0
    assert kinds(store) == ["lookup"]
    # A store that restarted names a new arena in its answers: that arena's
    # filter is mapped (none here, so every prompt is asked for).
    store.arena = "arena-after-restart"
    s.get_num_new_matched_tokens(Req("r2", 3 * B, H[5:8]), 0)
    presence.renew(60)
    assert s.get_num_new_matched_tokens(Req("r3", 3 * B, H[5:8]), 0) == 0
    assert kinds(store) == ["lookup", "lookup", "lookup"]


def test_a_traced_lookup_the_filter_answered_says_so(
    filtered: tuple[ScriptedStore, PresenceFilter],
) -> None:
    from cluster import tracing
    from tests.spans import named, recorder

    spans = recorder()
    store, _ = filtered
    s, _ = scheduler(store)
    with tracing.tracer().start_as_current_span("engine.generate"):
        headers = tracing.carrier()
    for rid, hashes in (("r0", H[:3]), ("r1", H[5:8])):  # stored, then not
        req = Req(rid, 3 * B, hashes)
        req.trace_headers = headers  # type: ignore[attr-defined]
        s.get_num_new_matched_tokens(req, 0)
    asked, unasked = named(spans, "kvstore.lookup")
    assert "moe_cluster.kv.unasked" not in (asked.attributes or {})
    a = unasked.attributes or {}
    assert a["moe_cluster.kv.unasked"] is True
    assert a["moe_cluster.kv.pages_found"] == 0
    assert kinds(store) == ["lookup", "send_unasked"]
