"""A node's KV page arena: fixed-size pages in one shared-memory segment.

Every engine process on the node attaches the same segment by name and reads or
writes pages in place (``numpy`` views over the mapping): nothing is pickled and
nothing goes through Ray's object store. The only copy is between a page and the
engine's own cache. Each page is checksummed (``page_sum``) when written and checked
when read.

    segment:  | page 0 | page 1 | ... | page N-1 |     page_bytes each
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections.abc import Sized
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvstore import page_sum

Bytes = npt.NDArray[np.uint8]


# Held while the resource tracker's ``register`` is swapped out (an attach), and
# around a create, so another thread's create is never left unregistered.
_TRACKER = threading.Lock()

# Linux 5.14+: fault a whole mapping in, writable, now (Python 3.11 lacks the name).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _attach_untracked(segment: str) -> shared_memory.SharedMemory:
    """Maps an existing segment without telling this process's resource
    tracker, which would unlink it at exit (Python 3.11's ``SharedMemory``
    registers every segment it opens; 3.13's ``track=False`` says not to): the
    owner unlinks it. Unregistering afterwards is not the same: a process that
    multiprocessing started shares its parent's tracker, so that would also
    drop the registration of a segment the parent created (the tracker then
    fails when the parent unlinks it, and no longer cleans up after a parent
    that dies)."""
    with _TRACKER:  # the tracker's ``register`` is swapped out meanwhile
        register = resource_tracker.register

        def skip_shared_memory(name: Sized, rtype: str) -> None:
            if rtype != "shared_memory":
                register(name, rtype)

        resource_tracker.register = skip_shared_memory
        try:
            return shared_memory.SharedMemory(name=segment, create=False)
        finally:
            resource_tracker.register = register


class CorruptPage(Exception):
    """A page's bytes no longer match the checksum taken when it was written."""


class Arena:
    def __init__(
        self, name: str, num_pages: int, page_bytes: int, *, create: bool
    ) -> None:
        if num_pages <= 0 or page_bytes <= 0:
            raise ValueError("num_pages and page_bytes must be > 0")
        size = num_pages * page_bytes
        if create:
            with _TRACKER:  # registered: not while an attach swaps it out
                self._shm = shared_memory.SharedMemory(
                    name=name, create=True, size=size
                )
            self._allocate(size)
        else:
            self._shm = _attach_untracked(name)
        self.name, self.num_pages, self.page_bytes = name, num_pages, page_bytes
        self._owner = create
        self._pages: Bytes = np.ndarray(
            (num_pages, page_bytes), dtype=np.uint8, buffer=self._shm.buf
        )
        self._map_in()

    def _allocate(self, size: int) -> None:
        """Gives the segment all its memory now. Left to the first write of
        each page, a page written into a new slot cost an engine's step
        90-400 us instead of 12 (147 KiB ``CPU_MLA`` pages on the 2-core EPYC):
        the kernel found and zeroed 36 pages of memory for it. And a segment
        larger than what ``/dev/shm`` has left fails here, with a message,
        instead of killing (SIGBUS) the engine that first writes past it."""
        try:
            os.posix_fallocate(self._shm._fd, 0, size)  # type: ignore[attr-defined]
        except OSError as e:
            self._shm.close()
            self._shm.unlink()
            if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            free = os.statvfs(SHM_DIR)
            raise OSError(
                e.errno,
                f"the page arena needs {size / 2**20:.0f} MiB of {SHM_DIR}, which "
                f"has {free.f_bavail * free.f_frsize / 2**20:.0f} MiB free: lower "
                "kvstore.capacity_bytes or give the node's shared memory more",
            ) from e

    def _map_in(self) -> None:
        """Maps every page of the segment into this process now (where the
        kernel can: Linux 5.14+), so that no copy to or from a page waits for
        the kernel on first touch."""
        # Elsewhere pages are mapped in as they are first touched, as before.
        with contextlib.suppress(OSError, AttributeError, ValueError):
            self._shm._mmap.madvise(MADV_POPULATE_WRITE)  # type: ignore[attr-defined]

    @classmethod
    def create(cls, name: str, num_pages: int, page_bytes: int) -> Arena:
        return cls(name, num_pages, page_bytes, create=True)

    @classmethod
    def attach(cls, name: str, num_pages: int, page_bytes: int) -> Arena:
        return cls(name, num_pages, page_bytes, create=False)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def page(self, index: int) -> Bytes:
        """The page's bytes in place (a view: writes go to shared memory)."""
        view: Bytes = self._pages[index]
        return view

    def pages(self) -> Bytes:
        """Every page in place, one row each (a view)."""
        return self._pages

    def write(self, index: int, data: Bytes) -> int:
        """Copies ``data`` (exactly one page) into the page; returns its checksum."""
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if flat.nbytes != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, got {flat.nbytes}")
        return page_sum.copy(self._pages[index], flat)

    def read_into(self, index: int, out: Bytes, expected: int) -> None:
        """Copies the page into ``out`` (one page of contiguous bytes) and checks
        what arrived there: a corrupt page raises and must not be used."""
        dst: Bytes = out.reshape(-1).view(np.uint8)
        if page_sum.copy(dst, self._pages[index]) != expected:
            raise CorruptPage(f"page {index} failed its checksum")

    def close(self) -> None:
        del self._pages
        self._shm.close()
        if self._owner:
            self._shm.unlink()


def checksum(page: Bytes) -> int:
    """The page's checksum (``page_sum``), read in place."""
    return page_sum.checksum(page)


SHM_DIR = Path("/dev/shm")


def segments_in_use(prefix: str, proc: Path = Path("/proc")) -> set[str]:
    """Names of the shared-memory segments starting with ``prefix`` that some
    process maps or holds open (``/proc/*/maps`` and ``/proc/*/fd``)."""
    marker = f"{SHM_DIR}/{prefix}"
    name_at = len(str(SHM_DIR)) + 1  # past "/dev/shm/"
    used: set[str] = set()
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            for line in (pid / "maps").read_text().splitlines():
                at = line.find(marker)
                if at >= 0:
                    used.add(line[at + name_at :].split(" ")[0])
            for fd in (pid / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(marker):
                    used.add(target[name_at:].split(" ")[0])
        except OSError:  # gone, or not ours to read
            continue
    return used


def unlink_orphaned(prefix: str) -> list[str]:
    """Removes this user's segments starting with ``prefix`` that no process maps
    or holds open; returns their names.

    A store that is killed (not shut down), or a whole Ray node stopped with
    ``ray stop --force``, leaves its arena in ``/dev/shm``: memory the kernel
    never gives back. Its successor on the same Ray node removes it by name, but
    a node that comes back under a new id, on the same machine, has another
    name. A segment nobody maps or holds open is nobody's: no process can reach
    its pages, and one that attaches later would look it up by a live store's
    name. Only the current user's segments are considered (``/dev/shm`` lets no
    one else remove them)."""
    if not SHM_DIR.is_dir():
        return []
    candidates = [p for p in SHM_DIR.glob(f"{prefix}*") if _owned(p)]
    if not candidates:
        return []
    used = segments_in_use(prefix)
    removed = []
    for path in candidates:
        if path.name not in used:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _owned(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.geteuid()
    except OSError:
        return False
