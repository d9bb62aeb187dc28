"""Prefix block hashes as vLLM computes them, and which replica caches which blocks.

``block_hashes`` reproduces vLLM's default (``prefix_caching_hash_algo="sha256"``)
chained hash, so the directory can be fed by the engines' own KV events:

    h0 = sha256(pickle((NONE_HASH, tokens[0:B], None)))
    hi = sha256(pickle((h(i-1), tokens[iB:(i+1)B], None)))

``NONE_HASH`` is ``sha256(pickle(seed))`` with ``seed = $PYTHONHASHSEED`` when set and
``"vllm-none-hash"`` otherwise; engines and ingress must agree on it. A tenant's
requests carry its name as vLLM's ``cache_salt``, which enters the first block's
hash (``extra = (("cache_salt", tenant),)``) and so every block after it: one
tenant can never hit, or time, another tenant's cached prompt.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence

from router.types import BlockHash, KVEvent, ReplicaId

DEFAULT_SEED = "vllm-none-hash"


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str | None = None) -> BlockHash:
    return BlockHash(_sha256(DEFAULT_SEED if seed is None else seed))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: str | None = None,
    salt: str | None = None,
) -> tuple[BlockHash, ...]:
    """Chained hashes of the full blocks of ``token_ids`` (a partial tail is not
    hashed)."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    parent = none_hash(seed)
    out: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(int(t) for t in token_ids[start : start + block_size])
        extra = (("cache_salt", salt),) if salt and start == 0 else None
        parent = BlockHash(_sha256((parent, block, extra)))
        out.append(parent)
    return tuple(out)


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
