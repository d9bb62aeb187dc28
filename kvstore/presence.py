"""Which pages a node's store may hold, readable by its engines without a call.

A lookup is a round trip to the store's process, and an engine's scheduler waits
for it. Most prompts a serving engine sees share nothing with what the store
holds, and for those the round trip changes no outcome. So the store keeps a
Bloom filter of every page a lookup could be answered from, in shared memory
beside its arena: its own pages, and those the directory says other nodes hold
(a lookup that misses here fetches them). An engine that holds no block of a
prompt itself asks the filter first, and skips the lookup when the filter lacks
the prompt's first block: a lookup's run of pages starts at that block, so the
store would have found nothing and fetched nothing. A Bloom filter never lacks
what was added to it; a false positive (under 1 in 250 while it holds no more
pages than a 32nd of its bits) costs the lookup that would have been made
anyway, so a filter fuller than that (other nodes holding many pages) still
skips only lookups that would have found nothing, just fewer of them.

    segment:  | header: 4 u64 | half 0: BITS bits | half 1: BITS bits |
    header:   magic, log2(BITS), generation, valid until (CLOCK_MONOTONIC ns)

Only the store writes. A page is added before its ``commit`` is answered, so an
engine that saved a page and one that looks it up later agree. A page that
leaves the store stays in the filter until the store rebuilds it: into the half
not in use, from what it holds then, after which it moves the generation on
(the live half is ``generation % 2``). A reader reads the generation before and
after probing and takes a change as "may hold". The store renews "valid until"
as it syncs with the directory; a reader that finds it past (the store stopped,
or died) takes every page as "may hold", and so asks the store, as without a
filter. Positions come from the block hash's own bytes (vLLM's are sha256
digests): two 64-bit words, each taken modulo BITS.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Iterable
from multiprocessing import shared_memory

from kvstore.arena import _TRACKER, _attach_untracked

MAGIC = 0x6D6F652D70726573  # "moe-pres"
_HEADER = struct.Struct("<4Q")
_MAGIC, _LOG2, _GEN, _VALID = 0, 8, 16, 24  # byte offsets of the header's words
MIN_LOG2 = 16  # 8 KiB a half
MAX_LOG2 = 30  # 128 MiB a half
# The store renews the filter as it syncs, for this many sync intervals: engines
# go on trusting it through a slow sync or two, not after the store stopped.
VALID_SYNCS = 4


def presence_name(arena: str) -> str:
    """The filter's segment, named after the arena it describes."""
    return f"{arena}-presence"


def bits_for(pages: int) -> int:
    """log2 of the bits a filter for a store of ``pages`` pages gets: 64 a page
    (a false positive rate of 1 in 1,000 when it holds the store's pages, 1 in
    250 with as many again from other nodes)."""
    need = max(64 * pages, 1 << MIN_LOG2)
    return min(max((need - 1).bit_length(), MIN_LOG2), MAX_LOG2)


def _positions(h: bytes, mask: int) -> tuple[int, int]:
    if len(h) < 16:
        h = hashlib.blake2b(h, digest_size=16).digest()
    return (
        int.from_bytes(h[0:8], "little") & mask,
        int.from_bytes(h[8:16], "little") & mask,
    )


class PresenceFilter:
    """The store's side: creates the segment, adds pages, rebuilds, renews."""

    def __init__(self, name: str, log2_bits: int) -> None:
        if not MIN_LOG2 <= log2_bits <= MAX_LOG2:
            raise ValueError(f"log2_bits {log2_bits} outside {MIN_LOG2}..{MAX_LOG2}")
        self.name, self.bits = name, 1 << log2_bits
        self._half = self.bits // 8
        with _TRACKER:
            self._shm = shared_memory.SharedMemory(
                name=name, create=True, size=_HEADER.size + 2 * self._half
            )
        buf = self._shm.buf
        assert buf is not None  # open
        self._buf: memoryview = buf
        self._buf[:] = bytes(len(self._buf))  # tmpfs pages come zeroed; be sure
        _HEADER.pack_into(self._buf, 0, MAGIC, log2_bits, 0, 0)
        self.generation = 0
        self._closed = False
        self.added = 0  # pages in the live half (added since its rebuild, or by it)
        self.stale = 0  # pages gone since the last rebuild (still in the filter)
        self._built = 0  # pages the last rebuild put in

    def _offset(self, generation: int) -> int:
        return _HEADER.size + (generation & 1) * self._half

    def add(self, h: bytes) -> None:
        base, buf = self._offset(self.generation), self._buf
        for p in _positions(h, self.bits - 1):
            buf[base + (p >> 3)] |= 1 << (p & 7)
        self.added += 1

    def gone(self, pages: int = 1) -> None:
        """Notes that pages left the store (they stay in the filter until a
        rebuild)."""
        self.stale += pages

    def due(self, live: int) -> bool:
        """Whether to rebuild: the pages gone outnumber those ``live``, or the
        live half holds more than a 32nd of the bits in pages and twice what
        the last rebuild put in (a filter rebuilt that full stays so: it is not
        rebuilt again until it has taken as many pages more)."""
        full = self.added > max(self.bits // 32, 2 * self._built)
        return self.stale > max(live, 64) or full

    def rebuild(self, hashes: Iterable[bytes]) -> None:
        """Makes the filter hold exactly ``hashes``: written into the half not
        in use, which then becomes the live one."""
        nxt = self.generation + 1
        base, buf, mask = self._offset(nxt), self._buf, self.bits - 1
        buf[base : base + self._half] = bytes(self._half)
        n = 0
        for h in hashes:
            for p in _positions(h, mask):
                buf[base + (p >> 3)] |= 1 << (p & 7)
            n += 1
        struct.pack_into("<Q", buf, _GEN, nxt)
        self.generation, self.added, self.stale, self._built = nxt, n, 0, n

    def renew(self, valid_s: float) -> None:
        """Readers may trust the filter for ``valid_s`` more seconds."""
        until = time.monotonic_ns() + int(valid_s * 1e9)
        struct.pack_into("<Q", self._buf, _VALID, until)

    def close(self) -> None:
        """Tells readers to trust it no more, and removes the segment."""
        if self._closed:
            return
        self._closed = True
        struct.pack_into("<Q", self._buf, _VALID, 0)
        del self._buf
        self._shm.close()
        self._shm.unlink()


class PresenceView:
    """An engine's side: a read-only use of the store's filter."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._shm = _attach_untracked(name)
        buf = self._shm.buf
        assert buf is not None  # open
        magic, log2_bits, _, _ = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC or not MIN_LOG2 <= log2_bits <= MAX_LOG2:
            self._shm.close()
            raise ValueError(f"{name} is not a page presence filter")
        self._buf: memoryview = buf
        self._mask = (1 << log2_bits) - 1
        self._half = (1 << log2_bits) // 8

    def may_hold(self, h: bytes) -> bool:
        """False only when the store surely holds no page ``h`` and the directory
        names no other node holding it (as of the store's last sync)."""
        buf = self._buf
        (gen,) = struct.unpack_from("<Q", buf, _GEN)
        (until,) = struct.unpack_from("<Q", buf, _VALID)
        if time.monotonic_ns() >= until:
            return True
        base = _HEADER.size + (gen & 1) * self._half
        a, b = _positions(h, self._mask)
        found = (buf[base + (a >> 3)] >> (a & 7)) & (buf[base + (b >> 3)] >> (b & 7))
        return bool(found & 1) or struct.unpack_from("<Q", buf, _GEN)[0] != gen

    def close(self) -> None:
        del self._buf
        self._shm.close()


def attach(arena: str) -> PresenceView | None:
    """The filter of the store whose arena is ``arena``, or None where there is
    none (a store without one, or gone)."""
    if not arena:
        return None
    try:
        return PresenceView(presence_name(arena))
    except (OSError, ValueError):
        return None
