"""Page load bandwidth: arena page -> engine cache buffer, against a plain memcpy.

    .venv/bin/python -m tests.perf.page_copy [--gpu]

Three page layouts: one vLLM block of the tiny model's 4 layers (MLA latent 576)
as each CPU backend keeps it (16 tokens of fp32; 128 tokens of bf16), and one of
DeepSeek-V3 (64 tokens x 61 layers of bf16: 4.3 MiB). For each: a plain
``np.copyto`` between two private buffers (memcpy), the arena copy alone (shared
memory -> private buffer), the arena load as a cross-node export does it (copy,
checksummed on the way), and the connector's own load into the layers' paged
caches and save back (``PageCopier``: checksummed on the way), with their ratios
to memcpy. Where torch has CUDA, the same layouts between the page-locked arena
and paged caches on the GPU (``measure_gpu``); ``--gpu`` prints that table alone.
"""

from __future__ import annotations

import os

# The engines' caches are in huge pages (deployments/engine/args.py: engine_env),
# as numpy's buffers (the memcpy) are by default; before torch is imported.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.arena import Arena

LAYOUTS = {  # label -> (layers, tokens per block, dtype)
    "tiny on CPU_MLA (16 tok x 4 layers x 576 x fp32)": (4, 16, "float32"),
    "tiny on AMX_MLA (128 tok x 4 layers x 576 x bf16)": (4, 128, "bfloat16"),
    "DeepSeek-V3 (64 tok x 61 layers x 576 x bf16)": (61, 64, "bfloat16"),
}
SIZES = {
    label: layers * tokens * 576 * (4 if dtype == "float32" else 2)
    for label, (layers, tokens, dtype) in LAYOUTS.items()
}
TOTAL_BYTES = 1 << 30


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure(page_bytes: int) -> dict[str, float]:
    pages = max(4, TOTAL_BYTES // page_bytes // 4)
    arena = Arena.create(f"moe-perf-{uuid.uuid4().hex[:8]}", pages, page_bytes)
    try:
        src = np.random.default_rng(0).integers(
            0, 255, (pages, page_bytes), dtype=np.uint8
        )
        checksums = [arena.write(i, src[i]) for i in range(pages)]
        dst = np.empty((pages, page_bytes), dtype=np.uint8)
        moved = pages * page_bytes * 4
        dst.fill(1)  # fault the destination in before timing
        results = {}
        t = time.perf_counter()
        for _ in range(4):
            for i in range(pages):
                np.copyto(dst[i], src[i])
        results["memcpy"] = _rate(moved, time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(4):
            for i in range(pages):
                np.copyto(dst[i], arena.page(i))
        results["arena copy"] = _rate(moved, time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(4):
            for i in range(pages):
                arena.read_into(i, dst[i], checksums[i])
        results["arena load, checked"] = _rate(moved, time.perf_counter() - t)
        return results
    finally:
        arena.close()


def _random_pages(arena: Arena) -> list[int]:
    """Fills the arena with random pages; their checksums."""
    rng = np.random.default_rng(0)
    return [
        arena.write(i, rng.integers(0, 255, arena.page_bytes, np.uint8))
        for i in range(arena.num_pages)
    ]


def _paged_caches(
    arena: Arena, layers: int, block_shape: tuple[int, ...], dt: Any, device: str
) -> tuple[list[Any], list[int]]:
    """A paged cache per layer (twice as many blocks as the arena has pages,
    ``block_shape`` each), the layers' parts tiling a page in order, and a
    block for each page, scattered at random."""
    import torch

    from kvstore.page_layer import PageLayer

    blocks = arena.num_pages * 2
    caches = [
        PageLayer(
            f"layer.{j}",
            torch.zeros((blocks, *block_shape), dtype=dt, device=device),
            0,
            j * arena.page_bytes // layers,
        )
        for j in range(layers)
    ]
    scattered = np.random.default_rng(1).permutation(blocks)[: arena.num_pages]
    return caches, scattered.tolist()


def _medians(
    nbytes: int, steps: Sequence[tuple[str, Callable[[], None]]], sync: Any = None
) -> dict[str, float]:
    """GB/s of each step over ``nbytes``, alternated four rounds, the medians
    of the last three (the first warms up); ``sync`` waits for a device."""
    runs: dict[str, list[float]] = {label: [] for label, _ in steps}
    for _ in range(4):
        for label, f in steps:
            if sync:
                sync()
            t = time.perf_counter()
            f()
            if sync:
                sync()
            runs[label].append(_rate(nbytes, time.perf_counter() - t))
    return {k: statistics.median(v[1:]) for k, v in runs.items()}


def measure_connector(layers: int, tokens: int, dtype: str) -> dict[str, float]:
    """GB/s of the connector's own load on CPU, against a memcpy of the same arena
    pages into one private buffer, alternated three times (medians): the copies
    alone (``PageLayer.load`` of every layer), ``PageCopier.load`` as the
    connector's ``start_load`` calls it (the copies, checking each page's checksum
    on the way), and ``PageCopier.save`` as its ``save`` does (blocks back into
    the pages, summed on the way). Blocks are scattered at random in each layer's
    paged cache."""
    import torch

    from kvstore.page_layer import PageCopier

    dt = getattr(torch, dtype)
    block_bytes = tokens * 576 * dt.itemsize
    page_bytes = layers * block_bytes
    pages = max(4, TOTAL_BYTES // page_bytes // 4)
    arena = Arena.create(f"moe-perf-{uuid.uuid4().hex[:8]}", pages, page_bytes)
    try:
        crcs = _random_pages(arena)
        cache_layers, blocks = _paged_caches(arena, layers, (1, tokens, 576), dt, "cpu")
        private = np.ones((pages, page_bytes), dtype=np.uint8)

        def memcpy() -> None:
            for i in range(pages):
                np.copyto(private[i], arena.page(i))

        def copies() -> None:
            for i in range(pages):
                page = arena.page(i)
                for layer in cache_layers:
                    layer.load(page, blocks[i])

        copier = PageCopier(cache_layers, page_bytes)

        def load() -> None:
            for i in range(pages):
                assert copier.load(arena.page(i), blocks[i], crcs[i])

        def save() -> None:  # the same bytes back: the pages keep their checksums
            for i in range(pages):
                summed = copier.save(arena.page(i), blocks[i])
                assert summed is None or summed == crcs[i]

        rates = _medians(
            pages * page_bytes,
            [
                ("memcpy", memcpy),
                ("copies", copies),
                ("load_page", load),
                ("save_page", save),
            ],
        )
        # What was loaded is the page, byte for byte.
        last = cache_layers[-1].block(blocks[-1]).contiguous().view(torch.uint8)
        tail = arena.page(pages - 1)[(layers - 1) * block_bytes :]
        assert np.array_equal(last.numpy().reshape(-1), tail)
        del tail  # a view into the arena: it closes below
        return rates
    finally:
        arena.close()


def measure_gpu(layers: int, tokens: int, dtype: str) -> dict[str, float] | None:
    """GB/s of page loads and saves between the arena and paged caches on a GPU,
    where CUDA is at hand (else None).

    The arena is page-locked, as the connector's worker does it. Against a plain
    pinned tensor copied to the GPU a page per copy (``pinned``: DMA's ceiling
    here) and the arena copied the same way (``arena``): ``PageCopier.load`` a
    page at a time (``per_page``: each page checksummed on the host, then each
    layer's part copied by itself, as the connector did before), and the
    connector's ``DeviceCopier`` (``load``: every page checked on the device;
    ``save``: the blocks gathered and copied back, then their checksums).
    Blocks are scattered at random in each layer's paged cache; each figure is
    the median of three rounds after one to warm up."""
    import torch

    if not torch.cuda.is_available():
        return None
    dt = getattr(torch, dtype)
    page_bytes = layers * tokens * 576 * dt.itemsize
    pages = max(4, TOTAL_BYTES // page_bytes // 4)
    arena = Arena.create(f"moe-perf-{uuid.uuid4().hex[:8]}", pages, page_bytes)
    host = torch.from_numpy(arena.pages())
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)):
        raise RuntimeError("cudaHostRegister failed on the arena")
    try:
        return _gpu_rounds(arena, host, layers, tokens, dt)
    finally:
        cudart.cudaHostUnregister(host.data_ptr())
        del host  # a view of the arena: it closes below
        arena.close()


def _gpu_rounds(
    arena: Arena, host: Any, layers: int, tokens: int, dt: Any
) -> dict[str, float]:
    import torch

    from kvstore.page_layer import DeviceCopier, PageCopier

    pages, page_bytes = arena.num_pages, arena.page_bytes
    crcs = _random_pages(arena)
    plain = torch.empty((pages, page_bytes), dtype=torch.uint8, pin_memory=True)
    plain.copy_(host)
    flat = torch.empty((pages, page_bytes), dtype=torch.uint8, device="cuda")
    cache_layers, blocks = _paged_caches(arena, layers, (tokens, 576), dt, "cuda")
    per_page = PageCopier(cache_layers, page_bytes)
    device = DeviceCopier(cache_layers, page_bytes, max_pages=pages)
    rows = [arena.page(i) for i in range(pages)]  # freed on return: the arena closes

    def dma(src: torch.Tensor) -> None:
        for i in range(pages):
            flat[i].copy_(src[i], non_blocking=True)

    def page_at_a_time() -> None:
        for i in range(pages):
            assert per_page.load(rows[i], blocks[i], crcs[i], True)

    def load() -> None:
        assert all(device.load(rows, blocks, crcs))

    def save() -> None:  # the same bytes back: the pages keep their checksums
        sums = device.save(rows, blocks)
        torch.cuda.current_stream().synchronize()
        assert device.checksums(sums) == crcs

    rates = _medians(
        pages * page_bytes,
        [
            ("pinned", lambda: dma(plain)),
            ("arena", lambda: dma(host)),
            ("per_page", page_at_a_time),
            ("load", load),
            ("save", save),
        ],
        torch.cuda.synchronize,
    )
    # What was loaded is the page, byte for byte.
    last = cache_layers[-1].block(blocks[-1]).reshape(-1).view(torch.uint8)
    block_bytes = page_bytes // layers
    assert np.array_equal(last.cpu().numpy(), rows[-1][(layers - 1) * block_bytes :])
    return rates


def _against(rates: dict[str, float], base: float, keys: Sequence[str]) -> list[str]:
    """Table cells: each rate in GB/s, with its ratio to ``base``."""
    return [f"{rates[k]:.1f} ({rates[k] / base:.2f}x)" for k in keys]


def _table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """Prints a markdown table, each row as soon as it is measured."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row) + " |", flush=True)


def _gpu_rows() -> Iterator[list[str]]:
    for label, layout in LAYOUTS.items():
        g = measure_gpu(*layout)
        assert g is not None
        p = g["pinned"]
        rates = [f"{p:.1f}", f"{g['arena']:.1f}"]
        yield [label, *rates, *_against(g, p, ("per_page", "load", "save"))]


def gpu_table() -> None:
    import torch

    if not torch.cuda.is_available():
        print("host <-> GPU page copies: unmeasured (no CUDA device here)")
        return
    print(f"GPU: {torch.cuda.get_device_name()}")
    _table(
        [
            "page",
            "pinned -> GPU GB/s",
            "arena -> GPU GB/s",
            "a page at a time, checked (x pinned)",
            "connector load, checked (x pinned)",
            "connector save, checksummed (x pinned)",
        ],
        _gpu_rows(),
    )


def _arena_rows() -> Iterator[list[str]]:
    for label, size in SIZES.items():
        r = measure(size)
        rates = (r["memcpy"], r["arena copy"], r["arena load, checked"])
        yield [f"{label}, {size / 1024:.0f} KiB", *(f"{x:.1f}" for x in rates)]


def _connector_rows() -> Iterator[list[str]]:
    for label, layout in LAYOUTS.items():
        c = measure_connector(*layout)
        m = c["memcpy"]
        yield [label, f"{m:.1f}", *_against(c, m, ("copies", "load_page", "save_page"))]


def main() -> None:
    if "--gpu" in sys.argv[1:]:  # the GPU's table alone
        gpu_table()
        return
    _table(
        ["page", "memcpy GB/s", "arena copy GB/s", "arena load, checked GB/s"],
        _arena_rows(),
    )
    print()
    _table(
        [
            "page",
            "memcpy from the arena GB/s",
            "connector copies GB/s (x memcpy)",
            "connector load, checked GB/s (x memcpy)",
            "connector save, summed GB/s (x memcpy)",
        ],
        _connector_rows(),
    )
    print()
    gpu_table()


if __name__ == "__main__":
    main()
