"""How the cluster's singleton actors (the router, the store directory) are run:
one per application, found by name, detached and restarted by Ray."""

from __future__ import annotations

from typing import Any

NAMESPACE = "moe-cluster"


def singleton_options(name: str, **extra: Any) -> dict[str, Any]:
    """Ray actor options for the singleton ``name`` (``extra`` adds or overrides)."""
    return {
        "name": name,
        "namespace": NAMESPACE,
        "get_if_exists": True,
        "lifetime": "detached",
        "max_restarts": -1,
        "max_task_retries": -1,  # calls in flight when it dies are retried
        "num_cpus": 0,
        # Not in the caller's placement group (an EP group's gang): it would die
        # with the group and could not be restarted.
        "scheduling_strategy": "DEFAULT",
    } | extra
