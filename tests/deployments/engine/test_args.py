"""The engine's own check of the backend its config resolved to."""

from __future__ import annotations

import pytest

from cluster.config import EngineConfig
from cluster.platform import Backend
from deployments.engine.args import check_platform


def test_an_amx_config_on_a_node_without_amx_fails_naming_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    amx = EngineConfig(attention_backend="AMX_MLA", block_size=128)
    with pytest.raises(RuntimeError, match=r"on this engine's node.*CPU_MLA"):
        check_platform(amx)
    reference = EngineConfig(attention_backend="CPU_MLA", block_size=16)
    assert check_platform(reference) is Backend.CPU_MLA  # runs on every CPU
    assert check_platform(EngineConfig(block_size=64)) is Backend.GPU
