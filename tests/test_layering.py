"""Dependencies point one way: cluster <- kvstore <- router <- deployments, and
only the modules that run an engine or a connector import torch or vLLM."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["cluster", "kvstore", "router", "deployments"]  # each may import those before
# The modules vLLM loads into its own processes (the KV connector, the stat
# logger, the scheduler with the realtime guard). Engine-side
# code elsewhere imports vLLM inside the functions that run with the engine.
ENGINE_SIDE = {
    "kvstore/connector.py",
    "kvstore/connector_worker.py",
    "kvstore/page_layer.py",
    "deployments/engine/stat_logger.py",
    "deployments/engine/scheduler.py",
}


def _imports(path: Path, top_level: bool = False) -> set[str]:
    """The top packages ``path`` imports (absolute imports only); ``top_level``:
    only those the module itself imports, not its functions."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", LAYERS)
def test_no_package_imports_one_above_it(package: str) -> None:
    above = set(LAYERS[LAYERS.index(package) + 1 :])
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imports(path) & above
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("package", LAYERS)
def test_torch_and_vllm_only_where_an_engine_runs(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in ENGINE_SIDE:
            continue
        # A function may import them where it runs with the engine; the module
        # itself loads without them (the ingress and the router never pull them).
        bad = _imports(path, top_level=True) & {"torch", "vllm"}
        assert not bad, f"{rel} imports {sorted(bad)}"


def _modules(path: Path) -> set[str]:
    """The modules ``path`` itself imports at load (not under TYPE_CHECKING)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_router_core_reads_plain_settings_not_the_pydantic_config() -> None:
    # The actor builds CoreSettings from the config section; the pure core (and
    # everything it loads) never sees pydantic or YAML.
    for path in sorted((ROOT / "router").glob("*.py")):
        if path.name == "actor.py":
            continue
        bad = {
            m
            for m in _modules(path)
            if m in ("cluster.config", "yaml") or m.split(".")[0] == "pydantic"
        }
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
