import multiprocessing as mp
import uuid

import numpy as np
import pytest

from kvstore.arena import Arena, CorruptPage

PAGES, PAGE_BYTES = 4, 4096


def _name() -> str:
    return f"moe-test-{uuid.uuid4().hex[:12]}"


def _child_reads(name: str, checksum: int, q: "mp.Queue[bytes]") -> None:
    arena = Arena.attach(name, PAGES, PAGE_BYTES)
    out = np.empty(PAGE_BYTES, dtype=np.uint8)
    arena.read_into(2, out, checksum)
    q.put(out[:8].tobytes())
    arena.page(3)[:4] = [9, 9, 9, 9]  # written in place, seen by the owner
    arena.close()


def test_another_process_reads_and_writes_pages_in_place() -> None:
    arena = Arena.create(_name(), PAGES, PAGE_BYTES)
    try:
        data = np.arange(PAGE_BYTES, dtype=np.uint32).astype(np.uint8)
        checksum = arena.write(2, data)
        ctx = mp.get_context("spawn")
        q: mp.Queue[bytes] = ctx.Queue()
        child = ctx.Process(target=_child_reads, args=(arena.name, checksum, q))
        child.start()
        assert q.get(timeout=60) == bytes(range(8))
        child.join(60)
        assert child.exitcode == 0
        assert list(arena.page(3)[:4]) == [9, 9, 9, 9]
        assert arena.nbytes == PAGES * PAGE_BYTES  # the hard bound
    finally:
        arena.close()


def test_a_corrupted_page_is_refused() -> None:
    arena = Arena.create(_name(), PAGES, PAGE_BYTES)
    try:
        data = np.full(PAGE_BYTES, 7, dtype=np.uint8)
        checksum = arena.write(0, data)
        out = np.empty(PAGE_BYTES, dtype=np.uint8)
        arena.read_into(0, out, checksum)
        assert (out == 7).all()
        arena.page(0)[100] ^= 0xFF  # a flipped byte
        with pytest.raises(CorruptPage, match="page 0"):
            arena.read_into(0, out, checksum)
        with pytest.raises(ValueError, match="4096 bytes"):
            arena.write(1, np.zeros(10, dtype=np.uint8))
    finally:
        arena.close()


def test_typed_cache_blocks_round_trip_as_bytes() -> None:
    arena = Arena.create(_name(), PAGES, PAGE_BYTES)
    try:
        block = np.random.default_rng(0).standard_normal(PAGE_BYTES // 4)
        block = block.astype(np.float32)  # e.g. one layer's latent block
        checksum = arena.write(1, block.view(np.uint8))
        back = np.empty_like(block)
        arena.read_into(1, back.view(np.uint8), checksum)
        assert np.array_equal(back, block)
    finally:
        arena.close()
