"""One layer's share of a page, and the copies between it and vLLM's paged cache.

A page is one KV block of every layer, ``[layer 0 block | layer 1 block | ...]`` in
the engine's own cache layout. Where the blocks are in a layer's cache is vLLM's
contract, not a guess: its per-layer logical view is ``[B, H, N, C]`` (blocks
first, ``vllm.v1.kv_cache_layout``), and ``group_kernel_blocks`` groups kernel
blocks into the scheduler's blocks, as vLLM's own offloading connector reads it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvstore import page_sum
from kvstore.arena import Bytes, checksum


class PageLayer:
    """One layer's part of every page (``nbytes`` at ``offset``) and that
    layer's paged cache, between which loads and saves copy."""

    def __init__(
        self, name: str, cache: torch.Tensor, block_dim: int, offset: int
    ) -> None:
        self.name, self.cache = name, cache
        self.block_dim, self.offset = block_dim, offset  # dim indexing blocks
        self.shape = tuple(cache.select(block_dim, 0).shape)
        self.nbytes = cache.select(block_dim, 0).numel() * cache.element_size()
        # On CPU, numpy copies of these small blocks cost a fraction of torch's
        # per-call overhead (2-8x the bandwidth here); on CUDA the copy is a DMA
        # from pinned memory, issued by torch.
        self._host = None if cache.is_cuda else cache.view(torch.uint8).numpy()
        # Blocks that are whole rows of the cache (blocks first, contiguous, as
        # vLLM's MLA caches are): one row each in a flat view, the cheapest to
        # index.
        self._rows: npt.NDArray[np.uint8] | None = None
        if (
            self._host is not None
            and block_dim == 0
            and cache.is_contiguous()
            and cache.shape[0] * self.nbytes == self._host.nbytes
        ):
            self._rows = self._host.reshape(cache.shape[0], self.nbytes)

    @classmethod
    def of_vllm_cache(
        cls, name: str, cache: torch.Tensor, num_blocks: int, offset: int
    ) -> PageLayer:
        """The layer of a cache vLLM registered: blocks on its first axis."""
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        if cache.dim() < 2 or cache.shape[0] % num_blocks:
            raise ValueError(
                f"KV cache {name} of shape {tuple(cache.shape)} does not start with "
                f"its {num_blocks} blocks"
            )
        return cls(name, group_kernel_blocks(cache, num_blocks), 0, offset)

    def block(self, block_id: int) -> torch.Tensor:
        return self.cache.select(self.block_dim, block_id)

    def _host_block(self, block_id: int) -> npt.NDArray[np.uint8]:
        assert self._host is not None
        view: npt.NDArray[np.uint8] = self._host[
            (slice(None),) * self.block_dim + (block_id,)
        ]
        return view

    def load(self, page: Bytes, block_id: int, non_blocking: bool = False) -> None:
        """Copies this layer's part of ``page`` (an arena row) into the block."""
        part = page[self.offset : self.offset + self.nbytes]
        if self._rows is not None:
            self._rows[block_id] = part
        elif self._host is not None:
            dst = self._host_block(block_id)
            np.copyto(dst, part.reshape(dst.shape))
        else:
            blk = self.block(block_id)
            src = torch.from_numpy(part).view(blk.dtype).view(blk.shape)
            blk.copy_(src, non_blocking=non_blocking)

    def save(self, page: Bytes, block_id: int, non_blocking: bool = False) -> None:
        """Copies the block into this layer's part of ``page``."""
        part = page[self.offset : self.offset + self.nbytes]
        if self._rows is not None:
            part[:] = self._rows[block_id]
        elif self._host is not None:
            src = self._host_block(block_id)
            np.copyto(part.reshape(src.shape), src)
        else:
            blk = self.block(block_id)
            dst = torch.from_numpy(part).view(blk.dtype).view(blk.shape)
            dst.copy_(blk, non_blocking=non_blocking)


class PageCopier:
    """Loads and saves whole pages (``page_bytes`` each) from and to the same
    layers' blocks: the engine's layers, set once, so what each copy needs is
    worked out once."""

    def __init__(self, layers: Sequence[PageLayer], page_bytes: int) -> None:
        self.layers, self.page_bytes = tuple(layers), page_bytes
        # Host caches whose parts tile the page in order, each starting at a
        # whole word, can be checked as they are copied (below); anything else
        # is checked first.
        host = bool(self.layers) and not self.layers[0].cache.is_cuda
        offset = 0
        for layer in self.layers:
            host &= layer.offset == offset and offset % 8 == 0
            offset += layer.nbytes
        self._tiled = host and offset == page_bytes
        self._parts = [(x, x.offset, x.offset + x.nbytes) for x in self.layers]
        # Blocks that are whole rows, of whole words: one compiled loop copies
        # and sums the page into every layer.
        self._rows: tuple[page_sum.Words, ...] | None = None
        if self._tiled and all(
            x._rows is not None and x.nbytes % 8 == 0 for x in self.layers
        ):
            self._rows = tuple(
                x._rows.view(np.uint64) for x in self.layers if x._rows is not None
            )
        page_sum.warm(self._rows or (), page_bytes)  # not in an engine step

    def load(
        self, page: Bytes, block_id: int, expected: int, non_blocking: bool = False
    ) -> bool:
        """Copies every layer's part of ``page`` into block ``block_id`` if the
        page's bytes checksum to ``expected``; returns whether they did.

        Host caches: the page is summed as it is copied (``page_sum``), so it is
        read from memory once and checking adds little to the copy; where the
        blocks are not whole rows, each layer's part is summed right after it is
        copied, while it is still in the CPU's cache. A page that fails has had
        its blocks written: the caller reports them to vLLM, which recomputes
        them. Device caches: the page is checked in place, then copied by DMA, a
        layer at a time (the connector's worker uses ``DeviceCopier`` for them)."""
        if page.nbytes != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, got {page.nbytes}")
        if self._rows is not None:
            return page_sum.load_rows(self._rows, block_id, page) == expected
        if not self._tiled:
            if checksum(page) != expected:
                return False
            for layer in self.layers:
                layer.load(page, block_id, non_blocking=non_blocking)
            return True
        s1 = s2 = 0
        for layer, start, end in self._parts:
            layer.load(page, block_id)
            s1, s2 = page_sum.sums(page[start:end], start // 8, s1, s2)
        return page_sum.digest(s1, s2, page.nbytes) == expected

    def save(
        self, page: Bytes, block_id: int, non_blocking: bool = False
    ) -> int | None:
        """Copies block ``block_id`` of every layer into ``page``. Returns the
        page's checksum where it was summed on the way (host caches whose blocks
        are whole rows), else None: the caller checksums the page once the
        copies are done (device caches copy asynchronously)."""
        if page.nbytes != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, got {page.nbytes}")
        if self._rows is not None:
            return page_sum.save_rows(self._rows, block_id, page)
        for layer in self.layers:
            layer.save(page, block_id, non_blocking=non_blocking)
        return None


class DeviceCopier:
    """Loads and saves many pages at once for caches in GPU memory.

    Each page crosses the bus in one DMA copy, between its arena row (page-locked)
    and a staging buffer on the device; one kernel per layer then scatters the
    staged pages into their blocks (``index_copy_``), or gathers the blocks into
    them (``index_select``), and the pages' sums (``page_sum``'s, modulo 2**64 in
    int64 arithmetic, whose bits ``page_sum.digest`` reads) are taken on the
    device. Pages go through the staging buffers ``chunk_bytes`` at a time.
    Copying each layer's part of each page by itself, as ``PageCopier`` does for
    host caches, took ~60 copies of 72 KiB per DeepSeek-V3 page, each paying
    torch's and the driver's cost per call: 0.06x to 0.08x of what DMA moved on
    an H200 (tests/perf/page_copy.py --gpu).

    Each direction has two staging buffers and a copy stream of its own: one
    chunk's DMA runs on the copy stream while the caller's stream scatters (or
    gathers) the chunk before, events ordering each buffer's refill after its
    last use. Loads run on the caller's stream (the engine's) and wait for it;
    saves run on theirs (a side stream) and do not, and that stream waits for
    their last DMA, so whatever waits for it (the worker's event, the engine's
    next step) waits for the pages too. Every buffer a step uses is allocated
    up front: its block ids and sums go through page-locked host buffers
    (``max_pages`` each) that a save holds until its sums are read. An
    allocation in a step would be a hidden synchronisation (``cudaHostAlloc``,
    and ``cudaMalloc`` may be one), which orders the streams by accident and
    hides a missing wait.

    On the device it holds six buffers of ``chunk_bytes`` at most (per
    direction: two staging buffers and one for the checksum's products), one
    page of checksum weights and each chunk's block ids and sums:
    ``device_bytes``, never more than ``budget(chunk_bytes)``, which the engine's
    KV cache gives up to it (``deployments.engine.args``)."""

    CHUNK_BYTES = 32 << 20

    @staticmethod
    def budget(chunk_bytes: int) -> int:
        """The most device memory a copier with ``chunk_bytes`` staging buffers
        holds, for any pages of 48 bytes to ``chunk_bytes`` (a real page is one
        block of every layer: KiBs at least): six buffers, a page of weights,
        and 24 bytes of ids and sums per staged page in each direction."""
        return 8 * chunk_bytes

    def __init__(
        self,
        layers: Sequence[PageLayer],
        page_bytes: int,
        chunk_bytes: int = CHUNK_BYTES,
        max_pages: int = 1024,
    ) -> None:
        offset = 0
        for layer in layers:
            if layer.offset != offset:
                raise ValueError(f"layer {layer.name} does not follow the one before")
            offset += layer.nbytes
        if not layers or offset != page_bytes or page_bytes % 8:
            raise ValueError(
                f"the layers' parts ({offset} bytes) must tile a page of whole "
                f"words ({page_bytes} bytes)"
            )
        if page_bytes > chunk_bytes:
            raise ValueError(
                f"a page ({page_bytes} bytes) does not fit a staging buffer "
                f"({chunk_bytes} bytes)"
            )
        self.layers, self.page_bytes = tuple(layers), page_bytes
        self.device = layers[0].cache.device
        self.per_chunk, self.max_pages = chunk_bytes // page_bytes, max_pages
        self._pinned = self.device.type == "cuda"
        self._weights = torch.arange(
            1, page_bytes // 4, 2, dtype=torch.int64, device=self.device
        )  # word i weighs 2i + 1
        # One of each per direction: loads and saves run on different streams.
        self._ways = [_Way(self, self.per_chunk) for _ in range(2)]
        self.device_bytes = self._weights.nbytes + sum(w.nbytes for w in self._ways)
        self._load_host = self._host(max_pages)  # a load waits: one is enough
        self._free = [self._host(max_pages) for _ in range(2)]
        self._lock = threading.Lock()

    def load(
        self, pages: Sequence[Bytes], blocks: Sequence[int], expected: Sequence[int]
    ) -> list[bool]:
        """Copies ``pages[i]`` into block ``blocks[i]`` of every layer and says,
        for each, whether its bytes checksummed to ``expected[i]``. Waits for the
        copies: the pages may be given back once it returns. A page that failed
        has had its blocks written: the caller reports them to vLLM, which
        recomputes them."""
        way, count = self._ways[0], len(pages)
        host = self._load_host if count <= self.max_pages else self._host(count)
        host.ids.numpy()[:count] = blocks
        for k, start in enumerate(range(0, count, self.per_chunk)):
            chunk, buf = pages[start : start + self.per_chunk], way.bufs[k % 2]
            n = len(chunk)
            buf.wait(buf.free, way.copy)  # the scatter out of it two chunks ago
            with way.on_copy():
                for row, page in zip(buf.rows, chunk, strict=False):
                    row.copy_(torch.from_numpy(page), non_blocking=True)
                buf.record(buf.ready, way.copy)
            buf.wait(buf.ready, None)
            ids = way.ids_of(host, start, n)
            for dim, cache, part in buf.parts(n):
                cache.index_copy_(dim, ids, part)
            way.sum_into(buf, host, start, n)
            buf.record(buf.free, None)
        if self._pinned:  # the DMAs are ahead of it: each scatter waited for its own
            torch.cuda.current_stream(self.device).synchronize()
        got = host.sums[:count].tolist()
        return [
            page_sum.digest(s1, s2, self.page_bytes) == want
            for (s1, s2), want in zip(got, expected, strict=True)
        ]

    def save(self, pages: Sequence[Bytes], blocks: Sequence[int]) -> Saved:
        """Copies block ``blocks[i]`` of every layer into ``pages[i]``, queued on
        the current stream. Returns where the pages' sums will be, once the stream
        has passed this point: ``checksums`` reads them then, once."""
        way, host = self._ways[1], self._take(len(pages))
        host.ids.numpy()[: len(blocks)] = blocks
        buf = way.bufs[0]
        for k, start in enumerate(range(0, len(pages), self.per_chunk)):
            chunk, buf = pages[start : start + self.per_chunk], way.bufs[k % 2]
            n = len(chunk)
            buf.wait(buf.free, None)  # its DMA to the arena two chunks ago
            ids = way.ids_of(host, start, n)
            for dim, cache, part in buf.parts(n):
                torch.index_select(cache, dim, ids, out=part)
            way.sum_into(buf, host, start, n)
            buf.record(buf.ready, None)
            with way.on_copy():
                buf.wait(buf.ready, way.copy)
                for row, page in zip(buf.rows, chunk, strict=False):
                    torch.from_numpy(page).copy_(row, non_blocking=True)
                buf.record(buf.free, way.copy)
        buf.wait(buf.free, None)  # the last DMA: the current stream covers them all
        return Saved(host, len(pages))

    def checksums(self, saved: Saved) -> list[int]:
        """The checksums of the pages ``save`` returned ``saved`` for."""
        got = saved.host.sums[: saved.count].tolist()
        if len(saved.host.ids) == self.max_pages:
            with self._lock:
                self._free.append(saved.host)
        return [page_sum.digest(s1, s2, self.page_bytes) for s1, s2 in got]

    def _take(self, count: int) -> _Host:
        if count <= self.max_pages:
            with self._lock:
                if self._free:
                    return self._free.pop()
        return self._host(max(count, self.max_pages))  # more saves in flight

    def _host(self, count: int) -> _Host:
        return _Host(
            torch.empty(count, dtype=torch.int64, pin_memory=self._pinned),
            torch.empty((count, 2), dtype=torch.int64, pin_memory=self._pinned),
        )


@dataclass(frozen=True)
class _Host:
    """Page-locked host memory for the block ids and the pages' sums of one load
    or save."""

    ids: torch.Tensor
    sums: torch.Tensor


@dataclass(frozen=True)
class Saved:
    """Where ``DeviceCopier.save`` puts its pages' sums."""

    host: _Host
    count: int


class _Way:
    """One direction's buffers on the device: two staging buffers, so that one
    chunk's DMA (on this way's copy stream) overlaps the scatter or gather of
    the chunk before (on the caller's stream), and the block ids and sums of
    one chunk."""

    def __init__(self, copier: DeviceCopier, per_chunk: int) -> None:
        device, page_bytes = copier.device, copier.page_bytes
        cuda = device.type == "cuda"
        self.copy: Any = torch.cuda.Stream(device=device) if cuda else None  # type: ignore[no-untyped-call]
        self.bufs = [_Staging(copier, per_chunk, cuda) for _ in range(2)]
        self._ids = torch.empty(per_chunk, dtype=torch.int64, device=device)
        self._sums = torch.empty((per_chunk, 2), dtype=torch.int64, device=device)
        self._product = torch.empty(
            (per_chunk, page_bytes // 8), dtype=torch.int64, device=device
        )
        self._weights = copier._weights
        held = (self._ids, self._sums, self._product, *(b.words for b in self.bufs))
        self.nbytes = sum(x.nbytes for x in held)

    def on_copy(self) -> Any:
        """Runs what follows on the copy stream (on the host: at once)."""
        return torch.cuda.stream(self.copy) if self.copy is not None else nullcontext()

    def ids_of(self, host: _Host, start: int, n: int) -> torch.Tensor:
        ids = self._ids[:n]
        ids.copy_(host.ids[start : start + n], non_blocking=True)
        return ids

    def sum_into(self, buf: _Staging, host: _Host, start: int, n: int) -> None:
        """Sums the first ``n`` pages staged in ``buf`` into ``host.sums[start:]``."""
        words, sums = buf.words[:n], self._sums[:n]
        torch.sum(words, 1, out=sums[:, 0])
        torch.mul(words, self._weights, out=self._product[:n])
        torch.sum(self._product[:n], 1, out=sums[:, 1])
        host.sums[start : start + n].copy_(sums, non_blocking=True)


class _Staging:
    """A staging buffer of ``per_chunk`` pages on the device: its rows, its
    words (as uint64 wraps: the same bits), each layer's part of the staged pages
    viewed in its cache's layout (blocks along its block dim), and two events:
    ``ready`` once its pages are in it, ``free`` once they are out."""

    def __init__(self, copier: DeviceCopier, per_chunk: int, cuda: bool) -> None:
        page_bytes, self.device = copier.page_bytes, copier.device
        staging = torch.empty(
            (per_chunk, page_bytes), dtype=torch.uint8, device=self.device
        )
        self.rows = staging.unbind(0)
        self.words = staging.view(torch.int64)
        self._parts = []
        for x in copier.layers:
            # Copied as bytes, whatever the dtype (fp8 has no index kernels).
            cache = x.cache.view(torch.uint8)
            dim = x.block_dim
            part = staging[:, x.offset : x.offset + x.nbytes].view(
                per_chunk, *cache.select(dim, 0).shape
            )
            self._parts.append((dim, cache, part.movedim(0, dim)))
        self.ready: Any = torch.cuda.Event() if cuda else None  # type: ignore[no-untyped-call]
        self.free: Any = torch.cuda.Event() if cuda else None  # type: ignore[no-untyped-call]

    def parts(self, n: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Each layer's block dim, its cache as bytes, and its part of the
        first ``n`` staged pages."""
        if n == len(self.rows):
            return self._parts
        return [(dim, c, part.narrow(dim, 0, n)) for dim, c, part in self._parts]

    def record(self, event: Any, stream: Any) -> None:
        """Records ``event`` on ``stream`` (None: the current one); on the
        host, where every copy is done when it returns, nothing."""
        if event is not None:
            event.record(stream or torch.cuda.current_stream(self.device))

    def wait(self, event: Any, stream: Any) -> None:
        """Makes ``stream`` (None: the current one) wait for ``event``."""
        if event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)
