"""An ingress replica's access lines (Serve's and its own) go to the replica's
Serve log file, not to stderr, from which Ray's log monitor ships every line to
the driver's console; its other lines still go to both."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from ray.serve._private.common import ServeComponentType
from ray.serve._private.logging_utils import configure_component_logger
from ray.serve.schema import LoggingConfig

from cluster import tracing
from deployments.ingress import telemetry
from deployments.protocol import EngineRequest, Finish, Sampling

TRACE_ID, SPAN_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7


@pytest.fixture(params=["TEXT", "JSON"])
def replica_log(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],  # first: Serve's stream handler writes to it
) -> Iterator[Path]:
    """Serve's logger as an ingress replica's (its file under ``tmp_path``, and
    stderr), in the encoding given, with the access lines sent to the file
    only; the file's path."""
    serve_logger = logging.getLogger("ray.serve")
    root = logging.getLogger()
    saved = (
        serve_logger.handlers[:],
        serve_logger.filters[:],
        serve_logger.level,
        serve_logger.propagate,
    )
    root_level = root.level
    root.setLevel(logging.INFO)  # as Ray's logging config sets it in a worker
    _configure(tmp_path, request.param)
    tracing.install_log_context()  # as the ingress does when it starts
    try:
        assert telemetry.access_lines_to_file()
        [path] = tmp_path.glob("*.log")
        yield path
    finally:
        for handler in serve_logger.handlers:
            handler.close()
        serve_logger.handlers[:] = saved[0]
        serve_logger.filters[:] = saved[1]
        serve_logger.setLevel(saved[2])
        serve_logger.propagate = saved[3]
        telemetry.access_logger.handlers.clear()
        telemetry.access_logger.propagate = True
        root.setLevel(root_level)


def _configure(logs: Path, encoding: str) -> None:
    """Serve's logging of a replica, as Serve sets it up (and again when it
    reconfigures the replica)."""
    configure_component_logger(
        component_name="moe-cluster_Ingress",
        component_id="abc123",
        logging_config=LoggingConfig(logs_dir=str(logs), encoding=encoding),
        component_type=ServeComponentType.REPLICA,
        max_bytes=1 << 20,
        backup_count=1,
    )


def _request(rid: str) -> EngineRequest:
    return EngineRequest(rid, (1, 2, 3), Sampling(max_tokens=4))


def _traced() -> telemetry.RequestTelemetry:
    """A request's telemetry under a caller's (unsampled) trace context."""
    parent = NonRecordingSpan(
        SpanContext(TRACE_ID, SPAN_ID, is_remote=True, trace_flags=TraceFlags(0))
    )
    token = otel_context.attach(trace.set_span_in_context(parent))
    try:
        return telemetry.RequestTelemetry(
            "text_completion", "tiny", "http", record_metrics=False
        )
    finally:
        otel_context.detach(token)


@pytest.mark.parametrize("reconfigured", [False, True])
def test_access_lines_go_to_the_file_and_not_to_stderr(
    replica_log: Path, capsys: pytest.CaptureFixture[str], reconfigured: bool
) -> None:
    serve_logger = logging.getLogger("ray.serve")
    if reconfigured:  # Serve replaced its handlers (a new logging config)
        encoding = "JSON" if replica_log.read_text().startswith("{") else "TEXT"
        _configure(replica_log.parent, encoding)
    serve_logger.info(
        "POST /v1/completions 200 3.1ms", extra={"serve_access_log": True}
    )
    tel = _traced()
    tel.request(_request("r-ok"), stream=True)
    tel.finished(Finish("length", 3, 4, 0, "replica-1"))
    tel.end()
    failed = _traced()
    failed.request(_request("r-failed"), stream=False)
    failed.failed(RuntimeError("boom"))
    failed.end()
    serve_logger.warning("a replica's warning")

    text = replica_log.read_text()
    lines = text.splitlines()
    assert any("POST /v1/completions 200 3.1ms" in line for line in lines)
    [ok] = [line for line in lines if "request r-ok " in line]
    assert "text_completion: length, 3+4 tokens (0 cached) on replica-1" in ok
    assert f"trace_id={TRACE_ID:032x}" in ok
    [failure] = [line for line in lines if "request r-failed " in line]
    assert "failed (RuntimeError)" in failure
    assert f"trace_id={TRACE_ID:032x}" in failure
    assert "a replica's warning" in text
    if replica_log.read_text().startswith("{"):  # JSON: the ids as fields too
        record = json.loads(ok)
        assert record["trace_id"] == f"{TRACE_ID:032x}"
        assert record["moe_request_id"] == "r-ok"

    err = capsys.readouterr().err
    assert "a replica's warning" in err  # the rest still reaches the console
    assert "POST /v1/completions" not in err
    assert "request r-ok" not in err and "request r-failed" not in err


def test_outside_a_replica_nothing_changes() -> None:
    serve_logger = logging.getLogger("ray.serve")
    saved = serve_logger.handlers[:], serve_logger.filters[:]
    serve_logger.handlers[:] = [logging.StreamHandler()]
    try:
        assert not telemetry.access_lines_to_file()
        assert telemetry.access_logger.propagate
        assert not telemetry.access_logger.handlers
        assert serve_logger.filters == saved[1]
    finally:
        serve_logger.handlers[:], serve_logger.filters[:] = saved
