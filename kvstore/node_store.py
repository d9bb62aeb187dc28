"""One node's page store: the arena's bytes, the index's meaning, and what changed.

``NodeStore`` is what the node's store actor serves to every engine on the node (over
a Unix socket, see ``rpc``) and to other nodes (over Ray). It adds to ``PageIndex``:

- **leases**: pages found for a request stay pinned under the request's id until
  the engine has copied them (``release``), so eviction never reuses a slot that is
  being read;
- **a change log** of added and removed page hashes that the directory follows
  (``changes``), with a full resend when a reader has fallen too far behind;
- **hot prefixes**: the token prefixes (with their tenant salt) that were served
  from the store most often, which new replicas warm up with;
- **export / import** of pages between nodes (an exported page is checked against
  its checksum; the importing node checksums what it writes);
- **a presence filter** (``presence``) in shared memory beside the arena, of every
  page a lookup could be answered from (its own, and other nodes' as
  ``add_elsewhere`` reports them), which engines read to skip lookups that would
  find nothing; its owner renews it (``maintain_presence``), and rebuilds it there
  once enough pages have left.

No Ray, no vLLM, no sockets: unit-tested on its own.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from kvstore import page_sum
from kvstore.arena import Arena, Bytes, CorruptPage
from kvstore.block_hash import BlockHash
from kvstore.page_store import PageIndex, PageRef
from kvstore.presence import VALID_SYNCS, PresenceFilter, bits_for, presence_name

logger = logging.getLogger("moe_cluster.kvstore")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ArenaInfo:
    name: str  # shared-memory segment to attach
    num_pages: int
    page_bytes: int


@dataclass(frozen=True, slots=True)
class Changes(Generic[T]):
    """What changed after ``since``; when ``full``, ``added`` is the whole set and
    the reader must forget what it had."""

    seq: int
    full: bool
    added: tuple[T, ...] = ()
    removed: tuple[T, ...] = ()


class ChangeLog(Generic[T]):
    """Additions and removals of a set, numbered, the newest ``limit`` kept."""

    def __init__(self, current: Callable[[], Iterable[T]], limit: int = 1 << 16):
        self._current, self._limit = current, limit
        self._log: deque[tuple[bool, T]] = deque()
        self.seq = 0  # entries ever recorded

    def record(self, added: bool, item: T) -> None:
        self._log.append((added, item))
        self.seq += 1
        if len(self._log) > self._limit:
            self._log.popleft()

    def since(self, seq: int) -> Changes[T]:
        first = self.seq - len(self._log)
        if seq < first or seq > self.seq:  # fell behind, or from another incarnation
            return Changes(self.seq, True, tuple(self._current()))
        added: dict[T, None] = {}
        removed: dict[T, None] = {}
        for i in range(seq - first, len(self._log)):
            is_add, item = self._log[i]
            if is_add:
                removed.pop(item, None)
                added[item] = None
            else:
                added.pop(item, None)
                removed[item] = None
        return Changes(self.seq, False, tuple(added), tuple(removed))


HotKey = tuple[str, tuple[int, ...]]  # (tenant salt, token ids of the prefix)

# (hashes, first missing position) -> True when the missing pages are being
# fetched from another node and the caller should ask again shortly.
MissHook = Callable[[Sequence[BlockHash], int], bool]


@dataclass
class HotPrefixes:
    """How often each stored prefix was served from the store; the ``limit`` most
    often seen are kept (a new entry replaces the least seen). A prefix whose last
    page leaves the store is forgotten: warming it up would load nothing."""

    limit: int = 256
    counts: Counter[HotKey] = field(default_factory=Counter)
    _by_page: dict[BlockHash, HotKey] = field(default_factory=dict)

    def hit(self, salt: str, tokens: Sequence[int], last_page: BlockHash) -> None:
        key = (salt, tuple(tokens))
        if key not in self.counts and len(self.counts) >= self.limit:
            self._forget_key(min(self.counts, key=self.counts.__getitem__))
        self.counts[key] += 1
        self._by_page[last_page] = key

    def forget(self, page: BlockHash) -> None:
        key = self._by_page.pop(page, None)
        if key is not None:
            self.counts.pop(key, None)

    def top(self, n: int) -> list[tuple[HotKey, int]]:
        return self.counts.most_common(n)

    def _forget_key(self, key: HotKey) -> None:
        del self.counts[key]
        for page in [p for p, k in self._by_page.items() if k == key]:
            del self._by_page[page]


STATS = (
    "lookups",
    "hit_pages",
    "miss_pages",
    "saved_pages",
    "dropped_pages",
    "exported_pages",
    "imported_pages",
)


class LayoutMismatch(ValueError):
    """An engine's pages differ from the pages this store holds (another model)."""


class NodeStore:
    def __init__(
        self,
        arena_name: str,
        capacity_bytes: int,
        elsewhere: Callable[[], Iterable[BlockHash]] = tuple,
    ) -> None:
        """``elsewhere``: the pages other nodes hold, as far as this node knows
        (what a lookup that misses here could fetch)."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        self._arena_name = arena_name
        self.capacity_bytes = capacity_bytes
        self._elsewhere = elsewhere
        self.arena: Arena | None = None
        self.index: PageIndex | None = None
        self.presence: PresenceFilter | None = None
        self.layout = ""
        self.log: ChangeLog[BlockHash] = ChangeLog(self._hashes)
        self.hot = HotPrefixes()
        self._leases: dict[str, list[PageRef]] = {}
        self.stats: Counter[str] = Counter(dict.fromkeys(STATS, 0))

    # -- engines ---------------------------------------------------------------

    def open(self, page_bytes: int, layout: str) -> ArenaInfo:
        """The arena engines attach to. The first engine sizes it: as many pages of
        ``page_bytes`` as fit in the capacity; every later one must match."""
        if self.arena is None:
            num_pages = self.capacity_bytes // page_bytes
            if num_pages < 1:
                raise ValueError(
                    f"capacity {self.capacity_bytes} bytes holds no page of "
                    f"{page_bytes} bytes"
                )
            self.arena = Arena.create(self._arena_name, num_pages, page_bytes)
            page_sum.warm(page_bytes=page_bytes)  # exports and imports copy pages
            self.index = PageIndex(num_pages, self._removed)
            self.layout = layout
            try:
                self.presence = PresenceFilter(
                    presence_name(self.arena.name), bits_for(num_pages)
                )
                self.presence.rebuild(self._elsewhere())
            except OSError as e:  # engines then look every prompt up, as before
                logger.warning("no page presence filter for engines to read: %s", e)
        elif (page_bytes, layout) != (self.arena.page_bytes, self.layout):
            raise LayoutMismatch(
                f"this node's store holds pages of {self.arena.page_bytes} bytes "
                f"({self.layout}); the engine has {page_bytes} bytes ({layout})"
            )
        return ArenaInfo(self.arena.name, self.arena.num_pages, self.arena.page_bytes)

    def lookup(
        self,
        lease: str,
        hashes: Sequence[BlockHash],
        salt: str = "",
        tokens: Sequence[int] = (),
        block_size: int = 0,
        on_miss: MissHook | None = None,
        skip: int = 0,
    ) -> list[PageRef] | None:
        """The stored pages of the longest run of ``hashes[skip:]``, pinned under
        ``lease`` (replacing what the lease held) until ``release``.

        The first ``skip`` pages are in the engine's own cache already: they are
        neither looked up nor counted as hits or misses, so a caching engine is
        offered (and the stats count) only what the store adds; a page the store
        evicted there does not hide the ones after it. The prefix reused counts
        towards the hot prefixes either way. None when ``on_miss`` (told the hashes
        and the first missing position) answers that the missing pages are being
        fetched: nothing is pinned or counted then, and the caller asks again."""
        if not 0 <= skip <= len(hashes):
            raise ValueError(f"skip {skip} outside 0..{len(hashes)}")
        index = self._index()
        self.release(lease)
        refs = index.lookup(hashes[skip:])
        end = skip + len(refs)
        if end < len(hashes) and on_miss is not None and on_miss(hashes, end):
            return None
        if refs:
            index.pin(refs)
            self._leases[lease] = refs
        # A reuse is hot wherever it was served (the engine's cache or here),
        # while this store holds its last page: warming it up loads it.
        if tokens and block_size and end and hashes[end - 1] in index:
            self.hot.hit(salt, tokens[: end * block_size], hashes[end - 1])
        self.stats["lookups"] += 1
        self.stats["hit_pages"] += len(refs)
        self.stats["miss_pages"] += len(hashes) - end
        return refs

    def held(self, hashes: Sequence[BlockHash]) -> int:
        """How many pages of the longest prefix of ``hashes`` are stored."""
        return len(self.index.lookup(hashes)) if self.index is not None else 0

    def release(self, lease: str) -> None:
        refs = self._leases.pop(lease, None)
        if refs:
            self._index().unpin(refs)

    def reserve(self, hashes: Sequence[BlockHash]) -> list[int | None]:
        """A slot to write each page into; None for one already stored or being
        written, or when every page is pinned."""
        index = self._index()
        return [index.allocate(h) for h in hashes]

    def commit(self, written: Iterable[tuple[int, int]]) -> None:
        """Publishes written pages: (slot, checksum of its bytes)."""
        index = self._index()
        for slot, crc in written:
            ref = index.commit(slot, crc)
            self.log.record(True, ref.page_hash)
            if self.presence is not None:  # before the engine hears it is stored
                self.presence.add(ref.page_hash)
            self.stats["saved_pages"] += 1

    def abandon(self, slots: Iterable[int]) -> None:
        index = self._index()
        for slot in slots:
            index.abandon(slot)

    def drop(self, hashes: Iterable[BlockHash]) -> int:
        """Forgets pages (a failed checksum): they are recomputed, never served."""
        index = self._index()
        n = sum(index.drop(h) for h in hashes)
        self.stats["dropped_pages"] += n
        return n

    def changes(self, since: int) -> Changes[BlockHash]:
        return self.log.since(since)

    def count_unasked(self, lookups: int, pages: int) -> None:
        """Counts lookups an engine answered from the presence filter (every
        page missed) as if they had been made."""
        self.stats["lookups"] += lookups
        self.stats["miss_pages"] += pages

    def add_elsewhere(self, h: BlockHash) -> None:
        """Notes a page another node now holds (a lookup could fetch it)."""
        if self.presence is not None:
            self.presence.add(h)

    def gone_elsewhere(self, pages: int = 1) -> None:
        """Notes that other nodes no longer hold ``pages`` pages."""
        if self.presence is not None:
            self.presence.gone(pages)

    def maintain_presence(self, sync_interval_s: float) -> None:
        """Rebuilds the presence filter when it is due (enough pages have left
        it, or it filled), and lets engines trust it for ``VALID_SYNCS`` more
        sync intervals: its owner calls this every interval, so engines stop
        trusting a filter whose owner stopped."""
        if (presence := self.presence) is None or self.index is None:
            return
        if presence.due(len(self.index)):
            presence.rebuild([*self.index.hashes(), *self._elsewhere()])
        presence.renew(VALID_SYNCS * sync_interval_s)

    # -- other nodes -------------------------------------------------------------

    def export(self, hashes: Sequence[BlockHash]) -> tuple[list[BlockHash], Bytes]:
        """Copies of the stored, intact pages of the longest prefix of ``hashes``
        (one row each); a page that fails its checksum is dropped and ends it."""
        if self.arena is None:  # no engine opened this store yet: nothing stored
            return [], np.empty((0, 0), dtype=np.uint8)
        arena, index = self._arena(), self._index()
        refs = index.lookup(hashes)
        out = np.empty((len(refs), arena.page_bytes), dtype=np.uint8)
        sent: list[BlockHash] = []
        index.pin(refs)
        try:
            for row, ref in enumerate(refs):
                try:
                    arena.read_into(ref.index, out[row], ref.checksum)
                except CorruptPage:
                    self.drop([ref.page_hash])
                    break
                sent.append(ref.page_hash)
        finally:
            index.unpin(refs)
        self.stats["exported_pages"] += len(sent)
        return sent, out[: len(sent)]

    def import_pages(self, hashes: Sequence[BlockHash], pages: Bytes) -> int:
        """Stores pages fetched from another node; returns how many were new."""
        arena = self._arena()
        slots = self.reserve(hashes)
        written = []
        for slot, row in zip(slots, pages, strict=True):
            if slot is not None:
                written.append((slot, arena.write(slot, row)))
        self.commit(written)
        self.stats["imported_pages"] += len(written)
        return len(written)

    def summary(self) -> dict[str, int]:
        index = self.index  # an empty index is falsy (len 0): compare with None
        return {
            "pages": len(index) if index is not None else 0,
            "writing": index.writing if index is not None else 0,  # not committed
            "num_pages": index.num_pages if index is not None else 0,
            "page_bytes": self.arena.page_bytes if self.arena else 0,
            "capacity_bytes": self.capacity_bytes,
            "evictions": index.evictions if index is not None else 0,
            "leases": len(self._leases),
            **self.stats,
        }

    def close(self) -> None:
        if self.presence is not None:
            self.presence.close()
            self.presence = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # -- internals ---------------------------------------------------------------

    def _hashes(self) -> list[BlockHash]:
        return self.index.hashes() if self.index else []

    def _removed(self, h: BlockHash) -> None:
        self.log.record(False, h)
        self.hot.forget(h)
        if self.presence is not None:
            self.presence.gone()

    def _index(self) -> PageIndex:
        if self.index is None:
            raise RuntimeError("the store has no arena yet: an engine opens it first")
        return self.index

    def _arena(self) -> Arena:
        if self.arena is None:
            raise RuntimeError("the store has no arena yet: an engine opens it first")
        return self.arena
