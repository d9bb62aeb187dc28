"""The connector's worker side on host caches, against a real node store on its
Unix socket: a step asks for its slots before the forward pass and saves what
the forward wrote, and slots it was given but never wrote go back to the store."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.connector_scheduler import PageSave
from kvstore.connector_worker import StoreWorker
from kvstore.rpc import Found, StoreClient
from tests.kvstore.test_rpc import Running, published

LAYERS, BLOCK, LATENT, NUM_BLOCKS = 2, 16, 8, 12
PAGE_BYTES = LAYERS * BLOCK * LATENT * 4
HASHES = [bytes([i]) * 32 for i in range(16)]


class Engine:
    """One engine's MLA caches on the host (float32, blocks first, as vLLM's CPU
    backend allocates them), its connector worker, and a client for what its
    scheduler side asks the store."""

    def __init__(self, path: str) -> None:
        self.caches = {
            f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, BLOCK, LATENT)
            for i in range(LAYERS)
        }
        self.warnings: list[Exception] = []
        self.worker = StoreWorker(
            StoreClient(path), NUM_BLOCKS, "tiny", BLOCK, self.warnings.append
        )
        self.worker.register(self.caches)
        self.client = StoreClient(path)

    def block(self, block_id: int) -> np.ndarray:
        """Every layer's block, in page order, as bytes."""
        parts = [
            c[block_id].reshape(-1).view(torch.uint8) for c in self.caches.values()
        ]
        return torch.cat(parts).numpy()

    def stored(self, hashes: Sequence[bytes], timeout_s: float = 10.0) -> Found:
        return published(self.client, hashes, BLOCK, timeout_s)

    def close(self) -> None:
        self.worker.shutdown()
        self.client.close()


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "store.sock")


@pytest.fixture
def store(path: str) -> Iterator[Running]:
    running = Running(path, capacity_bytes=32 * PAGE_BYTES)
    yield running
    running.stop()


@pytest.fixture
def engine(store: Running, path: str) -> Iterator[Engine]:
    e = Engine(path)
    yield e
    e.close()


def writing(store: Running) -> int:
    """Slots reserved and not yet committed or abandoned, across connections."""
    return store.store.summary()["writing"]


def test_a_step_reserves_before_its_forward_and_saves_what_the_forward_wrote(
    engine: Engine, store: Running
) -> None:
    saves = [PageSave(HASHES[0], 3), PageSave(HASHES[1], 7)]
    engine.worker.before_forward(saves)
    for _ in range(100):  # the store answers while the forward runs
        if writing(store) == 2:
            break
        time.sleep(0.01)
    assert writing(store) == 2
    for cache in engine.caches.values():  # the forward writes the blocks' last tokens
        cache[3, -1].fill_(3.0)
        cache[7, -1].fill_(7.0)
    engine.worker.save(saves)

    found = engine.stored(HASHES[:2])
    assert [r.page_hash for r in found.refs] == HASHES[:2]
    arena = engine.worker._arena
    assert arena is not None
    for ref, block in zip(found.refs, (3, 7), strict=True):
        assert np.array_equal(arena.page(ref.slot), engine.block(block))
    assert writing(store) == 0
    assert not engine.warnings


def test_slots_reserved_for_a_step_that_never_saved_go_back_to_the_store(
    engine: Engine, store: Running
) -> None:
    engine.worker.before_forward([PageSave(HASHES[0], 0), PageSave(HASHES[1], 1)])
    # The step failed before ``save``; the next one has its own blocks to save.
    engine.worker.before_forward([PageSave(HASHES[2], 2)])
    engine.worker.save([PageSave(HASHES[2], 2)])
    assert len(engine.stored(HASHES[2:3]).refs) == 1
    assert writing(store) == 0
    # Nothing holds the first step's pages: another engine may write them.
    slots = engine.client.reserve(HASHES[:2]).slots
    assert None not in slots
    engine.client.abandon([s for s in slots if s is not None])
    assert not engine.warnings


def test_a_reserve_lost_with_its_connection_is_asked_again_at_the_save(
    engine: Engine, store: Running
) -> None:
    saves = [PageSave(HASHES[4], 5)]
    engine.worker.before_forward(saves)
    engine.worker._client.close()  # the connection fails while the forward runs
    engine.worker.save(saves)
    [ref] = engine.stored(HASHES[4:5]).refs
    arena = engine.worker._arena
    assert arena is not None
    assert np.array_equal(arena.page(ref.slot), engine.block(5))
    assert writing(store) == 0  # the first connection's slot went back with it
    assert not engine.warnings


def test_slots_of_a_store_that_restarted_mid_step_are_never_published(
    path: str,
) -> None:
    first = Running(path, capacity_bytes=32 * PAGE_BYTES)
    engine = Engine(path)
    second: Running | None = None
    try:
        saves = [PageSave(HASHES[4], 5)]
        engine.worker.before_forward(saves)  # answered by the first store
        time.sleep(0.05)
        first.stop()  # which restarts while the forward runs
        second = Running(path, capacity_bytes=32 * PAGE_BYTES)
        other = StoreClient(path)
        other.open(PAGE_BYTES, engine.worker._layout)
        # Another engine's write in flight in the new store, in the same slot.
        assert other.reserve([HASHES[9]]).slots == [0]
        engine.worker.save(saves)  # written into the old arena: refused
        engine.worker.before_forward([PageSave(HASHES[6], 6)])
        engine.worker.save([PageSave(HASHES[6], 6)])  # the next step's, stored
        [ref] = engine.stored(HASHES[6:7]).refs
        arena = engine.worker._arena
        assert second.store.arena is not None
        assert arena is not None and arena.name == second.store.arena.name
        assert np.array_equal(arena.page(ref.slot), engine.block(6))
        assert engine.stored(HASHES[4:5], timeout_s=0.2).refs == []
        assert second.store.summary()["writing"] == 1  # the other engine's, intact
        assert engine.warnings  # the refused commit, once
        other.close()
    finally:
        engine.close()
        if second is not None:
            second.stop()
