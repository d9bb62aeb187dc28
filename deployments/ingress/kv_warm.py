"""Warming a prefix on demand: ``POST /v1/kv/warm``.

One engine replica runs the prompt for one token (its pages are loaded from, or
computed into, its node's store); then every node's store pulls the pages it lacks
from whichever node holds them, so the next request with that prefix loads it on
any node instead of recomputing it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvstore.block_hash import block_hashes


class WarmRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    token_ids: list[int] | None = None
    tenant: str = ""


def page_hashes(ids: Sequence[int], block_size: int, tenant: str) -> list[bytes]:
    return list(block_hashes(ids, block_size, salt=tenant or None))


async def replicate(app: str, hashes: list[bytes]) -> dict[str, int]:
    """Pages of ``hashes`` (longest prefix) each node's store holds once it has
    pulled what it lacked, by node id."""
    from kvstore import actor as kv_actor

    stores: dict[str, Any] = await asyncio.to_thread(kv_actor.stores, app)
    counts = await asyncio.gather(*(s.pull.remote(hashes) for s in stores.values()))
    return dict(zip(stores, counts, strict=True))
