"""Cross-node fetch on a 2-node Ray cluster, stores and engines (in a child
process: see two_nodes)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import PLATFORM
from tests.kvstore.two_nodes import PAGE, EnginesRun, Fetched
from tests.otlp_receiver import untraced_env

# Runs before the shared cluster starts (tests/integration/conftest.py).
OWN_CLUSTER = True


@pytest.mark.integration
def test_a_page_held_on_node_1_is_fetched_by_node_2(
    tiny_model: Path, tmp_path: Path
) -> None:
    results = tmp_path / "results.pickle"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.kvstore.two_nodes",
            str(results),
            str(tiny_model),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=untraced_env(),
    )
    assert out.returncode == 0 and results.exists(), out.stderr[-3000:]
    result, engines = pickle.loads(results.read_bytes())
    assert isinstance(result, Fetched) and isinstance(engines, EnginesRun)
    print(result, engines)
    assert result.found == 8 and result.bytes_equal
    assert result.pending_answers >= 1  # node 2 waited for the fetch...
    assert result.imported_pages == 8  # ...which brought the pages over
    assert result.stores_on_their_nodes == {"node-1": True, "node-2": True}
    assert result.distinct_arenas
    # The lookup that found them reports the fetch (a traced request's
    # kvstore.lookup span carries it), and node 2 exports it as metrics.
    assert result.fetch is not None
    assert (result.fetch.pages, result.fetch.nbytes) == (8, 8 * PAGE)
    assert result.fetch.seconds > 0
    assert result.metrics["ray_moe_cluster_kv_fetches_total"]
    assert any(
        'outcome="ok"' in s for s in result.metrics["ray_moe_cluster_kv_fetches_total"]
    )
    assert result.metrics["ray_moe_cluster_kv_fetched_bytes_total"]
    # Engines: node 2's engine loads the prompt node 1's engine computed.
    assert engines.node_1_cached == 0
    block = engines.block_size
    assert block == PLATFORM.block_size  # what auto gives on this CPU
    assert engines.node_2_cached == 6 * block
    assert engines.node_2_imported_pages == 6
    assert engines.same_tokens
