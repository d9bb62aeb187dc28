"""Which engines on this node hold a realtime request, in a page of shared memory.

On a CPU node the engines share the cores: a realtime stream decodes at the speed
of its engine's share of them, and a co-located engine running background batches
takes the rest. Each engine core process claims one slot of the board (a POSIX
lock on its bytes, released by the kernel when the process ends) and writes the
time into it at every step that holds a realtime request. An engine without one
reads the board to learn whether another engine on the node has one
(``engine.background_cpu_yield``).

A slot counts while its time is fresher than ``fresh_s``: a dead engine's slot
goes quiet by itself, and the next engine to claim it starts it at zero. Times are
``CLOCK_MONOTONIC``, one clock for every process of the machine. The board is one
file in ``/dev/shm`` (per machine, per pod under Kubernetes); it is created by the
first engine and kept, 2 KiB, for the next.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

SLOTS = 256
SLOT_BYTES = 8  # one float64: when the slot's engine last held realtime
DEFAULT_PATH = Path("/dev/shm/moe-cluster-realtime-board")


class RealtimeBoard:
    def __init__(self, path: Path = DEFAULT_PATH, fresh_s: float = 0.25) -> None:
        self.fresh_s = fresh_s
        size = SLOTS * SLOT_BYTES
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)  # zeros; two engines at once agree
            self._map = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        self._times: npt.NDArray[np.float64] = np.frombuffer(self._map, np.float64)
        self.slot: int | None = None  # None: every slot is held (still reads)
        for i in range(SLOTS):
            try:
                fcntl.lockf(
                    self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, SLOT_BYTES, i * SLOT_BYTES
                )
            except OSError:
                continue
            self.slot = i
            self._times[i] = 0.0  # whatever a dead engine left
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

    def close(self) -> None:
        """Gives the slot up (the process ending does the same)."""
        if self.slot is not None:
            self._times[self.slot] = 0.0
        del self._times
        self._map.close()
        os.close(self._fd)  # drops the lock
