"""Fewer full garbage collections in the serving plane's processes.

A full collection (CPython's generation 2) stops its process while it walks
every object the collector tracks, and every request that process is handling
waits. Two things make those walks long on the serving plane:

- what a process built while it started: imports, the tokenizer, the router's
  tables. Ray Serve freezes it at the end of a replica's start (``gc.freeze``:
  never walked again); the router is a plain actor, and ``settle`` does the
  same there.
- requests in flight. Under a flood the ingress holds every queued request (up
  to ``router.max_queued`` of each class), each a chain of coroutines, a gRPC
  context, a message and spans: measured at 68,000-182,000 tracked objects at
  its full collections, which find almost none of them garbage (20-450 objects
  a time).

CPython runs a full collection every 10 collections of generation 1 once the
objects promoted since the last one exceed a quarter of those it kept. Frozen
objects are not among those kept after the first full collection, so on a served
process that is every 10. Under a 2x background flood on 2 cores that was every
~30 s in the ingress, stopping it for 39-98 ms each (22-71 ms of CPU), and a
205 ms stop of the router (169,000 objects, unfrozen): realtime requests that
arrived then waited that long. ``FULL_EVERY`` makes them ten times rarer. The
cyclic garbage that reaches the oldest generation waits longer for them: a few
hundred objects a collection found; about a thousand tracebacks and frames (of
refused requests) in the ingress after a 60 s flood.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

FULL_EVERY = 100  # generation-1 collections per full collection (CPython: 10)


def settle(what: str, *, freeze: bool = True) -> None:
    """After a process started: collects and freezes what it built (unless
    ``freeze`` is off: Ray Serve does it for a replica once its constructor
    returns, ``RAY_SERVE_FREEZE_GC_ON_STARTUP``), and runs full collections
    ``FULL_EVERY`` times less often than CPython would."""
    if freeze:
        gc.collect()
        gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_EVERY)
    logger.info(
        "%s: %d objects frozen, a full collection every %d of generation 1",
        what,
        gc.get_freeze_count(),
        FULL_EVERY,
    )
