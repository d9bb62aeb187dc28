"""What ``tests.perf.s1_profile`` reads of a process's main thread."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from tests.perf.s1_profile import main_thread

SLEEPS, SPIN_S = 40, 0.3


def _sleep_then_spin(ready: Any, go: Any, done: Any, hold: Any) -> None:
    ready.set()
    go.wait()
    for _ in range(SLEEPS):  # asleep, waking SLEEPS times
        time.sleep(0.005)
    end = time.monotonic() + SPIN_S
    while time.monotonic() < end:  # on a core
        pass
    done.set()
    hold.wait()  # alive while it is read


def test_main_thread_counts_time_on_a_core_and_its_sleeps() -> None:
    ctx = mp.get_context("spawn")
    ready, go, done, hold = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=_sleep_then_spin, args=(ready, go, done, hold))
    child.start()
    try:
        assert ready.wait(60)
        before = main_thread(child.pid)
        assert before is not None
        t0 = time.monotonic()
        go.set()
        assert done.wait(60)
        after = main_thread(child.pid)
        wall = time.monotonic() - t0
        assert after is not None
        ran, queued, voluntary, _ = (b - a for a, b in zip(before, after, strict=True))
        assert 0.05 < ran <= wall
        assert queued >= 0
        assert voluntary >= SLEEPS
    finally:
        hold.set()
        child.join(10)
    assert main_thread(child.pid) is None
