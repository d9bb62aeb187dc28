"""What ``tests.perf.s1_profile`` reads of a process: its main thread, and which
thread holds its GIL."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from tests.perf.s1_profile import gil_shares, main_thread, pyspy

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


def _spin_in_a_thread(ready: Any, hold: Any) -> None:
    import threading

    def spin() -> None:
        while not hold.is_set():
            sum(range(1000))  # Python code: holds the GIL

    threading.Thread(target=spin, name="spinner", daemon=True).start()
    ready.set()
    hold.wait()  # the main thread waits without the GIL


def test_gil_shares_name_the_thread_that_holds_the_gil(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    ready, hold = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_spin_in_a_thread, args=(ready, hold))
    child.start()
    try:
        assert ready.wait(60)
        seconds = 2
        (spy,) = pyspy({child.pid: "child"}, seconds, tmp_path, gil=True)
        assert spy.wait(60) == 0
    finally:
        hold.set()
        child.join(10)
    shares = gil_shares(tmp_path / f"{child.pid}.txt", seconds)
    spinner = sum(v for k, v in shares.items() if "spinner" in k)
    waiting = sum(v for k, v in shares.items() if "MainThread" in k)
    # py-spy's own pace on a busy machine lowers every share alike.
    assert spinner > 0.3, shares
    assert waiting < spinner / 10, shares
