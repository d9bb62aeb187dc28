"""The ingress opens each engine stream over the transport
``server.engine_transport`` names: Serve's gRPC transport (``_by_reference=False``)
by default, a Ray actor call (``_by_reference=True``) when set to ``actor``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.config import ClusterConfig
from deployments.ingress.deployment import Ingress
from tests.deployments.test_app import config as _config


class _Handle:
    """A DeploymentHandle's surface the ingress uses to open a stream."""

    def __init__(self) -> None:
        self.options_given: list[dict[str, Any]] = []
        self.sent: list[object] = []

    def options(self, **options: Any) -> _Handle:
        self.options_given.append(options)
        return self

    @property
    def generate(self) -> _Handle:
        return self

    def remote(self, request: object) -> str:
        self.sent.append(request)
        return "stream"


def _open(config: ClusterConfig) -> _Handle:
    handle = _Handle()
    ingress = SimpleNamespace(_config=config, _engine=handle)
    request = object()
    assert Ingress.func_or_class._open_stream(ingress, request) == "stream"
    assert handle.sent == [request]
    return handle


def test_engine_streams_go_over_serves_grpc_transport_by_default() -> None:
    assert _config().server.engine_transport == "grpc"
    assert _open(_config()).options_given == [{"stream": True, "_by_reference": False}]


def test_engine_streams_can_be_ray_actor_calls() -> None:
    handle = _open(_config(engine_transport="actor"))
    assert handle.options_given == [{"stream": True, "_by_reference": True}]


def test_an_unknown_transport_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="engine_transport"):
        _config(engine_transport="http")
