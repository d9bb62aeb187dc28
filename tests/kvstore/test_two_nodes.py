"""Cross-node fetch on a 2-node Ray cluster, stores and engines (in a child
process: see two_nodes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import PLATFORM


@pytest.mark.integration
def test_a_page_held_on_node_1_is_fetched_by_node_2(tiny_model: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.kvstore.two_nodes", str(tiny_model)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    result, engines = json.loads(lines[-2]), json.loads(lines[-1])
    print(result, engines)
    assert result["found"] == 8 and result["bytes_equal"]
    assert result["pending_answers"] >= 1  # node 2 waited for the fetch...
    assert result["imported_pages"] == 8  # ...which brought the pages over
    assert result["stores_on_their_nodes"] == {"node-1": True, "node-2": True}
    assert result["distinct_arenas"]
    # Engines: node 2's engine loads the prompt node 1's engine computed.
    assert engines["engine_node_1_cached"] == 0
    block = engines["block_size"]
    assert block == PLATFORM.block_size  # what auto gives on this CPU
    assert engines["engine_node_2_cached"] == 6 * block
    assert engines["engine_node_2_imported_pages"] == 6
    assert engines["same_tokens"]
