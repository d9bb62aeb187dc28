"""Which page of a node's arena holds which KV block: the index, LRU and pins.

Pure bookkeeping (no shared memory, no Ray): the arena holds the bytes, this holds
the meaning. A page is written before it is published (``commit``), so a reader
never finds a half-written page; a pinned page is never evicted or reused.

    allocate(h) ──► write bytes ──► commit(page, checksum) ──► lookup/pin ──► unpin
                  (invisible)         (visible, LRU tail)        (readers)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class PageRef:
    index: int  # slot in the arena
    page_hash: BlockHash
    checksum: int


class PageIndex:
    """Invariant: every slot is exactly one of free, pending (allocated, not yet
    committed) or committed; committed slots are in ``_lru`` oldest first."""

    def __init__(
        self,
        num_pages: int,
        on_remove: Callable[[BlockHash], None] = lambda h: None,
    ) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be > 0")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out 0 first
        self._pending: dict[int, BlockHash] = {}
        self._by_hash: dict[BlockHash, PageRef] = {}
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()
        self._pins: dict[int, int] = {}
        self._orphans: set[int] = set()  # dropped while pinned: freed at unpin
        self._on_remove = on_remove  # told of every committed page that goes
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    @property
    def writing(self) -> int:
        """Slots allocated and not yet committed or abandoned."""
        return len(self._pending)

    def __contains__(self, h: object) -> bool:
        return h in self._by_hash

    def lookup(self, hashes: Sequence[BlockHash]) -> list[PageRef]:
        """Committed pages of the longest prefix of ``hashes``; marks them used."""
        out: list[PageRef] = []
        for h in hashes:
            ref = self._by_hash.get(h)
            if ref is None:
                break
            self._lru.move_to_end(h)
            out.append(ref)
        return out

    def pin(self, refs: Sequence[PageRef]) -> None:
        """Keeps pages from eviction while they are read (all or none)."""
        for r in refs:
            if self._by_hash.get(r.page_hash) != r:
                raise KeyError(f"page {r.index} no longer holds that block")
        for r in refs:
            self._pins[r.index] = self._pins.get(r.index, 0) + 1

    def unpin(self, refs: Sequence[PageRef]) -> None:
        for r in refs:
            n = self._pins.get(r.index, 0)
            if n <= 0:
                raise ValueError(f"page {r.index} is not pinned")
            if n == 1:
                del self._pins[r.index]
                if r.index in self._orphans:
                    self._orphans.discard(r.index)
                    self._free.append(r.index)
            else:
                self._pins[r.index] = n - 1

    def allocate(self, h: BlockHash) -> int | None:
        """A slot to write ``h`` into, evicting the least recently used unpinned
        page if none is free; None when ``h`` is already stored or being written,
        or every page is pinned."""
        if h in self._by_hash or h in self._pending.values():
            return None
        if not self._free and not self._evict_one():
            return None
        index = self._free.pop()
        self._pending[index] = h
        return index

    def commit(self, index: int, checksum: int) -> PageRef:
        h = self._pending.pop(index)
        ref = PageRef(index, h, checksum)
        self._by_hash[h] = ref
        self._lru[h] = None
        return ref

    def abandon(self, index: int) -> None:
        """A write that will not be committed gives its slot back."""
        del self._pending[index]
        self._free.append(index)

    def drop(self, h: BlockHash) -> bool:
        """Forgets a page (failed checksum); its slot is reused once unpinned."""
        ref = self._by_hash.pop(h, None)
        if ref is None:
            return False
        del self._lru[h]
        self._on_remove(h)
        if ref.index not in self._pins:
            self._free.append(ref.index)
        else:
            self._orphans.add(ref.index)
        return True

    def _evict_one(self) -> bool:
        for h in self._lru:
            ref = self._by_hash[h]
            if ref.index not in self._pins:
                del self._lru[h]
                del self._by_hash[h]
                self._free.append(ref.index)
                self.evictions += 1
                self._on_remove(h)
                return True
        return False

    def is_pinned(self, index: int) -> bool:
        return index in self._pins

    def hashes(self) -> list[BlockHash]:
        """Committed page hashes, least recently used first."""
        return list(self._lru)
