"""The page checksum: two sums over a page's 64-bit words, taken as it is copied.

A page's bytes are read as little-endian 64-bit words ``w[0..m)`` (a last partial
word zero-padded) and summed modulo 2**64 twice, once plainly and once weighted
by each word's position::

    s1 = sum(w[i])                s2 = sum(w[i] * (2i + 1))
    checksum = fmix64(fmix64(s1 ^ nbytes) ^ s2)      (murmur3's finaliser)

A single changed word (any flipped bit, say) always changes ``s1``. Changes that
cancel in ``s1`` (two words swapped) still change ``s2``, unless their weighted
differences cancel too, modulo 2**64: words ``a`` and ``b`` swapped show unless
``(w[a] - w[b]) * (b - a)`` is a multiple of 2**63. This guards pages against
damage (stray writes, torn or stale pages), not against an adversary. A page is
read from memory once: each word is summed as it is copied (``load_rows``), in
one loop that the compiler vectorises, so checking costs 3-10% over the copies
alone (tests/perf/page_copy.py); a separate hash over the copied bytes (xxh3,
even from the CPU's cache) cost 12-15%.

The kernels are compiled by numba and cached on disk (``kvstore/__pycache__``),
for each kind of arguments: ``warm`` does it before a step needs them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit, uint64

Words = npt.NDArray[np.uint64]
_MASK = (1 << 64) - 1


@njit(nogil=True, boundscheck=False, cache=True)
def _sums(words, base, s1, s2):  # type: ignore[no-untyped-def]
    """Adds ``words`` (the page's words from position ``base``) into the sums."""
    weight = uint64(2 * base + 1)
    for i in range(words.shape[0]):
        x = words[i]
        s1 += x
        s2 += x * (weight + uint64(2 * i))
    return s1, s2


@njit(nogil=True, boundscheck=False, cache=True)
def _load_rows(rows, block, src):  # type: ignore[no-untyped-def]
    """Copies the page ``src`` into row ``block`` of each of ``rows`` in turn (one
    array of blocks per layer, the page's parts in order), summing its words as
    they are copied; returns the sums."""
    s1 = uint64(0)
    s2 = uint64(0)
    k = 0
    for layer in range(len(rows)):
        dst = rows[layer][block]
        n = dst.shape[0]
        part = src[k : k + n]
        weight = uint64(2 * k + 1)
        for i in range(n):
            x = part[i]
            dst[i] = x
            s1 += x
            s2 += x * (weight + uint64(2 * i))
        k += n
    return s1, s2


@njit(nogil=True, boundscheck=False, cache=True)
def _save_rows(rows, block, dst):  # type: ignore[no-untyped-def]
    """``_load_rows`` the other way: row ``block`` of each of ``rows`` into the
    page ``dst``, summed as it is copied. (One kernel choosing source and
    destination at run time was not vectorised as well: DeepSeek-V3's pages
    loaded at 0.71x memcpy against 0.85x.)"""
    s1 = uint64(0)
    s2 = uint64(0)
    k = 0
    for layer in range(len(rows)):
        src = rows[layer][block]
        n = src.shape[0]
        part = dst[k : k + n]
        weight = uint64(2 * k + 1)
        for i in range(n):
            x = src[i]
            part[i] = x
            s1 += x
            s2 += x * (weight + uint64(2 * i))
        k += n
    return s1, s2


def _fmix64(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _MASK
    return h ^ (h >> 33)


def digest(s1: int, s2: int, nbytes: int) -> int:
    """The checksum of ``nbytes`` bytes whose words summed to ``s1`` and ``s2``
    (their 64 bits, unsigned or as signed int64 sums)."""
    return _fmix64(_fmix64((int(s1) ^ nbytes) & _MASK) ^ (int(s2) & _MASK))


def words(data: npt.NDArray[np.uint8]) -> Words:
    """The whole 64-bit words of a contiguous byte array, in place."""
    whole: Words = data[: data.nbytes - data.nbytes % 8].view(np.uint64)
    return whole


def sums(
    data: npt.NDArray[np.uint8], base: int = 0, s1: int = 0, s2: int = 0
) -> tuple[int, int]:
    """Adds the bytes ``data`` (contiguous, starting at word ``base`` of the page,
    8-byte aligned in it unless it ends the page) into the sums ``s1``, ``s2``."""
    whole = words(data)
    s1, s2 = _sums(whole, base, np.uint64(s1), np.uint64(s2))
    tail = data.nbytes % 8
    if tail:
        x = int.from_bytes(data[data.nbytes - tail :].tobytes(), "little")
        at = base + whole.shape[0]
        s1 = (int(s1) + x) & _MASK
        s2 = (int(s2) + x * (2 * at + 1)) & _MASK
    return int(s1), int(s2)


def checksum(data: npt.NDArray[np.uint8]) -> int:
    """The checksum of a contiguous byte array, read in place."""
    return digest(*sums(data), data.nbytes)


def copy(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> int:
    """Copies ``src`` into ``dst`` (contiguous bytes, as many) and returns the
    checksum of what was copied, summed on the way."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copying {src.nbytes} bytes into {dst.nbytes}")
    if src.nbytes % 8:
        np.copyto(dst, src)
        return checksum(dst)
    return load_rows((words(dst).reshape(1, -1),), 0, src)


def load_rows(rows: tuple[Words, ...], block: int, page: npt.NDArray[np.uint8]) -> int:
    """Copies ``page`` into row ``block`` of each layer's ``rows`` (their row
    lengths tile the page, every one a whole number of words) and returns the
    page's checksum, summed on the way."""
    s1, s2 = _load_rows(rows, block, page.view(np.uint64))
    return digest(s1, s2, page.nbytes)


def save_rows(rows: tuple[Words, ...], block: int, page: npt.NDArray[np.uint8]) -> int:
    """Copies row ``block`` of each layer's ``rows`` into ``page`` (as
    ``load_rows`` reads it) and returns the page's checksum, summed on the way."""
    s1, s2 = _save_rows(rows, block, page.view(np.uint64))
    return digest(s1, s2, page.nbytes)


def warm(rows: tuple[Words, ...] = (), page_bytes: int = 8) -> None:
    """Compiles (or loads from the disk cache) the kernels for pages of
    ``page_bytes`` copied to and from ``rows``-like arrays, on scratch buffers,
    so that no engine step waits for the compiler."""
    page = np.zeros(page_bytes, dtype=np.uint8)
    checksum(page)
    copy(np.zeros_like(page), page)
    if rows:
        scratch = tuple(np.zeros((1, r.shape[1]), dtype=np.uint64) for r in rows)
        load_rows(scratch, 0, page)
        save_rows(scratch, 0, page)
