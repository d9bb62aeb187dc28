"""The serving plane's processes on the running cluster (the ingress and engine
replicas, the router) froze what they built while starting and run full
collections ``gc_pauses.FULL_EVERY`` generation-1 collections apart."""

from __future__ import annotations

import gc

import pytest

from cluster import gc_pauses
from router import actor as router_actor
from tests.integration.conftest import Served

pytestmark = pytest.mark.integration


def _collector(_: object) -> tuple[tuple[int, int, int], int, int]:
    return gc.get_threshold(), gc.get_freeze_count(), len(gc.get_objects())


def test_the_serving_plane_spaces_its_full_collections(served: Served) -> None:
    import ray

    app = served.config.server.app_name
    names = [(router_actor.actor_name(app), router_actor.NAMESPACE)] + [
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#")
    ]
    kinds = {n.split("#")[1] for n, _ in names[1:]}
    assert kinds == {"Ingress", "Engine"}
    for name, namespace in names:
        actor = ray.get_actor(name, namespace=namespace)
        threshold, frozen, tracked = ray.get(
            actor.__ray_call__.remote(_collector), timeout=30
        )
        assert threshold[2] == gc_pauses.FULL_EVERY, name
        # The start's objects (imports, tables) are frozen, never walked again:
        # far more of them than the collector still tracks on an idle process.
        assert frozen > 10 * tracked, (name, frozen, tracked)
