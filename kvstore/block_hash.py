"""vLLM's chained prefix block hash: the one name of a KV block and of its page.

The router scores replicas by it, the ingress computes it per request, the KV
events and the page store are keyed by it; this is its one home. It reproduces
vLLM's default (``prefix_caching_hash_algo="sha256"``,
``vllm/v1/core/kv_cache_utils.py``)::

    h0 = sha256(pickle((NONE_HASH, tokens[0:B], extra)))
    hi = sha256(pickle((h(i-1), tokens[iB:(i+1)B], None)))

``NONE_HASH`` is ``sha256(pickle(seed))``: vLLM takes the seed from
``$PYTHONHASHSEED`` when it is set, ``"vllm-none-hash"`` otherwise, and so does
``none_hash``, so engines and ingress agree as long as they share the
environment. A tenant's requests carry its name as vLLM's ``cache_salt``, which
enters the first block's hash (``extra = (("cache_salt", tenant),)``) and so every
block after it: one tenant can never hit, or time, another tenant's prompt.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import NewType

from cluster.env import read_env

BlockHash = NewType("BlockHash", bytes)  # chained hash of every token block up to it
DEFAULT_SEED = "vllm-none-hash"


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str | None = None) -> BlockHash:
    """The chain's root: from ``seed``, else ``$PYTHONHASHSEED`` as vLLM reads it,
    else vLLM's default seed."""
    if seed is None:
        seed = read_env().python_hash_seed
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
