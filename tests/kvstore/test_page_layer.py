"""A layer's part of a page <-> that layer's paged cache, as the connector copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.arena import checksum
from kvstore.page_layer import DeviceCopier, PageCopier, PageLayer


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
)
@pytest.mark.parametrize(
    "shape, block_dim",
    [((6, 1, 16, 576), 0), ((2, 6, 16, 4, 8), 1)],  # MLA latent; K/V split
)
def test_save_then_load_moves_exactly_one_block(
    shape: tuple[int, ...], block_dim: int, dtype: torch.dtype
) -> None:
    cache = torch.randn(shape).to(dtype)  # fp8: a quantized KV cache's bytes
    offset = 8  # the layer's part does not start the page
    layer = PageLayer("l0", cache, block_dim, offset)
    block = cache.select(block_dim, 3)
    assert layer.nbytes == block.numel() * cache.element_size()
    page = np.zeros(offset + layer.nbytes + 8, dtype=np.uint8)

    layer.save(page, 3)
    assert not page[:offset].any() and not page[offset + layer.nbytes :].any()
    expected = block.contiguous().view(torch.uint8).numpy().reshape(-1)
    assert np.array_equal(page[offset : offset + layer.nbytes], expected)

    before = cache.clone()
    layer.load(page, 5)
    assert torch.equal(
        cache.select(block_dim, 5).view(torch.uint8), block.view(torch.uint8)
    )
    others = [b for b in range(shape[block_dim]) if b != 5]
    for b in others:
        assert torch.equal(
            cache.select(block_dim, b).view(torch.uint8),
            before.select(block_dim, b).view(torch.uint8),
        )


def test_pages_hold_the_caches_dtype_fp8_in_half_the_bytes() -> None:
    # The tiny model's MLA page (4 layers of 16-token blocks of 576 latents).
    sizes = {
        dtype: sum(
            PageLayer(f"l{i}", torch.zeros(8, 16, 576, dtype=dtype), 0, 0).nbytes
            for i in range(4)
        )
        for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
    }
    assert sizes[torch.bfloat16] == 4 * 16 * 576 * 2 == 73728
    assert sizes[torch.float8_e4m3fn] * 2 == sizes[torch.bfloat16]
    assert sizes[torch.float32] == 2 * sizes[torch.bfloat16]


def test_the_block_axis_is_vllms_first_even_with_two_blocks() -> None:
    # Two blocks of two-token blocks: every leading axis has size 2, so only
    # vLLM's layout (blocks first) says which one indexes blocks.
    cache = torch.arange(2 * 2 * 2 * 3, dtype=torch.float32).reshape(2, 2, 2, 3)
    layer = PageLayer.of_vllm_cache("l0", cache, num_blocks=2, offset=0)
    assert layer.block_dim == 0 and layer.shape == (2, 2, 3)
    page = np.zeros(layer.nbytes, dtype=np.uint8)
    layer.save(page, 1)
    assert np.array_equal(page.view(np.float32), cache[1].reshape(-1).numpy())


def test_kernel_blocks_are_grouped_into_the_schedulers_blocks() -> None:
    # 3 scheduler blocks, each split into 2 kernel blocks of 4 tokens.
    cache = torch.randn(6, 4, 8)
    layer = PageLayer.of_vllm_cache("l0", cache, num_blocks=3, offset=0)
    assert layer.shape == (2, 4, 8)
    page = np.zeros(layer.nbytes, dtype=np.uint8)
    layer.save(page, 2)
    assert np.array_equal(page.view(np.float32), cache[4:6].reshape(-1).numpy())


def test_a_cache_that_does_not_start_with_its_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="does not start with its 4 blocks"):
        PageLayer.of_vllm_cache("l0", torch.zeros(2, 4, 16), num_blocks=4, offset=0)


def _page_of(layers: list[PageLayer], block_id: int) -> np.ndarray:
    page = np.zeros(sum(x.nbytes for x in layers), dtype=np.uint8)
    for layer in layers:
        layer.save(page, block_id)
    return page


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loader_checks_the_page_on_the_way_and_loads_every_layer(
    dtype: torch.dtype,
) -> None:
    caches = [torch.randn(6, 16, 576).to(dtype) for _ in range(3)]
    layers, offset = [], 0
    for i, cache in enumerate(caches):
        layers.append(PageLayer(f"l{i}", cache, 0, offset))
        offset += layers[-1].nbytes
    page = _page_of(layers, 1)
    expected = checksum(page)  # the whole page's, as the store keeps it

    loader = PageCopier(layers, page.nbytes)
    assert loader.load(page, 4, expected)
    for cache in caches:
        assert torch.equal(cache[4].view(torch.uint8), cache[1].view(torch.uint8))

    page[offset - 1] ^= 0x40  # one bit of the last layer's part
    assert not loader.load(page, 5, expected)


def test_a_loader_checks_layers_that_do_not_tile_the_page_before_copying() -> None:
    # A gap between the parts: the page is checked whole, and nothing is copied
    # from a page that fails.
    caches = [torch.randn(4, 8, 64) for _ in range(2)]
    first = PageLayer("l0", caches[0], 0, 0)
    layers = [first, PageLayer("l1", caches[1], 0, first.nbytes + 16)]
    page = np.zeros(2 * first.nbytes + 16, dtype=np.uint8)
    for layer in layers:
        layer.save(page, 0)
    expected = checksum(page)
    loader = PageCopier(layers, page.nbytes)
    assert loader.load(page, 2, expected)
    assert torch.equal(caches[1][2], caches[1][0])

    before = [c.clone() for c in caches]
    page[first.nbytes + 3] ^= 1  # in the gap: still part of the page's bytes
    assert not loader.load(page, 3, expected)
    assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))


@pytest.mark.parametrize("block_dim", [0, 1])  # whole rows; strided blocks
def test_a_copier_saves_and_loads_pages_summed_as_the_store_checks_them(
    block_dim: int,
) -> None:
    shape = (6, 2, 16, 8) if block_dim == 0 else (2, 6, 16, 8)
    caches = [torch.randn(shape) for _ in range(3)]
    layers, offset = [], 0
    for i, cache in enumerate(caches):
        layers.append(PageLayer(f"l{i}", cache, block_dim, offset))
        offset += layers[-1].nbytes
    copier = PageCopier(layers, offset)
    page = np.zeros(offset, dtype=np.uint8)

    summed = copier.save(page, 2)
    assert np.array_equal(page, _page_of(layers, 2))
    # Whole rows are summed as they are copied; strided blocks are checksummed
    # by the caller once copied.
    assert summed == (checksum(page) if block_dim == 0 else None)

    expected = checksum(page)
    assert copier.load(page, 4, expected)
    for cache in caches:
        assert torch.equal(cache.select(block_dim, 4), cache.select(block_dim, 2))
    page[3] ^= 0x01  # the first layer's part
    assert not copier.load(page, 5, expected)
    with pytest.raises(ValueError, match="a page is"):
        copier.save(page[:-8], 2)


# DeviceCopier is written for GPU caches (tests/kvstore/test_cuda_pages.py runs it
# there); its torch operations are the same on the host, where these run.


def _layers(
    dtype: torch.dtype, block_dim: int, blocks: int = 12
) -> tuple[list[PageLayer], int]:
    shape = (blocks, 16, 72) if block_dim == 0 else (2, blocks, 16, 4, 9)
    layers, offset = [], 0
    for i in range(3):
        bits = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize))
        cache = bits.to(torch.uint8).view(dtype)  # any bytes, as a page may hold
        layers.append(PageLayer(f"l{i}", cache, block_dim, offset))
        offset += layers[-1].nbytes
    return layers, offset


@pytest.mark.parametrize(
    "dtype, block_dim",
    [(torch.bfloat16, 0), (torch.float32, 0), (torch.float8_e4m3fn, 1)],
)
def test_a_device_copier_moves_many_pages_a_chunk_at_a_time(
    dtype: torch.dtype, block_dim: int
) -> None:
    layers, page_bytes = _layers(dtype, block_dim)
    copier = DeviceCopier(layers, page_bytes, chunk_bytes=2 * page_bytes)
    assert copier.per_chunk == 2  # 5 pages: three chunks
    arena = np.zeros((5, page_bytes), dtype=np.uint8)
    saved = [7, 0, 11, 3, 5]

    sums = copier.save(list(arena), saved)
    for page, block in zip(arena, saved, strict=True):
        assert np.array_equal(page, _page_of(layers, block))
    # The sums taken on the device give the checksums the store keeps.
    assert copier.checksums(sums) == [checksum(page) for page in arena]

    before = [x.cache.clone() for x in layers]
    targets = [1, 2, 4, 6, 8]
    assert copier.load(list(arena), targets, copier.checksums(sums)) == [True] * 5
    for layer, old in zip(layers, before, strict=True):
        for src, dst in zip(saved, targets, strict=True):
            assert torch.equal(
                layer.block(dst).view(torch.uint8),
                old.select(block_dim, src).view(torch.uint8),
            )
        for other in (0, 3, 5, 7, 9, 10, 11):  # no other block is written
            assert torch.equal(
                layer.block(other).view(torch.uint8),
                old.select(block_dim, other).view(torch.uint8),
            )


def test_a_device_copier_says_which_pages_failed_their_checksum() -> None:
    layers, page_bytes = _layers(torch.bfloat16, 0)
    copier = DeviceCopier(layers, page_bytes, chunk_bytes=page_bytes)
    arena = np.zeros((3, page_bytes), dtype=np.uint8)
    expected = copier.checksums(copier.save(list(arena), [0, 1, 2]))
    arena[1, page_bytes - 1] ^= 0x80  # the last byte of the last layer's part
    assert copier.load(list(arena), [3, 4, 5], expected) == [True, False, True]
    arena[1, page_bytes - 1] ^= 0x80
    arena[[0, 2]] = arena[[2, 0]]  # two whole pages swapped
    assert copier.load(list(arena), [3, 4, 5], expected) == [False, True, False]


def test_a_device_copier_needs_layers_that_tile_a_page_of_words() -> None:
    layers, page_bytes = _layers(torch.bfloat16, 0)
    with pytest.raises(ValueError, match="must tile a page"):
        DeviceCopier(layers, page_bytes + 8)
    gap = [layers[0], PageLayer("l1", layers[1].cache, 0, layers[0].nbytes + 8)]
    with pytest.raises(ValueError, match="does not follow"):
        DeviceCopier(gap, page_bytes)


@pytest.mark.parametrize(
    "page_bytes, chunk_bytes",
    [(48, 48), (48, 4096), (6912, 6912), (6912, 100_000), (6912, 1 << 20)],
)
def test_a_device_copier_holds_no_more_device_memory_than_its_budget(
    page_bytes: int, chunk_bytes: int
) -> None:
    cache = torch.zeros((4, page_bytes), dtype=torch.uint8)
    copier = DeviceCopier([PageLayer("l0", cache, 0, 0)], page_bytes, chunk_bytes)
    # As many whole pages as a buffer takes, in each of its six buffers.
    staged = copier.per_chunk * page_bytes
    assert chunk_bytes - page_bytes < staged <= chunk_bytes
    assert 6 * staged <= copier.device_bytes <= DeviceCopier.budget(chunk_bytes)


def test_a_device_copier_refuses_a_page_larger_than_its_staging_buffers() -> None:
    layers, page_bytes = _layers(torch.bfloat16, 0)
    with pytest.raises(ValueError, match="does not fit a staging buffer"):
        DeviceCopier(layers, page_bytes, chunk_bytes=page_bytes - 8)
