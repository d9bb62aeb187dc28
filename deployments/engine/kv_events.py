"""An engine's prefix-cache changes, from vLLM's KV event stream to router events.

vLLM's scheduler publishes ``KVEventBatch`` messages (msgpack over a ZMQ PUB socket)
when it caches or evicts full blocks. Each engine replica subscribes to its own
engine's socket and hands the changes to its router reports. The router may have
restarted (and forgotten everything) between two reports, so the listener also
keeps the replica's current block set to resend in full when asked.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from kvstore.block_hash import BlockHash
from router.prefix import PrefixDirectory
from router.types import KVEvent, ReplicaId

logger = logging.getLogger("moe_cluster.engine")
TOPIC = b"kv"
_SELF = ReplicaId("self")
STORE = ReplicaId("node-store")


def endpoint_for(replica_id: str) -> str:
    return f"ipc://{Path(tempfile.gettempdir()) / f'moe-cluster-kv-{replica_id}'}"


def rank_endpoints(replica_id: str, dp_rank: int) -> tuple[str, str]:
    """(the engine's publisher endpoint, the listener's) for data-parallel rank
    ``dp_rank``. vLLM offsets a DP rank's publisher port by the rank and refuses
    ipc endpoints there, so ranks > 0 publish on a free local tcp port."""
    if dp_rank == 0:
        endpoint = endpoint_for(replica_id)
        return endpoint, endpoint
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if port <= dp_rank:
        raise RuntimeError(f"no usable port for DP rank {dp_rank}")
    return f"tcp://127.0.0.1:{port - dp_rank}", f"tcp://127.0.0.1:{port}"


def remove_endpoint(endpoint: str) -> None:
    """Unlinks an ipc endpoint's socket file (vLLM's publisher leaves it behind)."""
    if endpoint.startswith("ipc://"):
        Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


def events_config(endpoint: str) -> Any:
    from vllm.config.kv_events import KVEventsConfig

    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=endpoint,
        topic=TOPIC.decode(),
    )


def _hash(h: Any) -> BlockHash:
    if not isinstance(h, bytes):
        # Engines run with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the full digest
        # is what the ingress computes. A 64-bit int here means that was not set.
        raise ValueError(f"block hash {h!r} is not the full digest")
    return BlockHash(h)


def convert(batch: Any) -> list[KVEvent]:
    """vLLM ``KVEventBatch`` -> router ``KVEvent``s (GPU-tier blocks only)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    out: list[KVEvent] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored) and ev.medium in (None, "GPU"):
            out.append(KVEvent("stored", tuple(_hash(h) for h in ev.block_hashes)))
        elif isinstance(ev, BlockRemoved) and ev.medium in (None, "GPU"):
            out.append(KVEvent("removed", tuple(_hash(h) for h in ev.block_hashes)))
        elif isinstance(ev, AllBlocksCleared):
            out.append(KVEvent("cleared"))
    return out


class KVEventListener:
    """Subscribes to one engine's KV events; ``drain`` returns what changed since
    the last call, or everything the replica can serve from cache when ``full`` is
    asked.

    A replica serves a block from cache when its engine holds it or its node's
    page store does: ``apply`` takes changes from either ``source`` and reports the
    union (a block is removed only when neither holds it any more).
    """

    def __init__(self, endpoint: str | None) -> None:
        self._endpoint = endpoint
        self._pending: list[KVEvent] = []
        # Who holds what: the router's own directory, one entry per source.
        self._held = PrefixDirectory()

    def drain(self, full: bool = False) -> tuple[KVEvent, ...]:
        self._pending, pending = [], self._pending
        if full:
            union = {h for s in (_SELF, STORE) for h in self._held.blocks(s)}
            return (KVEvent("cleared"), KVEvent("stored", tuple(union)))
        return tuple(pending)

    def apply(self, events: list[KVEvent], source: ReplicaId = _SELF) -> None:
        for ev in events:
            touched = (
                self._held.blocks(source) if ev.kind == "cleared" else ev.block_hashes
            )
            before = {h: self._held.held(h) for h in touched}
            self._held.apply(source, [ev])
            gained = tuple(h for h in touched if not before[h] and self._held.held(h))
            lost = tuple(h for h in touched if before[h] and not self._held.held(h))
            if gained:
                self._pending.append(KVEvent("stored", gained))
            if lost:
                self._pending.append(KVEvent("removed", lost))

    async def run(self) -> None:
        if self._endpoint is None:
            return
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sock.connect(self._endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        try:
            while True:
                _topic, _seq, payload = await sock.recv_multipart()
                try:
                    self.apply(convert(decoder.decode(payload)))
                except Exception:
                    logger.exception("bad KV event batch")
        finally:
            sock.close(linger=0)
