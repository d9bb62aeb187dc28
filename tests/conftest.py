from __future__ import annotations

from pathlib import Path

import pytest

from cluster.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny checkpoint, written once per session."""
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-deepseek-v2")
