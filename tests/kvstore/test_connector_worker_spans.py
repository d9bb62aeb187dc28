"""The worker side's load span: what a traced request's page loads record."""

from __future__ import annotations

import logging

import pytest

from cluster import tracing
from kvstore.connector_scheduler import Loads, PageLoad
from kvstore.connector_worker import _load_span, _loaded, _log_unloaded
from tests.spans import named, recorder


def loads(n: int, trace: dict[str, str]) -> Loads:
    return Loads(
        "arena", [PageLoad(i, 7, bytes([i]) * 32, 10 + i) for i in range(n)], trace
    )


def test_a_load_records_pages_bytes_and_a_checksum_failure() -> None:
    spans = recorder()
    with tracing.tracer().start_as_current_span("engine.generate") as parent:
        trace = tracing.carrier()
    request = loads(3, trace)
    with _load_span("r1", request) as span:
        _loaded(span, request, (2, 2 * 4096))  # the third page failed its checksum
    [load] = named(spans, "kvstore.load")
    assert load.parent is not None
    assert load.parent.span_id == parent.get_span_context().span_id
    assert load.attributes == {
        "moe_cluster.kv.pages_planned": 3,
        "moe_cluster.kv.pages_loaded": 2,
        "moe_cluster.kv.bytes_loaded": 8192,
        "moe_cluster.kv.checksum_failures": 1,
    }
    [event] = load.events
    assert event.name == "checksum.failed"
    assert event.attributes == {"moe_cluster.kv.pages_recomputed": 1}


def test_a_clean_load_has_no_failure() -> None:
    spans = recorder()
    with tracing.tracer().start_as_current_span("engine.generate"):
        trace = tracing.carrier()
    request = loads(2, trace)
    with _load_span("r1", request) as span:
        _loaded(span, request, (2, 8192))
    [load] = named(spans, "kvstore.load")
    assert (load.attributes or {})["moe_cluster.kv.checksum_failures"] == 0
    assert not load.events


def test_pages_that_did_not_load_are_logged_with_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder()
    tracing.install_log_context()
    request = loads(3, {})
    token = tracing.REQUEST_ID.set("r9")
    try:
        with caplog.at_level(logging.WARNING, logger="moe_cluster.kvstore"):
            _log_unloaded(request, (3, 3 * 4096))  # all loaded: nothing said
            with tracing.tracer().start_as_current_span("kvstore.load"):
                trace_id, _ = tracing.ids()
                _log_unloaded(request, (1, 4096))
    finally:
        tracing.REQUEST_ID.reset(token)
    [record] = caplog.records
    assert record.getMessage() == (
        "2 of 3 stored pages not loaded (checksum failure or store restart): recomputed"
    )
    assert (record.moe_request_id, record.trace_id) == ("r9", trace_id)  # type: ignore[attr-defined]
