"""vLLM's own KV event publisher -> our listener -> the router's directory."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from deployments.engine.kv_events import (
    KVEventListener,
    convert,
    remove_endpoint,
)
from deployments.engine.reporter import Reporter
from kvstore.block_hash import block_hashes
from router.prefix import PrefixDirectory
from router.types import (
    KVEvent,
    ReplicaId,
    ReplicaReport,
    ReportAck,
    RequestProgress,
)
from tests.waiting import until

H = block_hashes(list(range(64)), 16)  # 4 chained block hashes
PROBE = block_hashes(list(range(100, 116)), 16)[0]


def _batch(*events: Any) -> Any:
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=time.time(), events=list(events))


def _stored(hashes: tuple[bytes, ...]) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


async def test_events_published_by_vllm_reach_the_directory(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        ZmqEventPublisher,
    )

    endpoint = f"ipc://{tmp_path / 'kv'}"
    publisher = ZmqEventPublisher(0, endpoint=endpoint, topic="kv")
    listener = KVEventListener(endpoint)
    task = asyncio.create_task(listener.run())
    directory = PrefixDirectory()
    r = ReplicaId("r")
    try:
        # A SUB socket drops what was published before it joined: publish until
        # the first batch shows up, then the real sequence.
        deadline = time.monotonic() + 10
        while not listener.drain():
            assert time.monotonic() < deadline, "no KV events received"
            publisher.publish(_batch(_stored([PROBE])))
            await asyncio.sleep(0.05)
        publisher.publish(_batch(AllBlocksCleared()))
        publisher.publish(_batch(_stored(H[:3])))
        publisher.publish(_batch(BlockRemoved(block_hashes=[H[2]], medium="GPU")))
        publisher.publish(_batch(_stored(H[3:]), _stored(H[2:3])))
        got: list[KVEvent] = []
        while len(got) < 5:
            assert time.monotonic() < deadline
            got += listener.drain()
            await asyncio.sleep(0.02)
        assert [e.kind for e in got] == [
            "cleared",
            "stored",
            "removed",
            "stored",
            "stored",
        ]
        directory.apply(r, got)
        assert directory.cached_blocks(r, H) == 4
        full = listener.drain(full=True)
        assert full[0] == KVEvent("cleared")
        assert set(full[1].block_hashes) == set(H)
    finally:
        task.cancel()
        publisher.shutdown()
    assert (tmp_path / "kv").exists()  # the publisher leaves its socket file
    remove_endpoint(endpoint)
    assert not (tmp_path / "kv").exists()


def test_int_hashes_are_refused() -> None:
    with pytest.raises(ValueError, match="full digest"):
        convert(_batch(_stored((12345,))))  # type: ignore[arg-type]


class FakeRouter:
    """The router actor's ``report`` and ``news`` at its process boundary."""

    def __init__(self) -> None:
        self.incarnation = "one"
        self.draining = False
        self.load: dict[str, float] = {}
        self.reports: list[ReplicaReport] = []
        self.news_calls = 0
        self.fail = False
        self.silent = False  # news never comes: what reports alone find out
        outer = self

        class _Report:
            def remote(self, report: ReplicaReport) -> Any:
                async def answer() -> ReportAck:
                    if outer.fail:
                        raise RuntimeError("restarting")
                    outer.reports.append(report)
                    return ReportAck(outer.incarnation, outer.draining, outer.load)

                return answer()

        class _News:
            def remote(
                self, rid: str, incarnation: str, draining: bool, wait_s: float
            ) -> Any:
                outer.news_calls += 1

                async def answer() -> tuple[str, bool]:
                    heard = (incarnation, draining)
                    deadline = asyncio.get_running_loop().time() + wait_s
                    while outer.silent or (outer.incarnation, outer.draining) == heard:
                        if asyncio.get_running_loop().time() > deadline:
                            break
                        await asyncio.sleep(0.002)
                    return outer.incarnation, outer.draining

                return answer()

        self.report = _Report()
        self.news = _News()

    def reporter(self, **kw: Any) -> Reporter:
        """A replica's reporter to this router, every 10 ms."""
        return Reporter(
            "r1",
            progress=lambda: (),
            tokens_generated=lambda: 0,
            connect=lambda: self,
            interval_s=0.01,
            **kw,
        )

    async def reports_reach(self, n: int) -> None:
        await until(lambda: len(self.reports) >= n, f"{n} reports")


async def test_reporter_resends_all_blocks_to_a_new_router() -> None:
    router = FakeRouter()
    router.silent = True  # what the reports' answers alone tell
    sent: list[bool] = []

    def kv(full: bool) -> tuple[KVEvent, ...]:
        sent.append(full)
        return (KVEvent("cleared"),) if full else ()

    task = asyncio.create_task(router.reporter(kv_events=kv).run())
    reports = router.reports_reach

    try:
        await reports(3)
        assert sent[:3] == [True, False, False]  # first contact gets everything
        router.incarnation = "two"  # the router restarted
        n = len(router.reports)
        await reports(n + 2)
        assert sent[n : n + 2] == [False, True]
        router.fail = True  # a lost report may have carried changes
        await asyncio.sleep(0.05)
        n = len(router.reports)
        router.fail = False
        await reports(n + 2)
        first_after = router.reports[n]
        assert first_after.kv_events == (KVEvent("cleared"),)
        assert router.reports[n + 1].kv_events == ()
    finally:
        task.cancel()


async def test_reporter_says_when_the_router_has_the_replica_draining() -> None:
    router = FakeRouter()
    told: list[bool] = []
    task = asyncio.create_task(router.reporter(on_draining=told.append).run())
    reports = router.reports_reach

    try:
        await reports(2)
        assert told == []  # serving: nothing to say
        router.draining = True
        n = len(router.reports)
        await reports(n + 3)
        assert told == [True]  # once, on the change
        router.draining = False  # Serve kept it after all
        n = len(router.reports)
        await reports(n + 2)
        assert told == [True, False]
    finally:
        task.cancel()


async def test_an_idle_replica_reports_only_its_heartbeat() -> None:
    router = FakeRouter()
    running: tuple[RequestProgress, ...] = ()
    events: list[KVEvent] = []

    def kv(full: bool) -> tuple[KVEvent, ...]:
        out, events[:] = tuple(events), []
        return out

    reporter = Reporter(
        "r1",
        progress=lambda: running,
        tokens_generated=lambda: 0,
        kv_events=kv,
        connect=lambda: router,
        interval_s=0.01,
        heartbeat_s=0.2,
    )
    task = asyncio.create_task(reporter.run())
    try:
        await router.reports_reach(1)
        await asyncio.sleep(0.3)
        idle = len(router.reports)
        assert 2 <= idle <= 4  # the first contact and heartbeats, not ~30
        running = (RequestProgress("q", 8, 1, 16),)
        await asyncio.sleep(0.1)
        busy = len(router.reports) - idle
        assert busy >= 5  # every interval while a request runs
        running = ()
        await asyncio.sleep(0.05)
        after = len(router.reports)
        assert router.reports[-1].requests == ()  # its end is reported at once
        events.append(KVEvent("cleared"))  # the engine's cache changed: at once
        await router.reports_reach(after + 1)
        assert router.reports[after].kv_events == (KVEvent("cleared"),)
        await asyncio.sleep(0.1)
        assert len(router.reports) <= after + 2
    finally:
        task.cancel()


async def test_an_idle_replica_tells_a_new_router_and_hears_of_draining_at_once() -> (
    None
):
    """Idle, a replica reports once an hour here: what cannot wait comes from its
    pending ``news`` call."""
    router = FakeRouter()
    told: list[bool] = []

    def kv(full: bool) -> tuple[KVEvent, ...]:
        return (KVEvent("cleared"),) if full else ()

    reporter = router.reporter(kv_events=kv, heartbeat_s=3600, on_draining=told.append)
    task = asyncio.create_task(reporter.run())
    try:
        await router.reports_reach(2)  # first contact (everything), then none
        await asyncio.sleep(0.1)
        assert len(router.reports) == 2  # idle as the last: nothing more
        router.incarnation = "two"  # the router restarted
        await router.reports_reach(4)
        assert router.reports[2].kv_events == (KVEvent("cleared"),)  # all, at once
        await asyncio.sleep(0.1)
        assert len(router.reports) == 4
        router.draining = True  # Serve is stopping the replica
        await until(lambda: told == [True], "the replica to hear it drains")
        router.draining = False  # Serve kept it after all
        await until(lambda: told == [True, False], "the replica to hear it serves")
        await asyncio.sleep(0.1)
        assert len(router.reports) == 6
        full = [r.kv_events == (KVEvent("cleared"),) for r in router.reports]
        assert full == [True, False, True, False, False, False]
        assert router.news_calls == 4  # one pending call per answer it heard
    finally:
        task.cancel()
    await asyncio.sleep(0.01)
    assert reporter._news is not None and reporter._news.done()  # ended with it


def test_the_listener_reports_its_engines_blocks_and_resends_them_all() -> None:
    listener = KVEventListener(None)
    listener.apply([KVEvent("stored", (H[0], H[1]))])
    listener.apply([KVEvent("removed", (H[0],)), KVEvent("stored", (H[2],))])
    assert listener.drain() == (
        KVEvent("stored", (H[0], H[1])),
        KVEvent("removed", (H[0],)),
        KVEvent("stored", (H[2],)),
    )
    assert listener.drain() == ()
    cleared, stored = listener.drain(full=True)
    assert cleared == KVEvent("cleared") and set(stored.block_hashes) == {H[1], H[2]}
    listener.apply([KVEvent("cleared")])
    assert listener.drain() == (KVEvent("cleared"),)
    assert listener.drain(full=True) == (KVEvent("cleared"), KVEvent("stored", ()))


async def test_reporter_keeps_the_routers_load_view_for_the_autoscaler() -> None:
    router = FakeRouter()
    reporter = router.reporter()
    assert reporter.load == {}
    router.load = {"queued_realtime": 3.0}
    task = asyncio.create_task(reporter.run())
    try:
        while not router.reports:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.03)
        assert reporter.load == {"queued_realtime": 3.0}
    finally:
        task.cancel()


async def test_reporter_says_not_ready_until_the_replica_has_started() -> None:
    router = FakeRouter()
    reporter = router.reporter()
    task = asyncio.create_task(reporter.run())
    reports = router.reports_reach
    try:
        await reports(2)  # known to the router while it warms up ...
        assert not any(r.ready for r in router.reports)
        reporter.started()  # ... and given work from the next report on
        n = len(router.reports)
        await reports(n + 1)
        assert router.reports[n].ready
    finally:
        task.cancel()
