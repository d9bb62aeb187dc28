"""An engine replica's reports to the DeepSeekRouter: its running requests and speed.

Reports are how the router learns that a replica exists and how it rebuilds its
state after a restart, so they go out every ``router.report_interval_s`` while
anything runs or changes, and at least every ``heartbeat_s`` while the replica
idles: a report that would say exactly what the last one said, of a replica
with nothing running, waits (every report wakes the replica and the router, and
on a small node that is CPU the engines lose).

What cannot wait for a heartbeat comes through one call held at the router
(``DeepSeekRouter.news``): a restarted router, which knows none of the replica's
state, and Serve starting or ceasing to stop the replica. Its answer sends the
next report at once.
"""

from __future__ import annotations

import asyncio
import contextlib
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
NEWS_WAIT_S = 30.0  # one news call's wait at the router before it is asked again


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
        # The news call pending at the router, and what it was asked against.
        self._news: asyncio.Task[None] | None = None
        self._news_of: tuple[Any, str | None, bool] | None = None
        self._wake = asyncio.Event()  # the news came: report now
        self._force = False  # the next report goes out, even if idle as the last

    def started(self) -> None:
        """The replica is ready for work: from the next report the router may
        place requests here."""
        self._ready = True

    async def run(self) -> None:
        try:
            await self._report()
        finally:
            if self._news is not None:
                self._news.cancel()

    async def _report(self) -> None:
        import ray.exceptions

        loop = asyncio.get_running_loop()
        last_t, last_tokens = loop.time(), self._tokens()
        sent: ReplicaReport | None = None  # the last report the router took
        sent_at = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            self._wake.clear()
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
            forced, self._force = self._force, False
            if recent and not full and not forced and _idle_as(report, sent):
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
            self._follow_news()

    def _follow_news(self) -> None:
        """Keeps one ``news`` call pending at the router, asked against what
        this replica last heard from it."""
        heard = (self._handle, self._router_incarnation, self._draining)
        if self._news is not None and not self._news.done():
            if self._news_of == heard:
                return
            self._news.cancel()
        self._news_of = heard
        self._news = asyncio.ensure_future(self._await_news(*heard))

    async def _await_news(
        self, handle: Any, incarnation: str | None, draining: bool
    ) -> None:
        try:
            news = await handle.news.remote(
                self._replica_id, incarnation, draining, NEWS_WAIT_S
            )
        except Exception as e:  # gone or restarting: the next report finds out
            logger.debug("news from the router failed: %r", e)
            self._force = True
            return
        if news == (incarnation, draining):
            return  # none within NEWS_WAIT_S: the next report asks again
        if news[0] != self._router_incarnation:
            self._resend_all = True  # a new router: it needs everything
        self._force = True
        self._wake.set()


def _idle_as(report: ReplicaReport, last: ReplicaReport | None) -> bool:
    """Nothing runs, nothing changed since ``last``, and it ran nothing either."""
    return (
        last is not None
        and not report.requests
        and not report.kv_events
        and report == last
    )
