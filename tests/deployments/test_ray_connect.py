from __future__ import annotations

import socket
import time

import pytest

from deployments.ray_connect import init_ray, probe, resolve_address


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once it is closed


def test_no_address_is_a_new_local_cluster_whatever_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_closed_port()}")
    assert resolve_address(None) is None
    assert resolve_address("local") is None


def test_an_address_that_does_not_answer_fails_in_seconds_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dead = f"127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=dead):
        init_ray(dead)
    # "auto" follows RAY_ADDRESS (or the last `ray start`), probed the same way.
    monkeypatch.setenv("RAY_ADDRESS", dead)
    with pytest.raises(ConnectionError, match=dead.split(":")[1]):
        init_ray("auto")
    assert time.monotonic() - start < 10


def test_probe_accepts_a_listening_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        probe(f"127.0.0.1:{s.getsockname()[1]}", timeout_s=1)
