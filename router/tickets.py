"""Builds the router's ``Ticket`` for a tokenized request, in the ingress.

Hashing the prompt's blocks and predicting its experts are per-request work that
scales with the ingress replicas, so they happen there, not in the router actor;
only what the configured policy and breakers use is computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cluster.qos import QoS
from kvstore.block_hash import block_hashes
from router.experts import ExpertPredictor
from router.types import Ticket


class TicketMaker:
    def __init__(
        self,
        *,
        block_size: int,
        hash_blocks: bool,
        predictor: ExpertPredictor | None,
    ) -> None:
        self._block_size = block_size
        self._hash_blocks = hash_blocks
        self._predictor = predictor

    def make(
        self,
        request_id: str,
        qos: QoS,
        prompt: Sequence[int],
        max_tokens: int,
        deadline_s: float | None,
        tenant: str = "",
        trace: Mapping[str, str] | None = None,
        resumed: bool = False,
        avoid: str = "",
    ) -> Ticket:
        hashes = (
            block_hashes(prompt, self._block_size, salt=tenant or None)
            if self._hash_blocks
            else ()
        )
        return Ticket(
            request_id,
            qos,
            len(prompt),
            max_tokens,
            deadline_s,
            hashes,
            self._predictor.histogram(prompt) if self._predictor else (),
            tuple(trace.items()) if trace else (),
            tenant,
            resumed,
            avoid,
        )
