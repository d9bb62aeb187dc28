"""The variant names of ``tests.perf.engine_step``."""

from __future__ import annotations

import pytest

from tests.perf.engine_step import VARIANTS, _base


@pytest.mark.parametrize(
    "name, base",
    [
        ("bare", "bare"),
        ("moe-no-store", "moe-no-store"),
        ("moe-split", "moe"),
        ("moe@/tmp/old", "moe"),
        ("moe-no-thp-split@../before+python", "moe-no-thp"),
        ("bare+stream", "bare"),
    ],
)
def test_a_variant_name_comes_down_to_its_engine(name: str, base: str) -> None:
    assert _base(name) == base
    assert base in VARIANTS
