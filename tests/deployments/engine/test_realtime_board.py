"""The node's realtime board: one slot per engine process, claimed with a lock the
kernel drops when the process ends, read by every other engine."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from deployments.engine.realtime_board import SLOT_BYTES, SLOTS, RealtimeBoard


def _mark_and_hold(path: Path, marked: Any, release: Any) -> None:
    board = RealtimeBoard(path)
    board.mark(time.monotonic())
    marked.set()
    release.wait(30)
    board.mark(time.monotonic())  # still holding realtime as it dies


def test_engines_see_each_others_realtime_not_their_own_and_stale_marks_fade(
    tmp_path: Path,
) -> None:
    path = tmp_path / "board"
    mine = RealtimeBoard(path, fresh_s=0.2)
    ctx = multiprocessing.get_context("spawn")
    marked, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_mark_and_hold, args=(path, marked, release))
    try:
        assert mine.slot == 0
        now = time.monotonic()
        mine.mark(now)
        assert not mine.others_hold_realtime(now)  # its own mark does not count
        other.start()  # another engine process: the next slot
        assert marked.wait(60)
        now = time.monotonic()
        assert mine.others_hold_realtime(now)
        assert not mine.others_hold_realtime(now + 0.21)  # stale: it stopped marking
        # A frontend wakes the engines it started (the child: its parent's pid is
        # this process's) and any in its own process (``mine``).
        # (Kept open to the end: closing it here would drop ``mine``'s lock.)
        frontend = RealtimeBoard(path, claim=False)
        assert frontend.slot is None
        since = time.monotonic()
        assert not mine.woken_since(since)
        assert frontend.wake(os.getpid()) == 2
        assert mine.woken_since(since)
        assert not mine.others_hold_realtime(time.monotonic() + 0.21)
        # A realtime request's wake marks its engines as holding realtime
        # before their first step with it.
        assert frontend.wake(os.getpid(), realtime=True) == 2
        assert mine.others_hold_realtime(time.monotonic())
        assert frontend.wake(2**31 - 1) == 0
        release.set()
        other.join(30)
        assert other.exitcode == 0
        # Its slot is free again: the next engine takes it and starts it at zero.
        assert mine.others_hold_realtime(time.monotonic())  # its last mark, fresh
        mine.mark(0.0)  # long ago
        assert _board_in_child(path, fresh_s=120) == (1, False)
        frontend.close()
    finally:
        release.set()
        if other.is_alive() or other.exitcode is not None:
            other.join(30)
        mine.close()


def test_a_full_board_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "board"
    holder = RealtimeBoard(path)
    # POSIX locks are per process: this one takes every slot.
    fcntl.lockf(holder._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, SLOTS * SLOT_BYTES, 0)
    holder.mark(time.monotonic())
    try:
        assert _board_in_child(path, 120) == (None, True)  # no slot, still reads
    finally:
        holder.close()


def _probe(path: Path, fresh_s: float, out: Any) -> None:
    b = RealtimeBoard(path, fresh_s=fresh_s)
    out.put((b.slot, b.others_hold_realtime(time.monotonic())))


def _board_in_child(path: Path, fresh_s: float) -> tuple[int | None, bool]:
    """(slot, whether another engine holds realtime) as a new engine sees them."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_probe, args=(path, fresh_s, q))
    p.start()
    got: tuple[int | None, bool] = q.get(timeout=60)
    p.join(30)
    return got
