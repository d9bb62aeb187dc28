"""The page checksum: its definition, and that copying sums what it copies."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import page_sum

MASK = (1 << 64) - 1


def reference(data: np.ndarray) -> int:
    """The checksum as ``page_sum`` defines it, word by word in Python."""
    raw = data.tobytes()
    words = [
        int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)
    ]  # a last partial word is zero-padded (little-endian: high bytes)
    s1 = sum(words) & MASK
    s2 = sum(w * (2 * i + 1) for i, w in enumerate(words)) & MASK
    return page_sum.digest(s1, s2, len(raw))


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001, 4096, 36864])
def test_the_checksum_is_the_two_sums_of_the_definition(n: int) -> None:
    data = _bytes(n)
    assert page_sum.checksum(data) == reference(data)


def test_sums_of_parts_in_order_are_the_sums_of_the_page() -> None:
    page = _bytes(3 * 4096 + 5)
    s1 = s2 = 0
    for start, end in ((0, 4096), (4096, 8192), (8192, page.nbytes)):
        s1, s2 = page_sum.sums(page[start:end], start // 8, s1, s2)
    assert page_sum.digest(s1, s2, page.nbytes) == page_sum.checksum(page)


def test_every_single_bit_flip_and_word_swap_shows() -> None:
    page = _bytes(1024)
    good = page_sum.checksum(page)
    for byte in range(page.nbytes):
        for bit in (0, 7):
            page[byte] ^= 1 << bit
            assert page_sum.checksum(page) != good, (byte, bit)
            page[byte] ^= 1 << bit
    words = page.view(np.uint64)
    for a, b in ((0, 1), (2, 3), (0, 127), (10, 64)):
        words[[a, b]] = words[[b, a]]
        assert page_sum.checksum(page) != good, (a, b)
        words[[a, b]] = words[[b, a]]
    assert page_sum.checksum(page) == good


def test_a_zeroed_or_shifted_page_shows() -> None:
    page = _bytes(4096)
    good = page_sum.checksum(page)
    assert page_sum.checksum(np.zeros_like(page)) != good
    assert page_sum.checksum(np.roll(page, 8)) != good
    assert page_sum.checksum(page[:-8]) != page_sum.checksum(page)


def test_copies_return_the_checksum_of_what_they_copied() -> None:
    page = _bytes(4 * 512)
    rows = tuple(np.zeros((6, 64), dtype=np.uint64) for _ in range(4))  # 512 B each
    assert page_sum.load_rows(rows, 3, page) == page_sum.checksum(page)
    assert np.array_equal(np.concatenate([r[3] for r in rows]).view(np.uint8), page)
    assert not any(r[[0, 1, 2, 4, 5]].any() for r in rows)

    back = np.zeros_like(page)
    assert page_sum.save_rows(rows, 3, back) == page_sum.checksum(page)
    assert np.array_equal(back, page)

    for n in (4096, 4093):  # whole words, and not
        src, dst = _bytes(n, seed=1), np.zeros(n, dtype=np.uint8)
        assert page_sum.copy(dst, src) == reference(src)
        assert np.array_equal(dst, src)


def test_a_copy_between_buffers_of_different_sizes_is_refused() -> None:
    # The kernel trusts its bounds: a short destination must never be reached.
    with pytest.raises(ValueError, match="copying 4096 bytes into 4088"):
        page_sum.copy(np.zeros(4088, dtype=np.uint8), _bytes(4096))
