"""A layer's part of a page <-> that layer's paged cache, as the connector copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.page_layer import PageLayer


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
