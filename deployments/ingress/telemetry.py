"""One request's trace span and server metrics, as the ingress sees them.

The span (``{operation} {model}``, OpenTelemetry GenAI attributes plus the
cluster's own under ``moe_cluster.``) is a child of Serve's replica span, itself
a child of the proxy's and so of the client's ``traceparent``. It opens before
authentication and ends when the stream does; the router's admission span (through
the ticket's carrier) and the engine's (through Serve's handle call) are its
children. At its end the GenAI server histograms are recorded on Ray's metrics
endpoint (``ray_gen_ai_server_*``), and one access log line is written that
carries the request, trace and span ids.

In an ingress replica the access lines, this one and Serve's own (``POST
/v1/completions 200 303.9ms``), go to the replica's Serve log file only
(``access_lines_to_file``), as Serve keeps its proxy's. On stderr, Ray's log
monitor would ship every one of them through the GCS to the driver's console.
On 2 cores that cost about 2.5 ms of CPU per one-stream request, in the log
monitor, the GCS and the driver (``tests/perf/s1_profile.py``). Warnings and
errors still reach the console.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from cluster import tracing
from deployments.protocol import EngineRequest, Finish

access_logger = logging.getLogger("moe_cluster.access")  # one line a request
A = tracing.Attr
PROVIDER = "moe-cluster"

# The GenAI semantic conventions' bucket boundaries, in seconds.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75]
TTFT_BUCKETS += [1, 2.5, 5, 7.5, 10]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75]
TPOT_BUCKETS += [1.0, 2.5]
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12]
DURATION_BUCKETS += [10.24, 20.48, 40.96, 81.92]


class _Metrics:
    def __init__(self) -> None:
        from ray.util import metrics

        keys = ("gen_ai_operation_name", "gen_ai_request_model")
        self.ttft = metrics.Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "GenAI server: time to generate the first token (ingress to first chunk).",
            boundaries=TTFT_BUCKETS,
            tag_keys=keys,
        )
        self.tpot = metrics.Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "GenAI server: time per output token after the first.",
            boundaries=TPOT_BUCKETS,
            tag_keys=keys,
        )
        self.duration = metrics.Histogram(
            "gen_ai_server_request_duration_seconds",
            "GenAI server: request duration, errors included (error_type).",
            boundaries=DURATION_BUCKETS,
            tag_keys=(*keys, "error_type"),
        )
        self.class_ttft = metrics.Histogram(
            "moe_cluster_ttft_seconds",
            "Time to first token per QoS class, as clients see it from the ingress.",
            boundaries=TTFT_BUCKETS,
            tag_keys=("qos",),
        )
        self.requests = metrics.Counter(
            "moe_cluster_requests",
            "Requests the ingress answered, by class and outcome.",
            tag_keys=("qos", "outcome"),
        )


_metrics: _Metrics | None = None


def _to_a_file(handler: logging.Handler) -> bool:
    """A handler that writes to a file (Serve's buffers its file's records)."""
    if isinstance(handler, logging.handlers.MemoryHandler):
        return isinstance(handler.target, logging.FileHandler)
    return isinstance(handler, logging.FileHandler)


def _serve_files() -> list[logging.Handler]:
    return [h for h in logging.getLogger("ray.serve").handlers if _to_a_file(h)]


class _AccessLinesOffStderr(logging.Filter):
    """On Serve's logger: marks its access lines as Serve marks its proxy's,
    ``log_to_stderr`` False, which its stderr handler drops and its file
    handler keeps. A logger's filter outlives the handlers Serve replaces when
    it reconfigures a replica's logging."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "serve_access_log", False):
            record.log_to_stderr = False
        return True


class _ToServesFile(logging.Handler):
    """Hands each record to the file handlers Serve's logger has at the time."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in _serve_files():
            handler.handle(record)


_OFF_STDERR = _AccessLinesOffStderr()
_TO_SERVES_FILE = _ToServesFile()


def access_lines_to_file() -> bool:
    """In a Serve replica: Serve's access lines and ``access_logger``'s go to the
    replica's log file only, not to stderr. Returns whether Serve's logger has
    a file to send them to (outside a replica it has none, and nothing
    changes)."""
    if not _serve_files():
        return False
    serve_logger = logging.getLogger("ray.serve")
    if _OFF_STDERR not in serve_logger.filters:
        serve_logger.addFilter(_OFF_STDERR)
    if _TO_SERVES_FILE not in access_logger.handlers:
        access_logger.addHandler(_TO_SERVES_FILE)
    access_logger.propagate = False
    return True


def _server_metrics() -> _Metrics:
    global _metrics
    if _metrics is None:
        _metrics = _Metrics()
    return _metrics


class RequestTelemetry:
    """Span, timings and outcome of one request; ``end`` may be called more than
    once (the first call counts)."""

    def __init__(
        self, operation: str, model: str, protocol: str, record_metrics: bool = True
    ) -> None:
        self.operation, self.model = operation, model
        self.span = tracing.tracer().start_span(
            f"{operation} {model}",
            kind=SpanKind.SERVER,
            attributes={
                A.OPERATION: operation,
                A.PROVIDER: PROVIDER,
                A.REQUEST_MODEL: model,
                A.PROTOCOL: protocol,
            },
        )
        self.context = trace.set_span_in_context(self.span)
        self._started = time.perf_counter()
        self._first: float | None = None
        self._finish: Finish | None = None
        self._error: str | None = None
        self._request: EngineRequest | None = None
        self._ended = False
        self._record_metrics = record_metrics

    # -- spans under this one ------------------------------------------------

    @contextlib.contextmanager
    def child(self, name: str, **attributes: Any) -> Iterator[trace.Span]:
        """A child span, current while the block runs (a raise marks it failed)."""
        with tracing.tracer().start_as_current_span(
            name, context=self.context, attributes=attributes
        ) as span:
            yield span

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Makes the request span current (e.g. while Serve routes a handle call)."""
        token = otel_context.attach(self.context)
        try:
            yield
        finally:
            otel_context.detach(token)

    def carrier(self) -> dict[str, str]:
        return tracing.carrier(self.span)

    # -- what happened -------------------------------------------------------

    def request(self, req: EngineRequest, stream: bool) -> None:
        self._request = req
        tracing.REQUEST_ID.set(req.request_id)
        s = req.sampling
        attributes: dict[str, Any] = {
            A.RESPONSE_ID: req.request_id,
            A.MAX_TOKENS: s.max_tokens,
            A.TEMPERATURE: s.temperature,
            A.TOP_P: s.top_p,
            A.STREAM: stream,
            A.QOS: req.qos.name.lower(),
            A.TENANT: req.tenant,
            A.PROMPT_TOKENS: len(req.prompt_token_ids),
        }
        if s.top_k > 0:
            attributes[A.TOP_K] = s.top_k
        if s.seed is not None:
            attributes[A.SEED] = s.seed
        self.span.set_attributes(attributes)

    def response_id(self, response_id: str) -> None:
        """The id the client sees (OpenAI's ``cmpl-``/``chatcmpl-`` + request id)."""
        self.span.set_attribute(A.RESPONSE_ID, response_id)

    def started(self, replica_id: str) -> None:
        self.span.set_attribute(A.REPLICA, replica_id)

    def first_token(self) -> None:
        if self._first is None:
            self._first = time.perf_counter()
            self.span.add_event("first_token")

    def finished(self, finish: Finish) -> None:
        self._finish = finish
        self.span.set_attributes(
            {
                A.FINISH_REASONS: [finish.reason],
                A.INPUT_TOKENS: finish.prompt_tokens,
                A.OUTPUT_TOKENS: finish.completion_tokens,
                A.CACHE_READ_TOKENS: finish.cached_tokens,
                A.CACHED_TOKENS: finish.cached_tokens,
                A.RESPONSE_MODEL: self.model,
                A.REPLICA: finish.replica_id,
                A.MIGRATIONS: finish.migrations,
            }
        )

    def migrated(self, replica_id: str, tokens_sent: int, exc: BaseException) -> None:
        """The stream's engine failed after ``tokens_sent`` tokens; it goes on
        on another replica."""
        self.span.add_event(
            "migration",
            {
                A.REPLICA: replica_id,
                "moe_cluster.migration.tokens_sent": tokens_sent,
                A.ERROR_TYPE: type(exc).__name__,
            },
        )

    def failed(self, exc: BaseException, error_type: str | None = None) -> None:
        if self._error is not None:
            return
        self._error = error_type or type(exc).__name__
        tracing.fail(self.span, exc, self._error)

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        now = time.perf_counter()
        if self._first is not None:
            self.span.set_attribute(A.TTFC, self._first - self._started)
        self.span.end()
        self._log(now)
        if self._record_metrics:
            self._record(now)

    def _log(self, now: float) -> None:
        if not access_logger.isEnabledFor(logging.INFO):
            return
        rid = self._request.request_id if self._request else "-"
        f = self._finish
        # The ids are in the line itself: Serve's text format (the replica's log
        # file) writes no record fields. The JSON encodings write them as
        # fields as well (``tracing.install_log_context``).
        trace_id, span_id = tracing.ids(self.span)
        ids = f" trace_id={trace_id} span_id={span_id}" if trace_id else ""
        token = otel_context.attach(self.context)
        try:
            if f is not None:
                access_logger.info(
                    "request %s %s: %s, %d+%d tokens (%d cached) on %s in %.3f s%s",
                    rid,
                    self.operation,
                    f.reason,
                    f.prompt_tokens,
                    f.completion_tokens,
                    f.cached_tokens,
                    f.replica_id or "-",
                    now - self._started,
                    ids,
                )
            else:
                access_logger.info(
                    "request %s %s failed (%s) in %.3f s%s",
                    rid,
                    self.operation,
                    self._error or "cancelled",
                    now - self._started,
                    ids,
                )
        finally:
            otel_context.detach(token)

    def _record(self, now: float) -> None:
        m = _server_metrics()
        tags = {
            "gen_ai_operation_name": self.operation,
            "gen_ai_request_model": self.model,
        }
        m.duration.observe(
            now - self._started, tags | {"error_type": self._error or ""}
        )
        qos = self._request.qos.name.lower() if self._request else "unknown"
        outcome = "ok" if self._finish is not None else (self._error or "cancelled")
        m.requests.inc(tags={"qos": qos, "outcome": outcome})
        if self._first is None:
            return
        ttft = self._first - self._started
        m.ttft.observe(ttft, tags)
        m.class_ttft.observe(ttft, {"qos": qos})
        out = self._finish.completion_tokens if self._finish else 0
        if out > 1:
            m.tpot.observe((now - self._first) / (out - 1), tags)
