"""The connector's CUDA path on a GPU: the arena page-locked, pages saved from and
loaded into vLLM's paged caches in device memory, in the order the engine's own
stream needs.

Opt-in (``make test-gpu``, marker ``gpu``) and skipped where torch sees no CUDA
device. The caches are MLA caches as vLLM allocates them on a GPU: blocks first,
64 tokens of 576 latents, bf16. The store is a real node store on its Unix socket.
``torch.cuda._sleep`` keeps a stream busy, standing in for a forward pass (or
earlier saves) still running when the connector is called, so a copy that does
not wait for it reads or writes the block at the wrong time, every run.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.arena import checksum
from kvstore.connector_scheduler import Loads, PageLoad, PageSave
from kvstore.connector_worker import StoreWorker
from kvstore.page_layer import DeviceCopier, PageLayer
from kvstore.rpc import Found, Query, StoreClient
from tests.kvstore.test_rpc import Running, published

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS, BLOCK, LATENT, NUM_BLOCKS = 4, 64, 576, 96
PAGE_BYTES = LAYERS * BLOCK * LATENT * 2
HASHES = [bytes([i]) * 32 for i in range(64)]
SPIN = 200_000_000  # GPU cycles (~0.1 s): the forward pass still running


@pytest.fixture(autouse=True)
def vllm_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PageLayer.of_vllm_cache`` views a cache through vLLM's
    ``group_kernel_blocks``. Where torch has CUDA but vLLM is not installed, that
    one view is stood in: for caches of one kernel block per block, as these
    are, it is the cache itself."""
    try:
        import vllm.v1.kv_cache_interface  # noqa: F401
    except ImportError:
        module = types.ModuleType("vllm.v1.kv_cache_interface")

        def group_kernel_blocks(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
            assert cache.shape[0] == num_blocks
            return cache

        module.group_kernel_blocks = group_kernel_blocks  # type: ignore[attr-defined]
        for name in ("vllm", "vllm.v1"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, "vllm.v1.kv_cache_interface", module)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[str]:
    running = Running(str(tmp_path / "store.sock"), capacity_bytes=64 * PAGE_BYTES)
    yield running.server.path
    running.stop()


class Engine:
    """One engine's caches on the GPU, its connector worker, and a client for
    what its scheduler side asks the store."""

    def __init__(self, path: str, fill: bool) -> None:
        shape = (NUM_BLOCKS, BLOCK, LATENT)
        self.caches = {
            f"model.layers.{i}.self_attn.attn": (
                torch.randn(shape, device="cuda").to(torch.bfloat16)
                if fill
                else torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
            )
            for i in range(LAYERS)
        }
        self.warnings: list[Exception] = []
        self.worker_client = StoreClient(path)
        self.worker = StoreWorker(
            self.worker_client, NUM_BLOCKS, "tiny", BLOCK, self.warnings.append
        )
        self.worker.register(self.caches)
        self.client = StoreClient(path)

    def block(self, block_id: int) -> np.ndarray:
        """Every layer's block, in page order, as host bytes."""
        parts = [
            c[block_id].reshape(-1).view(torch.uint8) for c in self.caches.values()
        ]
        return torch.cat(parts).cpu().numpy()

    def page(self, slot: int) -> np.ndarray:
        assert self.worker._arena is not None
        return self.worker._arena.page(slot)

    def stored(self, hashes: Sequence[bytes], timeout_s: float = 10.0) -> Found:
        return published(self.client, hashes, BLOCK, timeout_s)

    def load(self, rid: str, hashes: Sequence[bytes], blocks: Sequence[int]) -> None:
        self.load_step({rid: (hashes, blocks)})

    def load_step(
        self, requests: Mapping[str, tuple[Sequence[bytes], Sequence[int]]]
    ) -> None:
        """What one step does for requests whose pages the store holds: the
        scheduler side pins them, the worker loads them before the forward."""
        loads = {}
        for rid, (hashes, blocks) in requests.items():
            found = self.client.lookup(Query(rid, hashes, "", [], BLOCK, 0))
            pages = [
                PageLoad(ref.slot, ref.checksum, ref.page_hash, block)
                for ref, block in zip(found.refs, blocks, strict=False)
            ]
            loads[rid] = Loads(found.arena, pages)
        self.worker.start_load(loads)

    def close(self) -> None:
        self.worker.shutdown()
        self.worker_client.close()
        self.client.close()


@pytest.fixture
def engines(store: str) -> Iterator[tuple[Engine, Engine]]:
    a, b = Engine(store, fill=True), Engine(store, fill=False)
    yield a, b
    for e in (a, b):
        assert e.warnings == []
        e.close()


def test_the_arena_is_page_locked_for_dma(engines: tuple[Engine, Engine]) -> None:
    for e in engines:
        registered = e.worker._registered
        assert registered is not None and registered.is_pinned()
        assert registered.numel() == 64 * PAGE_BYTES


def test_pages_saved_on_one_gpu_engine_load_into_another(
    engines: tuple[Engine, Engine],
) -> None:
    a, b = engines
    saved, targets = list(range(16)), list(range(40, 56))
    a.worker.save([PageSave(HASHES[i], block) for i, block in enumerate(saved)])
    found = b.stored(HASHES[:16])
    assert len(found.refs) == 16
    for ref, block in zip(found.refs, saved, strict=True):
        assert np.array_equal(b.page(ref.slot), a.block(block))  # byte for byte
        # Summed on the GPU, checked as the host checks it (exports, CPU engines)
        assert ref.checksum == checksum(b.page(ref.slot))

    b.load("r1", HASHES[:16], targets)
    assert b.worker.load_errors() == set()
    for src, dst in zip(saved, targets, strict=True):
        assert np.array_equal(b.block(dst), a.block(src))
    others = [x for x in range(NUM_BLOCKS) if x not in targets]
    for cache in b.caches.values():
        assert not cache[others].any()


def test_a_damaged_page_is_recomputed_and_dropped_while_the_step_s_others_load(
    engines: tuple[Engine, Engine],
) -> None:
    # The step's requests are loaded in one copy; each is checked by itself.
    a, b = engines
    a.worker.save([PageSave(HASHES[i], i) for i in range(8)])
    found = b.stored(HASHES[:8])
    b.page(found.refs[2].slot)[100] ^= 0xFF

    b.load_step(
        {"r1": (HASHES[:4], [60, 61, 62, 63]), "r2": (HASHES[4:8], [70, 71, 72, 73])}
    )
    # vLLM recomputes r1's damaged page's blocks and the rest of its prefix.
    assert b.worker.load_errors() == {62, 63}
    for src, dst in [(0, 60), (1, 61), (4, 70), (5, 71), (6, 72), (7, 73)]:
        assert np.array_equal(b.block(dst), a.block(src))
    assert len(b.stored(HASHES[:4], timeout_s=0).refs) == 2  # dropped from the store


def warm(engine: Engine, count: int) -> None:
    """Saves ``count`` other pages (``HASHES[-count:]``, from the last blocks)
    and waits for them. The copier allocates its buffers up front, but torch may
    keep workspace of its own for the first copy of a size; an allocation on the
    GPU can synchronise the device, which would order the streams by itself and
    hide a missing wait."""
    hashes = HASHES[-count:]
    engine.worker.save(
        [PageSave(h, NUM_BLOCKS - count + i) for i, h in enumerate(hashes)]
    )
    assert len(engine.stored(hashes).refs) == count
    torch.cuda.synchronize()


def test_a_save_copies_what_the_forward_wrote_before_it(
    engines: tuple[Engine, Engine],
) -> None:
    a, _ = engines
    warm(a, 1)
    torch.cuda._sleep(SPIN)  # the forward, still running on the engine's stream,
    for cache in a.caches.values():
        cache[5].fill_(7.0)  # writes the block's last tokens
    a.worker.save([PageSave(HASHES[0], 5)])  # called while it runs

    [ref] = a.stored(HASHES[:1]).refs
    seven = torch.full((BLOCK * LATENT,), 7.0, dtype=torch.bfloat16)
    assert np.array_equal(a.page(ref.slot), seven.view(torch.uint8).repeat(LAYERS))


def test_the_next_forward_reuses_blocks_only_once_they_are_saved(
    engines: tuple[Engine, Engine],
) -> None:
    a, _ = engines
    warm(a, 24)
    before = [a.block(i) for i in range(24)]
    with torch.cuda.stream(a.worker._stream):
        torch.cuda._sleep(SPIN)  # the last step's saves, still copying
    a.worker.save([PageSave(HASHES[i], i) for i in range(24)])  # queued behind
    # The next step zeroes the blocks it allocates anew (freed ones among them)
    # before any connector call, then its forward writes new tokens into them.
    for cache in a.caches.values():
        cache[:24].zero_()

    found = a.stored(HASHES[:24])
    assert len(found.refs) == 24
    for ref, old in zip(found.refs, before, strict=True):
        assert np.array_equal(a.page(ref.slot), old)


def chunked() -> tuple[list[torch.Tensor], DeviceCopier]:
    """Paged caches on the GPU and a copier whose staging buffers hold three
    pages: ten pages go through them in four chunks, the third refilling the
    first buffer."""
    caches = [
        torch.randn(NUM_BLOCKS, BLOCK, LATENT, device="cuda").to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    nbytes = BLOCK * LATENT * 2
    layers = [PageLayer(f"l{i}", c, 0, i * nbytes) for i, c in enumerate(caches)]
    return caches, DeviceCopier(layers, PAGE_BYTES, chunk_bytes=3 * PAGE_BYTES)


def pinned_pages(count: int) -> np.ndarray:
    return torch.zeros((count, PAGE_BYTES), dtype=torch.uint8, pin_memory=True).numpy()


def page_of(caches: Sequence[torch.Tensor], block: int) -> np.ndarray:
    parts = [c[block].reshape(-1).view(torch.uint8) for c in caches]
    return torch.cat(parts).cpu().numpy()


def test_pages_cross_the_staging_buffers_a_chunk_at_a_time() -> None:
    caches, copier = chunked()
    pages = pinned_pages(10)
    saved, targets = list(range(10, 20)), list(range(70, 80))

    sums = copier.save(list(pages), saved)
    torch.cuda.current_stream().synchronize()
    crcs = copier.checksums(sums)
    assert crcs == [checksum(page) for page in pages]
    for page, block in zip(pages, saved, strict=True):
        assert np.array_equal(page, page_of(caches, block))

    assert copier.load(list(pages), targets, crcs) == [True] * 10
    for cache in caches:
        assert torch.equal(cache[70:80], cache[10:20])


def test_the_copier_holds_the_device_memory_it_says_within_its_budget(
    store: str,
) -> None:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    caches, copier = chunked()
    held = torch.cuda.memory_allocated() - before - sum(c.nbytes for c in caches)
    # torch's allocator rounds each tensor up to 512 bytes.
    assert copier.device_bytes <= held <= copier.device_bytes + 16 * 512
    assert held <= DeviceCopier.budget(3 * PAGE_BYTES)
    # An engine whose pages do not fit kvstore.gpu_staging_mib is told so.
    engine = Engine(store, fill=False)
    worker = StoreWorker(
        engine.worker_client, NUM_BLOCKS, "tiny", BLOCK, [].append, PAGE_BYTES - 8
    )
    with pytest.raises(ValueError, match=r"raise kvstore\.gpu_staging_mib"):
        worker.register(engine.caches)
    engine.close()


def hold(copier: DeviceCopier, way: int, busy: str) -> None:
    """Keeps a stream busy: the caller's (``engine``) or the copier's copy
    stream for loads (way 0) or saves (way 1)."""
    stream = copier._ways[way].copy if busy == "copy" else None
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)


@pytest.mark.parametrize("busy", ["engine", "copy"])
def test_loads_scatter_each_staged_chunk_once_it_is_in_and_before_refilling(
    busy: str,
) -> None:
    # The engine's stream busy: the DMAs must not refill a staging buffer before
    # its pages are scattered. The copy stream busy: the scatters must wait for
    # the DMAs. The buffers hold other pages from the load before.
    caches, copier = chunked()
    rng = np.random.default_rng(0)
    before, pages = pinned_pages(10), pinned_pages(10)
    before[:], pages[:] = (rng.integers(0, 256, pages.shape, np.uint8) for _ in "ab")
    targets = list(range(70, 80))
    crcs = [checksum(page) for page in before]
    assert copier.load(list(before), targets, crcs) == [True] * 10

    hold(copier, 0, busy)
    crcs = [checksum(page) for page in pages]
    assert copier.load(list(pages), targets, crcs) == [True] * 10
    for page, block in zip(pages, targets, strict=True):
        assert np.array_equal(page_of(caches, block), page)


@pytest.mark.parametrize("count", [3, 10], ids=["one chunk", "four chunks"])
@pytest.mark.parametrize("busy", ["engine", "copy"])
def test_saves_copy_out_each_gathered_chunk_once_it_is_in_and_before_refilling(
    busy: str, count: int
) -> None:
    # The copy stream busy: the gathers must not refill a staging buffer before
    # its pages are out, and the caller's stream must cover the last DMA (of one
    # chunk: with more, the refills' waits cover all but the last two). The
    # caller's stream busy: the DMAs must wait for the gathers. The buffers hold
    # other blocks from the save before.
    caches, copier = chunked()
    pages, saved = pinned_pages(count), list(range(10, 10 + count))
    copier.checksums(copier.save(list(pages), [b + 10 for b in saved]))
    torch.cuda.synchronize()
    pages[:] = 0

    hold(copier, 1, busy)
    sums = copier.save(list(pages), saved)
    torch.cuda.current_stream().synchronize()  # what the worker's event covers
    assert copier.checksums(sums) == [checksum(page) for page in pages]
    for page, block in zip(pages, saved, strict=True):
        assert np.array_equal(page, page_of(caches, block))
