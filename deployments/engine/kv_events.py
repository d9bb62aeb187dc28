"""An engine's prefix-cache changes, from vLLM's KV event stream to router events.

vLLM's scheduler publishes ``KVEventBatch`` messages (msgpack over a ZMQ PUB socket)
when it caches or evicts full blocks. Each engine replica subscribes to its own
engine's socket and hands the changes to its router reports: its engine's own
cache only (the router follows the node stores' pages itself, from the kvstore
directory). The router may have restarted (and forgotten everything) between two
reports, so the listener also keeps the engine's current block set to resend in
full when asked.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from kvstore.block_hash import BlockHash
from router.types import KVEvent

logger = logging.getLogger("moe_cluster.engine")
TOPIC = b"kv"


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
    the last call, or (``full``) every block the engine holds."""

    def __init__(self, endpoint: str | None) -> None:
        self._endpoint = endpoint
        self._pending: list[KVEvent] = []
        self._held: set[BlockHash] = set()

    def drain(self, full: bool = False) -> tuple[KVEvent, ...]:
        self._pending, pending = [], self._pending
        if full:
            return (KVEvent("cleared"), KVEvent("stored", tuple(self._held)))
        return tuple(pending)

    def apply(self, events: list[KVEvent]) -> None:
        for ev in events:
            if ev.kind == "stored":
                self._held.update(ev.block_hashes)
            elif ev.kind == "removed":
                self._held.difference_update(ev.block_hashes)
            elif ev.kind == "cleared":
                self._held.clear()
            self._pending.append(ev)

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
