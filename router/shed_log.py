"""The router's log lines for the requests it sheds, bounded under a flood.

Each shed request used to get a line of its own. Shedding is what the router
does under overload, so a flood of refusals became a flood of lines: written by
the router, shipped by Ray's log monitor through the GCS to the console, on the
CPU the requests still being served need. Every shed is counted
(``ray_moe_cluster_router_shed_total``) and traced already; the log is for a person
reading it.

So the first ``burst`` sheds of each ``window_s`` get a line each, as before;
the rest of that window are counted by class and reason, and one line says how
many were held back once the window is over.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections import Counter
from collections.abc import Callable

from router.types import Shed


class ShedLog:
    def __init__(
        self,
        logger: logging.Logger,
        window_s: float = 10.0,
        burst: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._window_s = window_s
        self._burst = burst
        self._clock = clock
        self._window_start: float | None = None
        self._logged = 0  # lines of their own in this window
        self._held: Counter[tuple[str, str]] = Counter()  # (qos, reason) -> sheds

    def shed(self, request_id: str, qos: str, e: Shed) -> None:
        """One shed request: a line of its own while the window has room."""
        now = self._clock()
        if self._window_start is None or now - self._window_start >= self._window_s:
            self._end_window(now)  # and the next one starts now
        if self._logged < self._burst:
            self._logged += 1
            self._logger.info("shed %s (%s): %s", request_id, qos, e)
        else:
            self._held[(qos, e.reason)] += 1

    def tick(self) -> None:
        """Ends a window that is over (its summary, if any): called
        periodically, so a flood's last window is reported when it stops."""
        start = self._window_start
        if start is not None and self._clock() - start >= self._window_s:
            self._end_window(None)

    def _end_window(self, now: float | None) -> None:
        if self._held:
            parts = ", ".join(
                f"{qos} {reason} {n}" for (qos, reason), n in sorted(self._held.items())
            )
            # Outside any request's context: the line is about many, and the
            # request whose shed ended the window would lend it its ids.
            contextvars.Context().run(
                self._logger.info,
                "shed %d more requests within %g s without a line each (%s)",
                sum(self._held.values()),
                self._window_s,
                parts,
            )
        self._held.clear()
        self._logged = 0
        self._window_start = now
