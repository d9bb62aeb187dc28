from __future__ import annotations

from pathlib import Path

import pytest

from cluster.platform import has_amx
from cluster.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny checkpoint, written once per session."""
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-deepseek-v2")


def pytest_report_header() -> list[str]:
    from tests.integration.conftest import PLATFORM
    from tests.integration.test_backends import OTHER, other_runs_here

    cpu = "AMX" if has_amx() else "no AMX"
    other = OTHER.value if other_runs_here() else f"none ({OTHER.value} needs AMX)"
    return [
        f"engines: {PLATFORM.describe()} (this CPU: {cpu})",
        f"engines on the other backend (tests/integration/test_backends.py): {other}",
    ]
