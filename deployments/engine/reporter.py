"""An engine replica's reports to the DeepSeekRouter: its running requests and speed.

Reports are how the router learns that a replica exists and how it rebuilds its
state after a restart, so they go out every ``router.report_interval_s`` while
anything runs or changes, and at least every ``heartbeat_s`` while the replica
idles: a report that would say exactly what the last one said, of a replica
with nothing running, waits (every report wakes the replica and the router, and
on a small node that is CPU the engines lose).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from router.admission import Ewma
from router.types import (
    ExpertLoad,
    KVEvent,
    ReplicaId,
    ReplicaReport,
    ReportAck,
    RequestProgress,
)

logger = logging.getLogger("moe_cluster.engine")
RATE_SMOOTHING = 0.3


class Reporter:
    def __init__(
        self,
        replica_id: str,
        *,
        progress: Callable[[], tuple[RequestProgress, ...]],
        tokens_generated: Callable[[], int],
        kv_events: Callable[[bool], tuple[KVEvent, ...]] = lambda full: (),
        expert_load: Callable[[], ExpertLoad | None] = lambda: None,
        group: tuple[str, int, int] = ("", 0, 1),
        node_id: str = "",
        connect: Callable[[], Any],
        interval_s: float,
        heartbeat_s: float | None = None,
        on_draining: Callable[[bool], None] = lambda draining: None,
    ) -> None:
        self._replica_id = ReplicaId(replica_id)
        self._progress = progress
        self._tokens = tokens_generated
        self._kv_events = kv_events  # (full) -> changes since last, or everything
        self._expert_load = expert_load
        self._group = group  # (group id, rank, ranks)
        self._node_id = node_id
        self._router_incarnation: str | None = None
        self._resend_all = True
        self._connect = connect  # returns the router actor handle (blocking)
        self._interval_s = interval_s
        # An idle replica's unchanged report goes out this often (None: every
        # interval, as any other).
        self._heartbeat_s = heartbeat_s
        self._handle: Any = None
        self._rate = Ewma(RATE_SMOOTHING, 0.0)  # tokens/s while busy
        # Called when the router's answer says Serve is stopping this replica
        # (True), or no longer (False).
        self._on_draining = on_draining
        self._draining = False
        # Reports say "not ready" until the replica has started (``ready``): the
        # router knows it, its blocks and its load, but places nothing there.
        self._ready = False
        # The router's view of the load in its last answer (for the autoscaler).
        self.load: dict[str, float] = {}

    def started(self) -> None:
        """The replica is ready for work: from the next report the router may
        place requests here."""
        self._ready = True

    async def run(self) -> None:
        import ray.exceptions

        loop = asyncio.get_running_loop()
        last_t, last_tokens = loop.time(), self._tokens()
        sent: ReplicaReport | None = None  # the last report the router took
        sent_at = 0.0
        while True:
            await asyncio.sleep(self._interval_s)
            now, tokens = loop.time(), self._tokens()
            running = self._progress()
            if running and tokens > last_tokens:
                self._rate.add((tokens - last_tokens) / (now - last_t))
            last_t, last_tokens = now, tokens
            full = self._resend_all
            report = ReplicaReport(
                self._replica_id,
                running,
                self._rate.value,
                kv_events=self._kv_events(full),
                expert_load=self._expert_load(),
                group=self._group[0],
                rank=self._group[1],
                group_size=self._group[2],
                node_id=self._node_id,
                ready=self._ready,
            )
            beat = self._heartbeat_s
            recent = beat is not None and now - sent_at < beat
            if recent and not full and _idle_as(report, sent):
                continue
            try:
                if self._handle is None:
                    self._handle = await asyncio.to_thread(self._connect)
                ack: ReportAck = await asyncio.wait_for(
                    self._handle.report.remote(report), 2
                )
            except Exception as e:  # restarting or slow: the next report catches up
                # Its KV changes may be lost: the next report sends the whole set.
                self._resend_all = True
                if isinstance(e, ray.exceptions.ActorDiedError):
                    self._handle = None  # gone for good: create it again
                logger.debug("report to the router failed: %r", e)
                continue
            # A router that has not seen this replica's blocks yet (first contact,
            # or restarted since) gets them all in the next report.
            self._resend_all = ack.incarnation != self._router_incarnation and not full
            self._router_incarnation = ack.incarnation
            sent, sent_at = report, now
            self.load = ack.load
            if ack.draining != self._draining:
                self._draining = ack.draining
                self._on_draining(ack.draining)


def _idle_as(report: ReplicaReport, last: ReplicaReport | None) -> bool:
    """Nothing runs, nothing changed since ``last``, and it ran nothing either."""
    return (
        last is not None
        and not report.requests
        and not report.kv_events
        and report == last
    )
