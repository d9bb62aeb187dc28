"""The connector's scheduler side (vLLM's engine-core process): which stored pages
a request loads, and which of its blocks each step saves.

``get_num_new_matched_tokens`` asks the store for the longest stored run of the
prompt's full blocks past those the engine's own prefix cache holds (always
leaving one prompt token to compute) and pins those pages under the request's id:
a caching engine is offered, and the store counts, only what it adds. When another
node holds more of the prefix, the store starts fetching it and the request waits
a step or two (``None``) instead of recomputing. ``plan_step`` lists, per step,
the pages to load into the blocks just allocated and the blocks that this step
completes, to save.

The scheduler asks for one request at a time, and each lookup is a round trip to
the store's process. So a request that arrives with no block of the engine's own
to skip is looked up as it arrives (``on_new_request``), and the answer is read
when the scheduler asks: requests that arrive together are one round trip, not
one each. Where the engine caches prefixes itself, a request whose first block
came with a recent request is asked for when scheduled, as the engine may hold
some of it then; so is any request while the engine already has a full batch
(its pins would wait with it).

A request the engine holds no block of is not looked up at all when the store's
presence filter (``kvstore.presence``, mapped once a lookup's answer names the
store's arena) lacks its first block: the store holds none of its pages and can
fetch none, so it is answered 0 with no call (such lookups are reported to the
store about once a second, to be counted as misses).

No torch and no vLLM imports: vLLM's ``Request`` and block objects are used by
their attributes only, so the unit tests drive this class with plain stand-ins.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec

from cluster import tracing
from kvstore import presence
from kvstore.rpc import (
    Fetch,
    Found,
    PageRef,
    Pending,
    Query,
    StoreClient,
    StoreError,
)

logger = logging.getLogger("moe_cluster.kvstore")


class PageLoad(msgspec.Struct, array_like=True, frozen=True):
    """Copy the page in ``slot`` (whose bytes must checksum to ``checksum``) into
    the engine's block ``block_id``."""

    slot: int
    checksum: int
    page_hash: bytes
    block_id: int


class PageSave(msgspec.Struct, array_like=True, frozen=True):
    """Save the engine's block ``block_id`` as the page ``page_hash``."""

    page_hash: bytes
    block_id: int


class Loads(msgspec.Struct, array_like=True, frozen=True):
    """One request's pages to load, all in ``arena``; ``trace``: the request's
    W3C trace context (empty unless it is traced), the load span's parent."""

    arena: str
    pages: list[PageLoad]
    trace: dict[str, str] = {}


class StoreRequest(Protocol):
    """What the scheduler side reads of vLLM's ``Request``."""

    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    block_hashes: Sequence[bytes]
    cache_salt: str | None
    prompt_token_ids: Sequence[int] | None


# First blocks of recent requests an engine that caches prefixes may hold: at
# least as many as the engine has KV blocks, so that a first block it holds is
# one of them (it evicts the least recently used first).
RECENT_FIRST_BLOCKS = 4096
# Lookups answered from the presence filter are reported to the store (to count
# as misses) at most this often.
UNASKED_REPORT_S = 1.0


class StoreScheduler:
    def __init__(
        self,
        client: StoreClient,
        block_size: int,
        warn: Callable[[Exception], None],
        engine_caches: bool = False,
        max_running: int = 0,
        engine_blocks: int = 0,
    ) -> None:
        """``engine_caches``: the engine has its own prefix cache, of
        ``engine_blocks`` KV blocks; ``max_running``: the most requests it runs
        at once (0: never look up on arrival)."""
        self._client, self._block_size, self._warn = client, block_size, warn
        self._engine_caches, self._max_running = engine_caches, max_running
        self._recent_limit = max(RECENT_FIRST_BLOCKS, engine_blocks)
        self._requests: dict[str, StoreRequest] = {}
        # Lookups sent as their requests arrived (no block of the engine's own
        # to skip), their answers not read yet.
        self._early: dict[str, Pending] = {}
        self._recent_first: OrderedDict[bytes, None] = OrderedDict()
        # Pinned for a request not yet allocated: (blocks skipped, refs, arena).
        self._found: dict[str, tuple[int, list[PageRef], str]] = {}
        self._to_load: dict[str, Loads] = {}
        self._saved: dict[str, int] = {}  # full blocks already handed to the store
        self._fetch_wait: dict[str, float] = {}  # traced requests waiting on a fetch
        self._last_fetch: dict[str, Fetch] = {}  # the fetch a lookup just reported
        # The store's presence filter, of the arena its answers last named.
        self._presence: presence.PresenceView | None = None
        self._presence_arena = ""
        # Lookups answered from the filter and pages they missed, not reported yet;
        # the last report, its answer not read yet, and when it went.
        self._unasked = (0, 0)
        self._unasked_sent: Pending | None = None
        self._unasked_at = 0.0
        self._filter_answered = False  # the last lookup (for its span)

    def on_new_request(self, request: StoreRequest) -> None:
        rid = request.request_id
        self._requests[rid] = request
        hashes = self._asked(request)
        if not hashes or request.num_computed_tokens:
            return
        if self._engine_caches:
            first, recent = hashes[0], self._recent_first
            seen = first in recent
            recent[first] = None
            recent.move_to_end(first)
            if len(recent) > self._recent_limit:
                recent.popitem(last=False)
            if seen:
                return  # the engine may hold some of it when it is scheduled
        if len(self._requests) > self._max_running:
            return  # it may wait for room: asked when scheduled
        if self._absent(hashes):
            return  # answered when scheduled, with no call
        # If it fails, it is asked again when scheduled, which warns then.
        with contextlib.suppress(StoreError):
            self._early[rid] = self._client.send_lookup(self._query(request, hashes, 0))

    def get_num_new_matched_tokens(
        self, request: StoreRequest, num_computed_tokens: int
    ) -> int | None:
        rid, b = request.request_id, self._block_size
        hashes = self._asked(request)
        skip = num_computed_tokens // b
        found = self._found.get(rid)
        if found is not None and found[0] == skip:
            # Asked again while the request waits for room: its pages are still
            # pinned for it.
            return len(found[1]) * b
        self._drop_found(rid)
        if not hashes:
            return 0
        # Asked even when the engine holds every block: the store counts the
        # reuse towards the hot prefixes new replicas warm up with.
        headers = getattr(request, "trace_headers", None)
        if headers:
            return self._traced_lookup(request, headers, hashes, skip)
        return self._lookup(request, hashes, skip)

    def _traced_lookup(
        self,
        request: StoreRequest,
        headers: Mapping[str, str],
        hashes: Sequence[bytes],
        skip: int,
    ) -> int | None:
        A = tracing.Attr
        rid = request.request_id
        with tracing.tracer().start_as_current_span(
            "kvstore.lookup",
            context=tracing.context_of(headers),
            attributes={A.KV_PAGES_ASKED: len(hashes), A.KV_PAGES_HELD: skip},
        ) as span:
            token = tracing.REQUEST_ID.set(rid)
            try:
                n = self._lookup(request, hashes, skip)
            finally:
                tracing.REQUEST_ID.reset(token)
            if n is None:
                if rid not in self._fetch_wait:
                    self._fetch_wait[rid] = time.monotonic()
                    span.add_event("fetch.pending")
                span.set_attribute("moe_cluster.kv.pending", True)
                return None
            if (since := self._fetch_wait.pop(rid, None)) is not None:
                span.set_attribute(A.KV_FETCH_WAIT, time.monotonic() - since)
            span.set_attribute(A.KV_PAGES_FOUND, n // self._block_size)
            if self._filter_answered:
                span.set_attribute(A.KV_UNASKED, True)
            if (fetch := self._last_fetch.pop(rid, None)) is not None:
                fetched: dict[str, Any] = {
                    A.KV_FETCH_NODE: fetch.node,
                    A.KV_FETCH_PAGES: fetch.pages,
                    A.KV_FETCH_BYTES: fetch.nbytes,
                    A.KV_FETCH_SECONDS: fetch.seconds,
                }
                span.add_event("fetch", fetched)
                span.set_attributes(fetched)
            return n

    def _asked(self, request: StoreRequest) -> Sequence[bytes]:
        """The hashes of the prompt's blocks the store may offer: every full
        block but one token, which the engine computes."""
        full = (request.num_prompt_tokens - 1) // self._block_size
        return request.block_hashes[:full]

    def _query(
        self, request: StoreRequest, hashes: Sequence[bytes], skip: int
    ) -> Query:
        """The lookup of ``hashes`` (the request's first blocks) past ``skip``."""
        b, salt = self._block_size, request.cache_salt or ""
        tokens = (request.prompt_token_ids or [])[: len(hashes) * b]
        return Query(request.request_id, hashes, salt, tokens, b, skip)

    def _early_answer(self, rid: str, skip: int | None) -> Found | None:
        """The answer to the lookup sent as ``rid`` arrived, if one was and it
        holds for ``skip`` (None: the request finished before it was
        scheduled); else None, what it pinned given back."""
        pending = self._early.pop(rid, None)
        if pending is None:
            return None
        try:
            answer = self._client.found(pending)
        except StoreError:
            # A lookup asks again, and warns if it fails again; what a lost
            # connection pinned, the store gave back when it went.
            return None
        if skip == 0:
            return answer
        if answer.refs:  # its pins start at blocks the engine now holds itself
            self._release(rid)
        return None

    def _lookup(
        self, request: StoreRequest, hashes: Sequence[bytes], skip: int
    ) -> int | None:
        rid, b = request.request_id, self._block_size
        answer = self._early_answer(rid, skip)
        self._filter_answered = False
        if answer is None:
            # Past blocks the engine holds, the store counts the prefix as reused
            # (hot): asked whatever the filter says.
            if skip == 0 and self._absent(hashes):
                self._count_unasked(len(hashes))
                self._filter_answered = True
                return 0
            try:
                answer = self._client.lookup(self._query(request, hashes, skip))
            except StoreError as e:
                self._warn(e)
                return 0
        self._see_arena(answer.arena)
        if answer.pending:
            return None  # another node's pages are on their way
        if not answer.refs:
            return 0
        if answer.fetch is not None:
            self._last_fetch[rid] = answer.fetch
        self._found[rid] = (skip, answer.refs, answer.arena)
        return len(answer.refs) * b

    def _absent(self, hashes: Sequence[bytes]) -> bool:
        """Whether the store's filter says it holds, and can fetch, no page of a
        prompt whose block hashes are ``hashes`` (none held by the engine)."""
        view = self._presence
        return view is not None and not view.may_hold(hashes[0])

    def _see_arena(self, arena: str) -> None:
        """Maps the presence filter of the store whose arena is ``arena`` (the
        store restarted, or this is its first answer)."""
        if arena == self._presence_arena:
            return
        if self._presence is not None:
            self._presence.close()
        self._presence, self._presence_arena = presence.attach(arena), arena

    def _count_unasked(self, pages: int) -> None:
        """Counts a lookup the filter answered (``pages`` missed), and reports
        the counts if the last report is ``UNASKED_REPORT_S`` old."""
        lookups, missed = self._unasked
        self._unasked = (lookups + 1, missed + pages)
        now = time.monotonic()
        if now - self._unasked_at < UNASKED_REPORT_S:
            return
        try:
            if (sent := self._unasked_sent) is not None:
                self._unasked_sent = None
                self._client.answer(sent)  # a second old: it is in
            self._unasked_sent = self._client.send_unasked(*self._unasked)
        except StoreError:
            return  # these counts go with the next report
        self._unasked, self._unasked_at = (0, 0), now

    def update_state_after_alloc(
        self, request: StoreRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """``block_ids``: the request's blocks (its first KV cache group's)."""
        rid = request.request_id
        found = self._found.pop(rid, None)
        if found is None:
            return
        if num_external_tokens == 0:
            self._release(rid)
            return
        skip, refs, arena = found
        # refs[i] is the prompt's block skip + i (the engine holds the first skip).
        headers: Any = getattr(request, "trace_headers", None)
        self._to_load[rid] = Loads(
            arena,
            [
                PageLoad(r.slot, r.checksum, r.page_hash, block_ids[skip + i])
                for i, r in enumerate(refs)
            ],
            dict(headers) if headers else {},
        )
        self._saved[rid] = max(self._saved.get(rid, 0), skip + len(refs))

    def plan_step(
        self,
        num_scheduled_tokens: Mapping[str, int],
        block_ids_of: Callable[[str], Sequence[int]] | None,
    ) -> tuple[dict[str, Loads], list[PageSave]]:
        """This step's loads (taken: each is planned once) and saves."""
        loads, self._to_load = self._to_load, {}
        saves: list[PageSave] = []
        b = self._block_size
        for rid, n in num_scheduled_tokens.items():
            req = self._requests.get(rid)
            if req is None or block_ids_of is None:
                continue
            # Blocks whose every token is in the cache once this step has run.
            done = min(len(req.block_hashes), (req.num_computed_tokens + n) // b)
            # A block that failed to load is recomputed (num_computed_tokens moved
            # back), and saved again.
            start = min(self._saved.get(rid, 0), req.num_computed_tokens // b)
            if done <= start:
                continue
            block_ids = block_ids_of(rid)
            saves += [
                PageSave(req.block_hashes[i], block_ids[i]) for i in range(start, done)
            ]
            self._saved[rid] = done
        return loads, saves

    def request_finished(self, request: StoreRequest) -> None:
        rid = request.request_id
        self._early_answer(rid, None)  # finished before it was scheduled
        self._drop_found(rid)
        if self._to_load.pop(rid, None) is not None:
            self._release(rid)
        self._requests.pop(rid, None)
        self._saved.pop(rid, None)
        self._fetch_wait.pop(rid, None)
        self._last_fetch.pop(rid, None)

    def close(self) -> None:
        """Lets go of the presence filter's mapping (the engine stops)."""
        if self._presence is not None:
            self._presence.close()
        self._presence, self._presence_arena = None, ""

    def pinned(self) -> set[str]:
        """Requests holding pages pinned in the store (found or to load)."""
        return set(self._found) | set(self._to_load)

    def _drop_found(self, rid: str) -> None:
        if self._found.pop(rid, None) is not None:
            self._release(rid)

    def _release(self, rid: str) -> None:
        try:
            self._client.release(rid)
        except StoreError as e:
            self._warn(e)
