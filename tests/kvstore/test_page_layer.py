"""A layer's part of a page <-> that layer's paged cache, as the connector copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.connector import PageLayer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, block_dim",
    [((6, 1, 16, 576), 0), ((2, 6, 16, 4, 8), 1)],  # MLA latent; K/V split
)
def test_save_then_load_moves_exactly_one_block(
    shape: tuple[int, ...], block_dim: int, dtype: torch.dtype
) -> None:
    cache = torch.randn(shape).to(dtype)
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
    assert torch.equal(cache.select(block_dim, 5), block)
    others = [b for b in range(shape[block_dim]) if b != 5]
    for b in others:
        assert torch.equal(cache.select(block_dim, b), before.select(block_dim, b))
