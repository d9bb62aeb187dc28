"""Which engines on this node hold a realtime request, in shared memory.

On a CPU node the engines share the cores: a realtime stream decodes at the speed
of its engine's share of them, and a co-located engine running background batches
takes the rest. Each engine core process claims one slot of the board (a POSIX
lock on its bytes, released by the kernel when the process ends) and writes the
time into it at every step that holds a realtime request. An engine without one
reads the board to learn whether another engine on the node has one
(``engine.background_cpu_yield``), and idles if so.

An idling engine does not see requests sent to it (vLLM's engine core reads its
input between steps), so its frontend, the engine replica's process, wakes it
before it sends a realtime or normal request: each slot also holds its engine's
process id and parent's (the frontend's), and a wake time. A realtime request's
wake also marks the slot, so the other engines give way before its first step.

A slot counts while its time is fresher than ``fresh_s``: a dead engine's slot
goes quiet by itself, and the next engine to claim it starts it afresh. Times are
``CLOCK_MONOTONIC``, one clock for every process of the machine. The board is one
file in ``/dev/shm`` (per machine, per pod under Kubernetes); it is created by the
first engine and kept, 8 KiB, for the next.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

SLOTS = 256
SLOT_BYTES = 8  # the lock's unit: slot i locks bytes [8i, 8i + 8)
# Per slot, each an array of SLOTS: when its engine last held realtime; when its
# frontend last woke it; its engine's pid; the engine's parent's pid.
_FIELDS = 4
DEFAULT_PATH = Path("/dev/shm/moe-cluster-realtime-board")
WAKE_CHECK_S = 0.002  # how often an idling engine looks for a wake


class RealtimeBoard:
    """The board as an engine (``claim``: it takes a slot) or a frontend sees it."""

    def __init__(
        self, path: Path = DEFAULT_PATH, fresh_s: float = 0.25, claim: bool = True
    ) -> None:
        self.fresh_s = fresh_s
        size = _FIELDS * SLOTS * 8
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)  # zeros; two engines at once agree
            self._map = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        self._times: npt.NDArray[np.float64] = np.frombuffer(
            self._map, np.float64, SLOTS
        )
        self._wakes: npt.NDArray[np.float64] = np.frombuffer(
            self._map, np.float64, SLOTS, SLOTS * 8
        )
        self._pids: npt.NDArray[np.int64] = np.frombuffer(
            self._map, np.int64, 2 * SLOTS, 2 * SLOTS * 8
        ).reshape(2, SLOTS)
        self.slot: int | None = None  # None: no slot (a frontend, or a full board)
        for i in range(SLOTS if claim else 0):
            try:
                fcntl.lockf(
                    self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, SLOT_BYTES, i * SLOT_BYTES
                )
            except OSError:
                continue
            self.slot = i
            self._times[i] = self._wakes[i] = 0.0  # whatever a dead engine left
            self._pids[:, i] = (os.getpid(), os.getppid())
            break
        self._others = np.ones(SLOTS, dtype=bool)
        if self.slot is not None:
            self._others[self.slot] = False

    def mark(self, now: float) -> None:
        """This engine holds a realtime request at ``now`` (``time.monotonic``)."""
        if self.slot is not None:
            self._times[self.slot] = now

    def others_hold_realtime(self, now: float) -> bool:
        """Whether another engine on the node held a realtime request within
        ``fresh_s`` of ``now``."""
        return bool(np.any((self._times > now - self.fresh_s) & self._others))

    def wake(self, pid: int, realtime: bool = False) -> int:
        """Wakes the engines that process ``pid`` is or started (a frontend
        about to send them a request); returns how many slots it woke. For a
        realtime request it also marks them as holding one: the node's other
        engines give way from now, while the request travels into its engine
        and is prefilled, not only from its engine's first step with it."""
        mine = (self._pids == pid).any(axis=0)
        now = time.monotonic()
        self._wakes[mine] = now
        if realtime:
            self._times[mine] = now
        return int(mine.sum())

    def woken_since(self, t: float) -> bool:
        """Whether this engine's frontend woke it after ``t``."""
        return self.slot is not None and bool(self._wakes[self.slot] > t)

    def idle(self, seconds: float, since: float) -> float:
        """Sleeps ``seconds``, or until a wake after ``since``; returns the
        time slept."""
        start = time.monotonic()
        end = start + seconds
        now = start
        while now < end and not self.woken_since(since):
            time.sleep(min(WAKE_CHECK_S, end - now))
            now = time.monotonic()
        return now - start

    def close(self) -> None:
        """Gives the slot up (the process ending does the same). POSIX locks
        are the process's: closing any board of the same file in a process
        gives up that process's slot too."""
        if self.slot is not None:
            self._times[self.slot] = 0.0
            self._pids[:, self.slot] = 0
        del self._times, self._wakes, self._pids
        self._map.close()
        os.close(self._fd)  # drops the lock
