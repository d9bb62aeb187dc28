"""Trace export configured from the standard OTEL_* variables and the config
section; W3C carriers; log records that carry the trace."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from opentelemetry import trace

from cluster import tracing
from tests.spans import recorder

BASE = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}


def test_no_endpoint_means_no_tracing() -> None:
    assert tracing.settings({}) is None
    assert tracing.serve_env(None) == {}
    assert tracing.settings(BASE | {"OTEL_SDK_DISABLED": "true"}) is None
    assert tracing.settings(BASE | {"OTEL_TRACES_EXPORTER": "none"}) is None


def test_the_standard_variables_choose_endpoint_protocol_sampler_and_name() -> None:
    s = tracing.settings(BASE)
    assert s == tracing.TraceSettings(
        "http://collector:4317", "grpc", 1.0, tracing.DEFAULT_SERVICE
    )
    http = tracing.settings(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
            "OTEL_SERVICE_NAME": "serving-east",
        }
    )
    # http/protobuf appends the signal's path to the base URL, as the spec says.
    assert http == tracing.TraceSettings(
        "http://collector:4318/v1/traces", "http/protobuf", 0.25, "serving-east"
    )
    traces_only = tracing.settings(
        BASE | {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://tempo:4317"}
    )
    assert traces_only is not None and traces_only.endpoint == "http://tempo:4317"
    off = tracing.settings(BASE | {"OTEL_TRACES_SAMPLER": "always_off"})
    assert off is not None and off.sampling_ratio == 0.0


def test_the_config_section_wins_and_reaches_the_workers() -> None:
    s = tracing.settings(BASE, sampling_ratio=0.1, service_name="mine")
    assert s is not None and (s.sampling_ratio, s.service_name) == (0.1, "mine")
    env = tracing.serve_env(s)
    assert env[tracing.SERVE_EXPORTER_VAR] == tracing.SPAN_PROCESSORS
    # A worker reads the driver's choice back from what it inherited.
    worker = tracing.settings(BASE | env)
    assert worker is not None
    assert (worker.sampling_ratio, worker.service_name) == (0.1, "mine")


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
        {"OTEL_TRACES_SAMPLER": "jaeger_remote"},
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "lots"},
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
    ],
)
def test_a_malformed_variable_is_an_error_naming_it(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="OTEL_"):
        tracing.settings(BASE | env)


def test_span_processors_export_over_otlp(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    [processor] = tracing.span_processors()
    assert isinstance(processor, BatchSpanProcessor)
    processor.shutdown()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert tracing.span_processors() == []


def test_a_carrier_carries_the_span_across_a_call() -> None:
    recorder()
    assert tracing.carrier() == {}  # nothing current
    assert tracing.context_of({}) is None
    assert tracing.context_of({"traceparent": "garbage"}) is None
    with tracing.tracer().start_as_current_span("caller") as span:
        headers = tracing.carrier()
        trace_id, span_id = tracing.ids()
    version, tid, sid, flags = headers["traceparent"].split("-")
    assert (version, tid, sid) == ("00", trace_id, span_id)
    assert int(flags, 16) & 1  # sampled
    assert tracing.ids(span) == (trace_id, span_id)
    ctx = tracing.context_of(headers)
    assert ctx is not None
    child = tracing.tracer().start_span("callee", context=ctx)
    assert child.get_span_context().trace_id == span.get_span_context().trace_id
    assert child.parent is not None and child.parent.span_id == int(span_id, 16)
    child.end()


def test_log_records_carry_request_trace_and_span_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder()
    tracing.install_log_context()
    log = logging.getLogger("moe_cluster.test")
    with caplog.at_level(logging.INFO, logger="moe_cluster"):
        token = tracing.REQUEST_ID.set("req-1")
        try:
            with tracing.tracer().start_as_current_span("work"):
                trace_id, span_id = tracing.ids()
                log.info("inside")
        finally:
            tracing.REQUEST_ID.reset(token)
        log.info("outside")
        logging.getLogger("other").warning("not ours")
    inside, outside = [r for r in caplog.records if r.name == "moe_cluster.test"]
    assert (inside.moe_request_id, inside.trace_id, inside.span_id) == (  # type: ignore[attr-defined]
        "req-1",
        trace_id,
        span_id,
    )
    assert not hasattr(outside, "trace_id") and not hasattr(outside, "moe_request_id")
    assert trace.get_current_span().get_span_context().is_valid is False


def test_engine_processes_log_lines_with_request_and_trace_ids() -> None:
    """vLLM's engine-core and worker processes (where the page store's connector
    runs) are outside Ray's logging: their moe_cluster lines go to stderr with
    the request's ids appended."""
    script = """
import logging
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry import trace
from cluster import tracing
trace.set_tracer_provider(TracerProvider())
tracing.install_process_logging()
tracing.install_process_logging()  # idempotent: one handler
log = logging.getLogger("moe_cluster.kvstore")
tracing.REQUEST_ID.set("req-7")
with trace.get_tracer("t").start_as_current_span("kvstore.load"):
    trace_id, span_id = tracing.ids()
    log.warning("2 of 3 stored pages not loaded")
print(trace_id, span_id)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    trace_id, span_id = done.stdout.split()
    [line] = [x for x in done.stderr.splitlines() if "stored pages" in x]
    assert line == (
        "WARNING moe_cluster.kvstore: 2 of 3 stored pages not loaded "
        f"moe_request_id=req-7 trace_id={trace_id} span_id={span_id}"
    )
