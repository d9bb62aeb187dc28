"""What ``tests.perf.s1_profile`` reads of a process: its main thread, and which
thread holds its GIL."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from tests.perf.s1_profile import engine_waits, gil_shares, main_thread, pyspy

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


# Lines as ``perf trace --tid PID --duration 1`` prints them (from the engine
# core's main thread at four streams): a queue's condition (out of work), the
# GIL's condition and mutex, a socket's poll, and futex wakes that took long only
# because their thread was preempted in them.
PERF_TRACE = """\
   313.040 (21.623 ms): futex(uaddr: 0x5555920d2850, op: WAIT_BITSET|PRIVATE_FLAG|CLOCK_REALTIME, val3: MATCH_ANY) = 0
   948.497 (16.927 ms): futex(uaddr: 0x555592e11550, op: WAIT_BITSET|PRIVATE_FLAG|CLOCK_REALTIME, val3: MATCH_ANY) = 0
  1020.683 ( 3.066 ms): futex(uaddr: 0x7feb7e94e6f4, op: WAIT_BITSET|PRIVATE_FLAG, utime: 0x7ffc494a3010, val3: MATCH_ANY) = 0
  1633.381 ( 2.080 ms): futex(uaddr: 0x7feb7e94e6f8, op: WAIT|PRIVATE_FLAG, val: 2)           = 0
  2918.576 ( 1.118 ms): poll(ufds: 0x7ffc494a3b18, nfds: 1, timeout_msecs: 5000)              = 1
  3133.597 ( 8.760 ms): futex(uaddr: 0x55bf43f57684, op: WAKE|PRIVATE_FLAG, val: 2147483647)  = 0
  3538.675 (11.087 ms): futex(uaddr: 0x555594390e10, op: WAIT_BITSET|PRIVATE_FLAG|CLOCK_REALTIME, val3: MATCH_ANY) = 0
  8031.997 ( 1.782 ms): futex(uaddr: 0x7f8d7574e6f8, op: WAKE|PRIVATE_FLAG, val: 1)           = 0
"""  # noqa: E501


def test_engine_waits_tell_running_out_of_work_from_locks() -> None:
    waits = engine_waits(PERF_TRACE, seconds=2.0)
    # 21.6, 16.9 and 11.1 ms: out of work; the two wakes are not waits.
    assert waits["idle_waits_per_s"] == 1.5
    assert waits["idle_ms_per_s"] == round((21.623 + 16.927 + 11.087) / 2, 2)
    assert waits["idle_wait_p50_ms"] == 16.93
    # The GIL's two waits and the socket's poll.
    assert waits["short_waits_per_s"] == 1.5
    assert waits["short_ms_per_s"] == round((3.066 + 2.080 + 1.118) / 2, 2)
    assert engine_waits("", 1.0)["idle_wait_p50_ms"] == 0.0
