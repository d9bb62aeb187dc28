"""The page store of each node and the cluster's page directory, as Ray actors.

- ``NodeStoreActor``: one per node (pinned to it), detached so pages outlive the
  engine replicas that wrote them. It owns the node's shared-memory arena and serves
  the engines on the node over a Unix socket (``rpc``). Every ``sync_interval_s`` it
  publishes its page changes and hot prefixes to the directory and mirrors the
  directory back (with nothing to publish, every ``IDLE_SYNC_EVERY`` intervals).
  On a local miss that another node can serve, it fetches the pages from that
  node's store (through Ray's object store: one copy out of the remote arena,
  zero-copy into this process, one copy into the local arena) while the engine's
  request waits a step or two.
- ``KVDirectoryActor``: one per application, soft state; after a restart the stores'
  next syncs rebuild it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, ClassVar

import numpy as np
import ray

from cluster.actors import NAMESPACE, singleton_options
from cluster.config import KVStoreConfig
from cluster.loops import every
from kvstore.arena import SHM_DIR, unlink_orphaned
from kvstore.block_hash import BlockHash
from kvstore.directory import Directory, Entry, NodeId
from kvstore.node_store import Changes, HotKey, NodeStore
from kvstore.rpc import Fetch, StoreServer

logger = logging.getLogger("moe_cluster.kvstore")


def directory_name(app: str) -> str:
    return f"{app}-kv-directory"


def store_name(app: str, node_id: NodeId) -> str:
    return f"{app}-kv-{node_id[:16]}"


def socket_path(app: str, node_id: NodeId) -> str:
    return f"/tmp/moe-cluster-kv-{app}-{node_id[:16]}.sock"


ARENA_PREFIX = "moe-kv-"  # every store's arena, whatever its app and node
# A store with nothing new to publish syncs every this many sync intervals (to
# mirror the other nodes' pages), not every one: each sync wakes it and the
# directory, and an idle node's CPU is its engines'.
IDLE_SYNC_EVERY = 4


def arena_prefix(app: str, node_id: NodeId) -> str:
    """Shared-memory name of the app's arenas on a node, up to the incarnation."""
    return f"{ARENA_PREFIX}{hashlib.sha1(app.encode()).hexdigest()[:8]}-{node_id[:12]}"


def _unlink_stale_arenas(prefix: str) -> None:
    """Removes the arenas of this node's earlier stores of the app. A store that
    was killed (not shut down) leaves its segment behind, holding its memory;
    one store runs per app and node, so any such segment is its predecessor's.
    Engines still mapping one keep their mapping until they let go of it."""
    if not SHM_DIR.is_dir():
        return
    for stale in SHM_DIR.glob(f"{prefix}-*"):
        logger.warning("removing the arena of a store that died: %s", stale.name)
        stale.unlink(missing_ok=True)


class KVDirectoryActor:
    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex
        self.directory = Directory()

    def sync(
        self,
        node: NodeId,
        incarnation: str,
        since: int,
        changes: Changes[BlockHash] | None,
        hot: list[tuple[HotKey, int]],
        mirror_incarnation: str,
        mirror_since: int,
    ) -> tuple[int, str, Changes[Entry]]:
        """A store's one call each sync. Its ``changes`` (its log after ``since``;
        None while no engine has opened its arena) are applied only where they
        follow what the directory holds of the node: after the directory or the
        store restarted they are dropped, and the store sends everything again.
        Returns where the node's log is to be sent from next, and the directory's
        own changes after (``mirror_incarnation``, ``mirror_since``)."""
        if changes is not None:
            if changes.full or self.directory.cursor(node, incarnation) == since:
                self.directory.publish(node, incarnation, changes)
            self.directory.set_hot(node, hot)
        cursor = self.directory.cursor(node, incarnation)
        return (cursor, *self.changes(mirror_incarnation, mirror_since))

    def changes(self, incarnation: str, since: int) -> tuple[str, Changes[Entry]]:
        if incarnation != self.incarnation:
            since = -1
        return self.incarnation, self.directory.log.since(since)

    def hottest(self, n: int) -> list[HotKey]:
        return self.directory.hottest(n)

    def summary(self) -> dict[str, int]:
        return self.directory.summary()


class NodeStoreActor:
    def __init__(self, app: str, node_id: NodeId, config: KVStoreConfig) -> None:
        self.app, self.node_id, self.config = app, node_id, config
        self.incarnation = uuid.uuid4().hex
        prefix = arena_prefix(app, node_id)
        _unlink_stale_arenas(prefix)
        for orphan in unlink_orphaned(ARENA_PREFIX):
            logger.warning("removed an arena no process maps: %s", orphan)
        self.mirror = Directory()  # the cluster's directory as last synced
        self.store = NodeStore(
            f"{prefix}-{self.incarnation[:8]}",
            config.capacity_bytes,
            elsewhere=lambda: self.mirror.held_elsewhere(self.node_id),
        )
        self._mirror_from = ("", -1)  # directory incarnation, seq
        self._published = -1  # this store's log, as far as the directory has it
        self._hot_sent: list[tuple[HotKey, int]] = []  # hot prefixes last published
        self._quiet_steps = 0  # sync intervals passed without a sync
        self._syncing = asyncio.Lock()
        self.server = StoreServer(
            self.store,
            socket_path(app, node_id),
            on_miss=self._on_miss if config.fetch else None,
            fetched=self._fetched if config.fetch else None,
        )
        self._fetching: dict[BlockHash, asyncio.Task[int]] = {}
        self._settled: dict[BlockHash, float] = {}  # fetch ended: don't retry at once
        # First page of each recent fetch -> what it fetched (lookups report it).
        self._fetches: dict[BlockHash, Fetch] = {}
        self._started = False
        self._directory: Any = None
        self._metrics = _StoreMetrics(node_id)

    async def start(self) -> str:
        """Serves the node's engines; returns the socket they connect to."""
        if not self._started:
            self._started = True
            await self.server.start()
            asyncio.get_running_loop().create_task(self._sync_loop())
        return self.server.path

    # -- directory sync ----------------------------------------------------------

    async def _sync_loop(self) -> None:
        async def step() -> None:
            self.store.maintain_presence(self.config.sync_interval_s)
            self._metrics.update(self.store.summary())
            self._quiet_steps += 1
            if self._quiet_steps < IDLE_SYNC_EVERY and not self._news():
                return
            self._quiet_steps = 0
            await self.sync()  # fails while the directory restarts: next time

        await every(
            self.config.sync_interval_s,
            step,
            what="kv directory sync",
            logger=logger,
            first_after=0,
        )

    def _news(self) -> bool:
        """Whether the directory lacks something of this store's: a page change
        or a change in its hot prefixes (or it was never synced)."""
        if self._directory is None:
            return True
        if self.store.index is None:
            return False
        if self.store.log.seq != self._published:
            return True
        return self.store.hot.top(32) != self._hot_sent

    async def sync(self) -> None:
        """Publishes this node's changes and mirrors the directory: one call to
        the directory, two when it did not hold what the changes follow (it
        restarted: the second sends everything)."""
        async with self._syncing:
            if self._directory is None:
                self._directory = directory(self.app)
            for _ in range(2):
                since = self._published
                index = self.store.index is not None
                changes = self.store.changes(since) if index else None
                hot = self.store.hot.top(32) if index else []
                cursor, inc, log = await self._directory.sync.remote(
                    self.node_id,
                    self.incarnation,
                    since,
                    changes,
                    hot,
                    *self._mirror_from,
                )
                self._hot_sent = hot
                self._follow(log)
                self._mirror_from = (inc, log.seq)
                self._published = cursor
                if changes is None or cursor == changes.seq:
                    return

    def _follow(self, log: Changes[Entry]) -> None:
        """Mirrors the directory's changes, and tells the presence filter which
        pages other nodes now hold (or no longer do)."""
        me = self.node_id
        if log.full:  # the mirror starts again from what the log holds
            self.store.gone_elsewhere(len(self.mirror.held_elsewhere(me)))
        self.mirror.follow(log)
        for node, h in log.added:
            if node != me:
                self.store.add_elsewhere(h)
        self.store.gone_elsewhere(sum(node != me for node, _ in log.removed))

    # -- fetching from other nodes -----------------------------------------------

    def _on_miss(self, hashes: Sequence[BlockHash], first_missing: int) -> bool:
        key = hashes[first_missing]
        if key in self._fetching:
            return True
        settled = self._settled.get(key)
        if settled is not None and time.monotonic() - settled < 5.0:
            return False  # just fetched (or failed): answer from what is here
        fetch = self._fetch_from_peer(hashes[first_missing:])
        if fetch is None:
            return False
        task = asyncio.get_running_loop().create_task(fetch)
        self._fetching[key] = task
        task.add_done_callback(lambda _: self._fetch_done(key))
        return True

    def _fetch_done(self, key: BlockHash) -> None:
        self._fetching.pop(key, None)
        self._settled[key] = time.monotonic()
        if len(self._settled) > 4096:
            cutoff = time.monotonic() - 5.0
            self._settled = {k: t for k, t in self._settled.items() if t > cutoff}
            self._fetches = {
                k: f for k, f in self._fetches.items() if k in self._settled
            }

    def _fetched(self, pages: Sequence[BlockHash]) -> Fetch | None:
        """The recent fetch that brought one of ``pages`` (a lookup's found run)."""
        if not self._fetches:
            return None
        for h in pages:
            if (fetch := self._fetches.get(h)) is not None:
                return fetch
        return None

    def _fetch_from_peer(
        self, missing: Sequence[BlockHash]
    ) -> Coroutine[Any, Any, int] | None:
        """Fetching the longest run of ``missing`` another node holds (as the
        directory was last mirrored), or None when no other node holds its first."""
        found = self.mirror.locate(missing, exclude=self.node_id)
        if found is None or self.store.arena is None:
            return None
        node, n = found
        return self._fetch(node, list(missing[:n]))

    async def _fetch(self, node: NodeId, hashes: list[BlockHash]) -> int:
        try:
            remote = ray.get_actor(store_name(self.app, node), namespace=NAMESPACE)
            got: list[BlockHash]
            pages: np.ndarray
            t0 = time.monotonic()
            got, pages = await asyncio.wait_for(
                remote.export.remote(hashes), self.config.fetch_timeout_s
            )
            n = self.store.import_pages(got, pages)
            seconds = time.monotonic() - t0
            self._metrics.fetched(int(pages.nbytes), seconds)
            if got:
                self._fetches[got[0]] = Fetch(node, n, int(pages.nbytes), seconds)
            logger.info(
                "fetched %d pages (%d bytes) from node %s in %.3f s",
                n,
                pages.nbytes,
                node[:12],
                seconds,
            )
            return n
        except Exception as e:
            self._metrics.fetch_failed()
            logger.warning("fetching %d pages from %s failed: %s", len(hashes), node, e)
            return 0

    async def pull(self, hashes: list[BlockHash]) -> int:
        """Makes the longest prefix of ``hashes`` local (fetching what another node
        holds); returns how many pages of it are here now."""
        have = self.store.held(hashes)
        if have < len(hashes):
            await self.sync()
            if (fetch := self._fetch_from_peer(hashes[have:])) is not None:
                await fetch
                have = self.store.held(hashes)
        return have

    # -- what other nodes and operators call ------------------------------------

    def export(self, hashes: list[BlockHash]) -> tuple[list[BlockHash], np.ndarray]:
        return self.store.export(hashes)

    async def until_gone(self) -> None:
        """Never answers: whoever watches this store learns of its death from the
        error Ray raises for the pending call, without asking again and again."""
        await asyncio.get_running_loop().create_future()

    def summary(self) -> dict[str, Any]:
        arena = self.store.arena.name if self.store.arena is not None else ""
        return {
            "node": self.node_id,
            "arena": arena,
            "mirror": self.mirror.summary(),  # pages per node, as last synced
            **self.store.summary(),
        }

    def changes(self, incarnation: str, since: int) -> tuple[str, Changes[BlockHash]]:
        """Page changes after ``since`` of the store ``incarnation`` (everything,
        when that is not this one)."""
        if incarnation != self.incarnation:
            since = -1
        return self.incarnation, self.store.changes(since)

    def corrupt(self, h: BlockHash) -> bool:
        """Flips a byte of a stored page (tests and drills: the checksum must catch
        it and the page be recomputed)."""
        index, arena = self.store.index, self.store.arena
        refs = index.lookup([h]) if index else []
        if not refs or arena is None:
            return False
        page = arena.page(refs[0].index)
        page[len(page) // 2] ^= 0xFF
        return True

    async def shutdown(self) -> None:
        await self.server.stop()
        self.store.close()


class _StoreMetrics:
    """The store's numbers on Ray's metrics endpoint (``ray_`` prefix there)."""

    COUNTERS: ClassVar[dict[str, str]] = {  # summary key -> description
        "hit_pages": "Pages found in the store for a prompt (loaded, not computed).",
        "miss_pages": "Prompt pages looked up and not found.",
        "saved_pages": "Pages engines saved into the store.",
        "evictions": "Pages evicted (least recently used) to make room.",
        "dropped_pages": "Pages dropped because they failed their checksum.",
        "imported_pages": "Pages fetched from other nodes.",
        "exported_pages": "Pages sent to other nodes.",
    }

    def __init__(self, node: NodeId) -> None:
        from ray.util import metrics

        self._tags = {"node": node[:16]}
        self._last: dict[str, int] = {}
        self._counters = {
            key: metrics.Counter(f"moe_cluster_kv_{key}", desc, ("node",))
            for key, desc in self.COUNTERS.items()
        }
        self._pages = metrics.Gauge(
            "moe_cluster_kv_pages", "Pages the node's store holds.", ("node",)
        )
        self._capacity = metrics.Gauge(
            "moe_cluster_kv_capacity_pages", "Pages the arena can hold.", ("node",)
        )
        self._hit_bytes = metrics.Counter(
            "moe_cluster_kv_hit_bytes",
            "Bytes of pages engines loaded from the store instead of computing.",
            ("node",),
        )
        self._fetches = metrics.Counter(
            "moe_cluster_kv_fetches",
            "Fetches of pages from another node's store, by outcome.",
            ("node", "outcome"),
        )
        self._fetch_bytes = metrics.Counter(
            "moe_cluster_kv_fetched_bytes",
            "Bytes of pages fetched from other nodes.",
            ("node",),
        )
        self._fetch_seconds = metrics.Histogram(
            "moe_cluster_kv_fetch_seconds",
            "Time of one fetch from another node's store.",
            boundaries=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5],
            tag_keys=("node",),
        )

    def update(self, summary: dict[str, int]) -> None:
        for key, counter in self._counters.items():
            delta = summary.get(key, 0) - self._last.get(key, 0)
            if delta > 0:
                counter.inc(delta, self._tags)
                if key == "hit_pages":
                    self._hit_bytes.inc(
                        delta * summary.get("page_bytes", 0), self._tags
                    )
            self._last[key] = summary.get(key, 0)
        self._pages.set(summary.get("pages", 0), self._tags)
        self._capacity.set(summary.get("num_pages", 0), self._tags)

    def fetched(self, nbytes: int, seconds: float) -> None:
        self._fetches.inc(tags=self._tags | {"outcome": "ok"})
        self._fetch_bytes.inc(nbytes, self._tags)
        self._fetch_seconds.observe(seconds, self._tags)

    def fetch_failed(self) -> None:
        self._fetches.inc(tags=self._tags | {"outcome": "failed"})


def directory(app: str) -> Any:
    options = singleton_options(directory_name(app))
    return ray.remote(KVDirectoryActor).options(**options).remote()


def get_or_create_store(app: str, node_id: NodeId, config: KVStoreConfig) -> Any:
    """The node's store actor, created on that node if missing (its ``start``
    serves the engines and returns their socket)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    handle = (
        ray.remote(NodeStoreActor)
        .options(
            name=store_name(app, node_id),
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=1000,
            enable_task_events=False,  # as the singletons (cluster.actors)
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(app, node_id, config)
    )
    directory(app)
    return handle


def stores(app: str) -> dict[NodeId, Any]:
    """Every live node store of ``app``, by node."""
    out = {}
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if node.get("Alive"):
            with contextlib.suppress(ValueError):
                out[node["NodeID"]] = ray.get_actor(
                    store_name(app, node["NodeID"]), namespace=NAMESPACE
                )
    return out


def kill(app: str) -> None:
    """Stops the app's stores (their arenas go with them) and its directory."""
    for handle in stores(app).values():
        with contextlib.suppress(Exception):
            ray.get(handle.shutdown.remote(), timeout=10)
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(directory_name(app), namespace=NAMESPACE))
