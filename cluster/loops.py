"""The one way a background task repeats: ``every``.

Replica reports aside (they carry their own resend logic), each periodic job of
the cluster (the router's ticker, metrics and store-directory follower, a node
store's directory sync, an engine replica's expert-load poll and store watch) is
a ``step`` that ``every`` runs on time, forever: a step that fails is logged and
the next one runs as planned, so one bad step never stops the job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn


async def every(
    interval_s: float,
    step: Callable[[], Awaitable[object]],
    *,
    what: str,
    logger: logging.Logger,
    first_after: float | None = None,
) -> NoReturn:
    """Awaits ``step()`` every ``interval_s`` seconds, the first after
    ``first_after`` (default: one interval). ``what`` names the job in the log
    line of a failed step (a warning with the error, not a traceback)."""
    await asyncio.sleep(interval_s if first_after is None else first_after)
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # keep going: the next step may well succeed
            logger.warning("%s failed: %r", what, e)
        await asyncio.sleep(interval_s)
