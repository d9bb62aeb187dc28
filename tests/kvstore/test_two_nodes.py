"""Cross-node fetch on a 2-node Ray cluster (in a child process: see two_nodes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.integration
def test_a_page_held_on_node_1_is_fetched_by_node_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.kvstore.two_nodes"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    result = json.loads(lines[-1])
    print(result)
    assert result["found"] == 8 and result["bytes_equal"]
    assert result["pending_answers"] >= 1  # node 2 waited for the fetch...
    assert result["imported_pages"] == 8  # ...which brought the pages over
    assert result["stores_on_their_nodes"] == {"node-1": True, "node-2": True}
    assert result["distinct_arenas"]
