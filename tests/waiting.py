"""Polling a condition instead of sleeping for it: the one helper every test uses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls ``condition`` until it returns a truthy value (returned) or ``timeout``
    seconds pass (``what`` names what was awaited in the failure)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


async def until(condition: Callable[[], Any], what: str, timeout: float = 5) -> Any:
    """``wait_until`` for a test on the event loop: the loop runs meanwhile."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)
    return value
