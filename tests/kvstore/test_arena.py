import errno
import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np
import pytest

from kvstore.arena import Arena, CorruptPage, unlink_orphaned

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


PARENT = """
import multiprocessing as mp
import os
import sys

from kvstore.arena import Arena


def attach(name):
    Arena.attach(name, 2, 4096).close()


if __name__ == "__main__":
    Arena.create(sys.argv[1], 2, 4096)
    child = mp.get_context("spawn").Process(target=attach, args=(sys.argv[1],))
    child.start()
    child.join(60)
    print("child", child.exitcode, flush=True)
    os._exit(0)  # dies with its arena open: its resource tracker unlinks it
"""


def test_a_child_attaching_leaves_its_parents_arena_to_the_parents_tracker(
    tmp_path: Path,
) -> None:
    # A process multiprocessing starts shares its parent's resource tracker: an
    # engine core and the replica that spawned it, an engine_step worker and
    # the store it saves to. Attaching must not drop the parent's registration.
    name = _name()
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    root = str(Path(__file__).resolve().parents[2])
    env = os.environ | {"PYTHONPATH": root}
    try:
        run = subprocess.run(
            [sys.executable, str(script), name],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.stdout == "child 0\n", run.stderr
        assert "KeyError" not in run.stderr
        segment = Path("/dev/shm") / name
        deadline = time.monotonic() + 10
        while segment.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the tracker outlives its parent for a moment
        assert not segment.exists()  # cleaned up after the dead parent
    finally:
        unlink_orphaned(name)


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


def _leaked_segment(name: str) -> None:
    """A segment left behind as by a killed store: created, nobody maps it."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=4096)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    shm.close()


def test_orphaned_arenas_are_removed_and_mapped_ones_kept() -> None:
    prefix = f"moe-kv-test{uuid.uuid4().hex[:8]}-"
    live = Arena.create(prefix + "live", 2, 4096)
    _leaked_segment(prefix + "dead")
    _leaked_segment(prefix + "held")
    # Another process maps the third one, as an engine maps its store's arena.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from kvstore.arena import Arena; "
            f"a = Arena.attach({prefix + 'held'!r}, 1, 4096); "
            "print('mapped', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "mapped\n"
        assert unlink_orphaned(prefix) == [prefix + "dead"]
        left = sorted(p.name for p in Path("/dev/shm").glob(prefix + "*"))
        assert left == [prefix + "held", prefix + "live"]
    finally:
        holder.kill()
        holder.wait()
        live.close()
    assert unlink_orphaned(prefix) == [prefix + "held"]
    assert not list(Path("/dev/shm").glob(prefix + "*"))


def _mapped_kib(name: str) -> list[int]:
    """This process's resident KiB of each of its mappings of segment ``name``."""
    smaps = Path("/proc/self/smaps").read_text().split("\n")
    return [
        int(next(x for x in smaps[i + 1 :] if x.startswith("Rss:")).split()[1])
        for i, line in enumerate(smaps)
        if line.endswith(f"/dev/shm/{name}")
    ]


def test_a_new_arena_has_its_memory_and_every_process_maps_it_at_once() -> None:
    pages = 64
    arena = Arena.create(_name(), pages, PAGE_BYTES)
    other = Arena.attach(arena.name, pages, PAGE_BYTES)  # as an engine attaches
    try:
        fd = arena._shm._fd  # type: ignore[attr-defined]
        # every page's memory is the segment's already (not left to its first write)
        assert os.fstat(fd).st_blocks * 512 >= pages * PAGE_BYTES
        release = tuple(int(x) for x in os.uname().release.split(".")[:2])
        if release < (5, 14):
            pytest.skip("mapping a segment in at once needs Linux 5.14+")
        # and both mappings are in place before any page is touched
        mapped = _mapped_kib(arena.name)
        assert len(mapped) == 2
        assert all(kib >= pages * PAGE_BYTES // 1024 for kib in mapped)
    finally:
        other.close()
        arena.close()


def test_an_arena_larger_than_shared_memory_is_refused_with_a_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_room(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    name = _name()
    with pytest.raises(OSError, match=r"kvstore\.capacity_bytes") as e:
        Arena.create(name, PAGES, PAGE_BYTES)
    assert e.value.errno == errno.ENOSPC
    assert not (Path("/dev/shm") / name).exists()  # nothing left behind
