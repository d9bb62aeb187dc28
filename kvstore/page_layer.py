"""One layer's share of a page, and the copies between it and vLLM's paged cache.

A page is one KV block of every layer, ``[layer 0 block | layer 1 block | ...]`` in
the engine's own cache layout. Where the blocks are in a layer's cache is vLLM's
contract, not a guess: its per-layer logical view is ``[B, H, N, C]`` (blocks
first, ``vllm.v1.kv_cache_layout``), and ``group_kernel_blocks`` groups kernel
blocks into the scheduler's blocks, as vLLM's own offloading connector reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch
import xxhash

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


class PageLoader:
    """Loads whole pages (``page_bytes`` each) into the same layers' blocks: the
    engine's layers, set once, so what each load needs is worked out once."""

    def __init__(self, layers: Sequence[PageLayer], page_bytes: int) -> None:
        self.layers, self.page_bytes = tuple(layers), page_bytes
        # Host caches whose parts tile the page in order: each part is checked
        # right after it is copied (below); anything else is checked first.
        self._tiled = bool(self.layers) and not self.layers[0].cache.is_cuda
        offset = 0
        for layer in self.layers:
            self._tiled &= layer.offset == offset
            offset += layer.nbytes
        self._tiled &= offset == page_bytes
        self._parts = [(x, x.offset, x.offset + x.nbytes) for x in self.layers]

    def load(
        self, page: Bytes, block_id: int, expected: int, non_blocking: bool = False
    ) -> bool:
        """Copies every layer's part of ``page`` into block ``block_id`` if the
        page's bytes checksum to ``expected``; returns whether they did.

        Host caches: each layer's part is checksummed right after it is copied,
        while it is still in the CPU's cache, so the page is read from memory
        once (checking the whole page before copying it read it twice). The
        parts cover the page in order, so their running xxh3 is the page's. A
        page that fails has had its blocks written: the caller reports them to
        vLLM, which recomputes them. Device caches: the page is checked in
        place, then copied by DMA."""
        if page.nbytes != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, got {page.nbytes}")
        if not self._tiled:
            if checksum(page) != expected:
                return False
            for layer in self.layers:
                layer.load(page, block_id, non_blocking=non_blocking)
            return True
        data = page.data
        running = xxhash.xxh3_64()
        for layer, start, end in self._parts:
            layer.load(page, block_id)
            running.update(data[start:end])
        return bool(running.intdigest() == expected)
