"""The ingress opens each engine stream over the transport
``server.engine_transport`` names: Serve's gRPC transport (``_by_reference=False``)
when set to ``grpc``, a Ray actor call (``_by_reference=True``) when set to
``actor``, and by default (``direct``) a stream straight to the placed replica once
its endpoint is known, Serve's gRPC transport until then."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.config import ClusterConfig
from deployments.ingress.deployment import Ingress
from deployments.protocol import EngineRequest, Sampling
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


class _Direct:
    """``DirectStreams``' surface: knows the endpoints of ``known``."""

    def __init__(self, known: set[str]) -> None:
        self.known = known
        self.asked: list[str] = []

    def open(
        self, request: EngineRequest, trace: dict[str, str], route: str = ""
    ) -> str | None:
        if request.replica_id in self.known:
            return "direct"
        self.asked.append(request.replica_id)
        return None


def _request(replica: str = "") -> EngineRequest:
    return EngineRequest("r", (1,), Sampling(max_tokens=1), replica_id=replica)


def _open(
    config: ClusterConfig, request: EngineRequest | None = None, direct: Any = None
) -> _Handle:
    handle = _Handle()
    ingress = SimpleNamespace(_config=config, _engine=handle, _direct=direct)
    request = request or _request()
    assert Ingress.func_or_class._open_stream(ingress, request) == "stream"
    assert handle.sent == [request]
    return handle


def test_engine_streams_can_go_over_serves_grpc_transport() -> None:
    assert _config().server.engine_transport == "direct"
    handle = _open(_config(engine_transport="grpc"), _request("replica-a"))
    assert handle.options_given == [{"stream": True, "_by_reference": False}]


def test_engine_streams_can_be_ray_actor_calls() -> None:
    handle = _open(_config(engine_transport="actor"))
    assert handle.options_given == [{"stream": True, "_by_reference": True}]


def test_an_unknown_transport_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="engine_transport"):
        _config(engine_transport="http")


def test_direct_streams_go_straight_to_a_known_replica() -> None:
    cfg = _config(engine_transport="direct")
    handle, direct = _Handle(), _Direct({"replica-a"})
    ingress = SimpleNamespace(_config=cfg, _engine=handle, _direct=direct)
    placed = _request("replica-a")
    assert Ingress.func_or_class._open_stream(ingress, placed) == "direct"
    assert handle.sent == [] and direct.asked == []


def test_until_its_endpoint_is_known_a_request_goes_through_serve() -> None:
    # Placed on a replica the ingress has no endpoint for yet (it is asked for),
    # or not placed at all (the router disabled): Serve's gRPC transport.
    direct = _Direct(set())
    cfg = _config(engine_transport="direct")
    handle = _open(cfg, _request("replica-b"), direct)
    assert handle.options_given == [{"stream": True, "_by_reference": False}]
    assert direct.asked == ["replica-b"]
    _open(cfg, _request(""), direct)
    assert direct.asked == ["replica-b"]
