"""Which node holds which page, and which prefixes are hot, cluster-wide.

Each node's store publishes its change log here; each store keeps a mirror of the
whole directory (``follow``) so that, on a miss, it knows at once whether another
node holds the page and from whom to fetch it, without a round trip.

Pure bookkeeping: no Ray. The actor in ``kvstore.actor`` hosts one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from kvstore.block_hash import BlockHash
from kvstore.node_store import ChangeLog, Changes, HotKey

NodeId = str
Entry = tuple[NodeId, BlockHash]
_NONE: frozenset[BlockHash] = frozenset()


class Directory:
    """Invariant: ``_by_node[n]`` and ``_holders`` describe the same relation, and
    ``log`` records every change to it."""

    def __init__(self) -> None:
        self._by_node: dict[NodeId, set[BlockHash]] = {}
        self._holders: dict[BlockHash, set[NodeId]] = {}
        self._cursor: dict[NodeId, tuple[str, int]] = {}  # node -> (incarnation, seq)
        self._hot: dict[NodeId, list[tuple[HotKey, int]]] = {}
        self.log: ChangeLog[Entry] = ChangeLog(self._entries)

    # -- what nodes publish ------------------------------------------------------

    def cursor(self, node: NodeId, incarnation: str) -> int:
        """Where ``node``'s change log should be read from next (-1: from scratch,
        e.g. the directory or the node's store restarted)."""
        known = self._cursor.get(node)
        return known[1] if known is not None and known[0] == incarnation else -1

    def publish(
        self, node: NodeId, incarnation: str, changes: Changes[BlockHash]
    ) -> None:
        if changes.full:
            for h in self._by_node.get(node, set()) - set(changes.added):
                self._remove(node, h)
        for h in changes.added:
            self._add(node, h)
        for h in changes.removed:
            self._remove(node, h)
        self._cursor[node] = (incarnation, changes.seq)

    def set_hot(self, node: NodeId, top: list[tuple[HotKey, int]]) -> None:
        self._hot[node] = top

    def forget(self, node: NodeId) -> None:
        for h in list(self._by_node.get(node, ())):
            self._remove(node, h)
        self._by_node.pop(node, None)
        self._cursor.pop(node, None)
        self._hot.pop(node, None)

    # -- what stores and replicas ask -------------------------------------------

    def follow(self, changes: Changes[Entry]) -> None:
        """Applies another directory's changes (a store's mirror)."""
        if changes.full:
            for node in list(self._by_node):
                for h in list(self._by_node[node]):
                    self._remove(node, h)
        for node, h in changes.added:
            self._add(node, h)
        for node, h in changes.removed:
            self._remove(node, h)

    def pages(self, node: NodeId) -> AbstractSet[BlockHash]:
        """The pages ``node`` holds (a live view: do not change it)."""
        return self._by_node.get(node, _NONE)

    def held_elsewhere(self, node: NodeId) -> list[BlockHash]:
        """Every page some node other than ``node`` holds."""
        return [h for h, nodes in self._holders.items() if nodes - {node}]

    def holders(self, h: BlockHash) -> set[NodeId]:
        return set(self._holders.get(h, ()))

    def locate(
        self, hashes: Sequence[BlockHash], exclude: NodeId = ""
    ) -> tuple[NodeId, int] | None:
        """The node other than ``exclude`` holding the longest run of ``hashes``
        from the first one, and the run's length."""
        best: tuple[NodeId, int] | None = None
        for node in self._holders.get(hashes[0], ()) if hashes else ():
            if node == exclude:
                continue
            held = self._by_node[node]
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if best is None or n > best[1]:
                best = (node, n)
        return best

    def hottest(self, n: int) -> list[HotKey]:
        total: Counter[HotKey] = Counter()
        for top in self._hot.values():
            for key, count in top:
                total[key] += count
        return [key for key, _ in total.most_common(n)]

    def summary(self) -> dict[str, int]:
        return {node: len(hs) for node, hs in sorted(self._by_node.items())}

    # -- internals ---------------------------------------------------------------

    def _entries(self) -> list[Entry]:
        return [(node, h) for node, hs in self._by_node.items() for h in hs]

    def _add(self, node: NodeId, h: BlockHash) -> None:
        held = self._by_node.setdefault(node, set())
        if h not in held:
            held.add(h)
            self._holders.setdefault(h, set()).add(node)
            self.log.record(True, (node, h))

    def _remove(self, node: NodeId, h: BlockHash) -> None:
        held = self._by_node.get(node)
        if held is None or h not in held:
            return
        held.discard(h)
        if not held:
            del self._by_node[node]
        holders = self._holders[h]
        holders.discard(node)
        if not holders:
            del self._holders[h]
        self.log.record(False, (node, h))
