"""The one way a background task repeats: ``every``.

Replica reports aside (they carry their own resend logic), each periodic job of
the cluster (the router's ticker, metrics and store-directory follower, a node
store's directory sync, an engine replica's expert-load poll and store watch) is
a ``step`` that ``every`` runs on time, forever: a step that fails is logged and
the next one runs as planned, so one bad step never stops the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn


async def every(
    interval_s: float | Callable[[], float],
    step: Callable[[], Awaitable[object]],
    *,
    what: str,
    logger: logging.Logger,
    first_after: float | None = None,
    wake: asyncio.Event | None = None,
) -> NoReturn:
    """Awaits ``step()`` every ``interval_s`` seconds, the first after
    ``first_after`` (default: one interval). ``what`` names the job in the log
    line of a failed step (a warning with the error, not a traceback).

    ``interval_s`` may be a function, asked before each wait: a job that has
    nothing to watch may wait longer (each step wakes its process, and on a small
    node every wake-up is CPU the engines lose). ``wake``, when given, ends a wait
    at once when set, for whoever gives the job something to watch; it is cleared
    before each step."""

    def interval() -> float:
        return interval_s() if callable(interval_s) else interval_s

    await _wait(interval() if first_after is None else first_after, wake)
    while True:
        if wake is not None:
            wake.clear()
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # keep going: the next step may well succeed
            logger.warning("%s failed: %r", what, e)
        await _wait(interval(), wake)


async def _wait(seconds: float, wake: asyncio.Event | None) -> None:
    if wake is None:
        await asyncio.sleep(seconds)
    elif not wake.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), seconds)
