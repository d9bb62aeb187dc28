"""What each replica can serve from cache, from one source per kind of fact.

- An engine's own prefix cache: the replica's KV events (``PrefixDirectory``).
- A node's page store: the kvstore directory's change log, followed once for the
  cluster (a ``kvstore.directory.Directory`` mirror, as each store keeps one).
- Which node a replica runs on: its reports.

Replica r can serve block b when r's engine holds it or r's node's store does.
The blocks are named by vLLM's chained block hash (``kvstore.block_hash``), which
the ingress computes per request and the engines' KV events carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set

from kvstore.block_hash import BlockHash
from kvstore.directory import Directory, Entry
from kvstore.node_store import Changes
from router.types import KVEvent, ReplicaId

_NONE: frozenset[BlockHash] = frozenset()


class PrefixDirectory:
    """Block hash -> replicas holding it, kept from the replicas' KV events.

    Invariant: ``_by_replica[r]`` and ``_holders`` describe the same relation.
    """

    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[ReplicaId]] = {}
        self._by_replica: dict[ReplicaId, set[BlockHash]] = {}

    def apply(self, replica: ReplicaId, events: Iterable[KVEvent]) -> None:
        for ev in events:
            if ev.kind == "stored":
                mine = self._by_replica.setdefault(replica, set())
                for h in ev.block_hashes:
                    mine.add(h)
                    self._holders.setdefault(h, set()).add(replica)
            elif ev.kind == "removed":
                for h in ev.block_hashes:
                    self._discard(replica, h)
            elif ev.kind == "cleared":
                self.forget(replica)
            else:
                raise ValueError(f"unknown KV event kind {ev.kind!r}")

    def _discard(self, replica: ReplicaId, h: BlockHash) -> None:
        self._by_replica.get(replica, set()).discard(h)
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[h]

    def forget(self, replica: ReplicaId) -> None:
        for h in self._by_replica.pop(replica, set()):
            holders = self._holders[h]
            holders.discard(replica)
            if not holders:
                del self._holders[h]

    def held_by(self, replica: ReplicaId) -> Set[BlockHash]:
        """The blocks ``replica`` holds (a live view: do not change it)."""
        return self._by_replica.get(replica, _NONE)

    def cached_blocks(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix of ``hashes`` that ``replica`` holds."""
        return _run(hashes, self.held_by(replica), _NONE)

    def held(self, h: BlockHash) -> bool:
        """Whether any replica holds ``h``."""
        return h in self._holders

    def num_blocks(self, replica: ReplicaId) -> int:
        return len(self._by_replica.get(replica, ()))

    def blocks(self, replica: ReplicaId) -> tuple[BlockHash, ...]:
        return tuple(self._by_replica.get(replica, ()))


class PrefixView:
    """Replica r can serve a block when its engine holds it (``engines``) or its
    node's store does (``stores``, followed from the kvstore directory)."""

    def __init__(self) -> None:
        self.engines = PrefixDirectory()
        self.stores = Directory()

    def follow_stores(self, changes: Changes[Entry]) -> None:
        """Applies the kvstore directory's changes since the last call (all of
        it, ``full``, after either side restarted)."""
        self.stores.follow(changes)

    def cached_blocks(
        self, replica: ReplicaId, node: str, hashes: Sequence[BlockHash]
    ) -> int:
        """Length of the longest prefix of ``hashes`` that ``replica`` (on
        ``node``) can serve from its engine's cache or its node's store."""
        store = self.stores.pages(node) if node else _NONE
        return _run(hashes, self.engines.held_by(replica), store)


def _run(hashes: Sequence[BlockHash], a: Set[BlockHash], b: Set[BlockHash]) -> int:
    n = 0
    for h in hashes:
        if h not in a and h not in b:
            break
        n += 1
    return n
