"""Where ``DeviceCopier.load``'s time goes per staging chunk on a GPU, and
whether replaying a full chunk's per-layer kernels as one CUDA graph loads
faster than issuing them one by one.

    .venv/bin/python -m tests.perf.gpu_chunk

For each page layout of ``tests.perf.page_copy`` and staging buffers of 32 MiB
(the default) and 128 MiB: what the host spends issuing one chunk's per-layer
``index_copy_`` calls and its per-page DMA copies, what the device spends on
the chunk's scatters and sums (queued behind a sleep, so that issuing does not
show), a chunk's DMA time at the rate of the same copies from the page-locked
arena, and the copier's checked loads, issued as ``DeviceCopier.load`` does
and with each full chunk's kernels replayed from a CUDA graph. GB/s are
medians of three rounds of 256 MiB after one to warm up, with the ratio to DMA.
The first layout's issue figures include loading the kernels.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvstore import page_sum
from kvstore.arena import Arena
from kvstore.page_layer import DeviceCopier
from tests.perf.page_copy import LAYOUTS, _paged_caches, _random_pages


def _issue_us(f: Callable[[], object], n: int = 50) -> float:
    """Microseconds the host spends in one call of ``f``, the device's work
    not waited for."""
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    issue = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return issue


def _graphs(copier: DeviceCopier) -> dict[int, Any]:
    """A CUDA graph per load staging buffer of a full chunk's scatters and sums
    (the block ids read from the way's device buffer, as eager loads do)."""
    import torch

    way, n = copier._ways[0], copier.per_chunk
    ids = way._ids[:n]
    ids.zero_()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    graphs = {}
    for b, buf in enumerate(way.bufs):
        with torch.cuda.stream(side):  # the kernels loaded before capture
            for dim, cache, part in buf.parts(n):
                torch.index_select(cache, dim, ids, out=part)
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for dim, cache, part in buf.parts(n):
                cache.index_copy_(dim, ids, part)
            words, sums = buf.words[:n], way._sums[:n]
            torch.sum(words, 1, out=sums[:, 0])
            torch.mul(words, way._weights, out=way._product[:n])
            torch.sum(way._product[:n], 1, out=sums[:, 1])
        graphs[b] = graph
    torch.cuda.synchronize()
    return graphs


def _graph_load(
    copier: DeviceCopier, graphs: dict[int, Any], pages: Sequence[Any], blocks: Any
) -> list[int]:
    """``DeviceCopier.load``, each full chunk's kernels replayed from a graph;
    the pages' checksums."""
    import torch

    way, host, count = copier._ways[0], copier._load_host, len(pages)
    host.ids.numpy()[:count] = blocks
    for k, start in enumerate(range(0, count, copier.per_chunk)):
        chunk, buf = pages[start : start + copier.per_chunk], way.bufs[k % 2]
        n = len(chunk)
        buf.wait(buf.free, way.copy)
        with way.on_copy():
            for row, page in zip(buf.rows, chunk, strict=False):
                row.copy_(torch.from_numpy(page), non_blocking=True)
            buf.record(buf.ready, way.copy)
        buf.wait(buf.ready, None)
        ids = way.ids_of(host, start, n)
        if n == copier.per_chunk:
            graphs[k % 2].replay()
            host.sums[start : start + n].copy_(way._sums[:n], non_blocking=True)
        else:
            for dim, cache, part in buf.parts(n):
                cache.index_copy_(dim, ids, part)
            way.sum_into(buf, host, start, n)
        buf.record(buf.free, None)
    torch.cuda.current_stream().synchronize()
    got = host.sums[:count].tolist()
    return [page_sum.digest(s1, s2, copier.page_bytes) for s1, s2 in got]


def _row(
    label: str,
    arena: Arena,
    host: Any,
    caches: list[Any],
    blocks: list[int],
    crcs: list[int],
    chunk_mib: int,
) -> str:
    import torch

    pages, page_bytes = arena.num_pages, arena.page_bytes
    rows = [arena.page(i) for i in range(pages)]
    copier = DeviceCopier(
        caches, page_bytes, chunk_bytes=chunk_mib << 20, max_pages=pages
    )
    way, n = copier._ways[0], copier.per_chunk
    buf, ids = way.bufs[0], way._ids[:n]
    ids.copy_(torch.tensor(blocks[:n]))
    parts = buf.parts(n)
    kernels = _issue_us(lambda: [c.index_copy_(d, ids, p) for d, c, p in parts])
    dmas = _issue_us(
        lambda: [
            r.copy_(torch.from_numpy(pg), non_blocking=True)
            for r, pg in zip(buf.rows, rows[:n], strict=False)
        ]
    )
    torch.cuda._sleep(400_000_000)  # type: ignore[no-untyped-call]
    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))  # type: ignore[no-untyped-call]
    e0.record()
    for d, c, p in parts:
        c.index_copy_(d, ids, p)
    e1.record()
    way.sum_into(buf, copier._load_host, 0, n)
    e2.record()
    torch.cuda.synchronize()
    graphs = _graphs(copier)
    flat = torch.empty((pages, page_bytes), dtype=torch.uint8, device="cuda")

    def dma() -> None:
        for i in range(pages):
            flat[i].copy_(host[i], non_blocking=True)

    def eager() -> None:
        assert all(copier.load(rows, blocks, crcs))

    def graph() -> None:
        assert _graph_load(copier, graphs, rows, blocks) == crcs

    runs: dict[str, list[float]] = {"dma": [], "eager": [], "graph": []}
    for _ in range(4):
        for name, f in (("dma", dma), ("eager", eager), ("graph", graph)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            torch.cuda.synchronize()
            runs[name].append(pages * page_bytes / (time.perf_counter() - t) / 1e9)
    rate = {k: statistics.median(v[1:]) for k, v in runs.items()}
    ceiling = rate["dma"]
    chunk_us = n * page_bytes / ceiling / 1e3
    cells = [
        label,
        f"{chunk_mib} MiB ({n} pages)",
        f"{len(parts)}: {kernels:.0f} µs",
        f"{n}: {dmas:.0f} µs",
        f"{e0.elapsed_time(e1) * 1e3:.0f} µs",
        f"{e1.elapsed_time(e2) * 1e3:.0f} µs",
        f"{chunk_us:.0f} µs ({ceiling:.1f} GB/s)",
        *(f"{rate[k]:.1f} ({rate[k] / ceiling:.2f}x)" for k in ("eager", "graph")),
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        "| page | staging buffer | kernels issued per chunk | DMAs issued per chunk "
        "| scatters on the device | sums on the device | a chunk's DMA "
        "| load, checked (x DMA) | load, kernels from a graph (x DMA) |"
    )
    print("|" + "---|" * 9)
    for label, (layers, tokens, dtype) in LAYOUTS.items():
        dt = getattr(torch, dtype)
        page_bytes = layers * tokens * 576 * dt.itemsize
        pages = max(4, (1 << 30) // page_bytes // 4)
        arena = Arena.create(f"moe-perf-{uuid.uuid4().hex[:8]}", pages, page_bytes)
        host = torch.from_numpy(arena.pages())
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        if int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)):
            raise RuntimeError("cudaHostRegister failed on the arena")
        try:
            crcs = _random_pages(arena)
            caches, blocks = _paged_caches(arena, layers, (tokens, 576), dt, "cuda")
            for chunk_mib in (32, 128):
                print(_row(label, arena, host, caches, blocks, crcs, chunk_mib))
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        finally:
            cudart.cudaHostUnregister(host.data_ptr())
            del host
            arena.close()


if __name__ == "__main__":
    main()
