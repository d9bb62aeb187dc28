"""How the cluster's singleton actors (the router, the store directory) are run:
one per application, found by name, detached and restarted by Ray, on the head
node.

On the head because that is where they survive a node's loss. The head runs the
GCS and Serve's controller: without it the cluster is down anyway (or, with GCS
fault tolerance, comes back with a new head where these are restarted). On a
worker node, the node's loss would take them too, and Ray restarts them only
once it has declared the node dead (~15 s of missed health checks), while every
admission waits.
"""

from __future__ import annotations

import time
from typing import Any

NAMESPACE = "moe-cluster"
HEAD_NODE = "node:__internal_head__"  # the resource Ray gives the head node alone


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
        "resources": {HEAD_NODE: 0.001},
        # Not in the caller's placement group (an EP group's gang): it would die
        # with the group and could not be restarted.
        "scheduling_strategy": "DEFAULT",
        # Every call (reports, releases, syncs) would be a task event sent on to
        # the GCS: as for Serve's own actors, none.
        "enable_task_events": False,
    } | extra


def kill_and_wait(handle: Any, name: str, timeout_s: float = 30.0) -> None:
    """Kills the singleton ``name`` for good and returns once its name is free.

    ``ray.kill`` returns before the GCS has released the name; creating the
    actor again in that window with ``get_if_exists`` hands back the dying one.
    """
    import ray

    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"actor {name!r} still registered {timeout_s:.0f} s after kill")
