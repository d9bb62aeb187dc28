"""Which replica caches which prefix blocks, kept from the replicas' KV events.

The blocks are named by vLLM's chained block hash (``kvstore.block_hash``), which
the ingress computes per request and the engines' KV events carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstore.block_hash import BlockHash
from router.types import KVEvent, ReplicaId


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

    def cached_blocks(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix of ``hashes`` that ``replica`` holds."""
        mine = self._by_replica.get(replica)
        if not mine:
            return 0
        n = 0
        for h in hashes:
            if h not in mine:
                break
            n += 1
        return n

    def held(self, h: BlockHash) -> bool:
        """Whether any replica holds ``h``."""
        return h in self._holders

    def num_blocks(self, replica: ReplicaId) -> int:
        return len(self._by_replica.get(replica, ()))

    def blocks(self, replica: ReplicaId) -> tuple[BlockHash, ...]:
        return tuple(self._by_replica.get(replica, ()))
