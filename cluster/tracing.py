"""OpenTelemetry tracing, switched on the standard way.

``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) turns
export on; the other standard variables choose the protocol
(``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``: grpc or http/protobuf), headers
(``OTEL_EXPORTER_OTLP[_TRACES]_HEADERS``, read by the exporter), the service
name (``OTEL_SERVICE_NAME``) and the sampler (``OTEL_TRACES_SAMPLER[_ARG]``). The
``tracing`` config section may set the ratio and the service name instead.

Three kinds of process export spans:

- Serve's proxies and replicas: Ray Serve sets their tracer provider from
  ``RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH`` (``span_processors`` here) and
  ``RAY_SERVE_TRACING_SAMPLING_RATIO``; ``serve_env`` gives the driver the values to
  set before ``ray.init``, so every Ray worker inherits them.
- moe-cluster's own actors (router, page stores): ``install`` gives them the same
  provider.
- vLLM's engine-core process: vLLM sets its own provider from the endpoint that
  ``traces_endpoint`` gives its ``otlp_traces_endpoint``.

Context crosses Ray calls and the engine as W3C ``traceparent`` carriers
(``carrier`` / ``context_of``), never through Ray's own tracing hooks. With no
endpoint nothing is installed: spans are the API's no-op spans.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger("moe_cluster.tracing")

TRACER_NAME = "moe_cluster"
SPAN_PROCESSORS = "cluster.tracing:span_processors"
DEFAULT_SERVICE = "moe-cluster"
# Set by ``serve_env`` from the config section; read back by every process.
RATIO_VAR = "RAY_SERVE_TRACING_SAMPLING_RATIO"
SERVE_EXPORTER_VAR = "RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH"

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True, slots=True)
class TraceSettings:
    endpoint: str  # where traces go: the full URL (http) or host:port URL (grpc)
    protocol: str  # "grpc" | "http/protobuf"
    sampling_ratio: float  # of traces started here; a client's parent decides its own
    service_name: str


def _protocol(env: Mapping[str, str]) -> str:
    protocol = env.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    )
    protocol = protocol.strip() or "grpc"
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: moe-cluster exports traces "
            "over grpc or http/protobuf"
        )
    return protocol


def _sampler_ratio(env: Mapping[str, str]) -> float:
    """The ratio OTEL_TRACES_SAMPLER[_ARG] asks for (OTel's default: always on)."""
    sampler = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if sampler in ("always_on", "parentbased_always_on"):
        return 1.0
    if sampler in ("always_off", "parentbased_always_off"):
        return 0.0
    if sampler in ("traceidratio", "parentbased_traceidratio"):
        arg = env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            ratio = float(arg)
        except ValueError:
            raise ValueError(
                f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a number"
            ) from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not in [0, 1]")
        return ratio
    raise ValueError(
        f"OTEL_TRACES_SAMPLER={sampler!r}: moe-cluster samples with "
        "(parentbased_)always_on, always_off or traceidratio"
    )


def settings(
    env: Mapping[str, str] | None = None,
    sampling_ratio: float | None = None,
    service_name: str | None = None,
) -> TraceSettings | None:
    """The trace export this process is configured for, or None when no OTLP
    endpoint is set (or ``OTEL_SDK_DISABLED`` / ``OTEL_TRACES_EXPORTER=none``).
    ``sampling_ratio`` and ``service_name`` (the config section) win over the
    environment. Raises ValueError on a malformed variable."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    protocol = _protocol(env)
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if not endpoint:
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        if not base:
            return None
        # The standard: a base URL, to which http/protobuf appends the signal path.
        endpoint = base.rstrip("/") + "/v1/traces" if protocol != "grpc" else base
    if sampling_ratio is None:
        # A ratio set by serve_env (the config section, in the driver) reaches the
        # workers through the Ray Serve variable.
        inherited = env.get(RATIO_VAR)
        sampling_ratio = float(inherited) if inherited else _sampler_ratio(env)
    return TraceSettings(
        endpoint=endpoint,
        protocol=protocol,
        sampling_ratio=sampling_ratio,
        service_name=service_name or env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE,
    )


def serve_env(s: TraceSettings | None) -> dict[str, str]:
    """Environment to set before ``ray.init`` so that Serve's proxies and replicas
    (and every other Ray worker) export to ``s``: empty when tracing is off."""
    if s is None:
        return {}
    return {
        SERVE_EXPORTER_VAR: SPAN_PROCESSORS,
        RATIO_VAR: repr(s.sampling_ratio),
        "OTEL_SERVICE_NAME": s.service_name,
    }


def apply_serve_env(s: TraceSettings | None) -> None:
    os.environ.update(serve_env(s))


def _exporter(s: TraceSettings) -> Any:
    if s.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        insecure = not s.endpoint.startswith("https://")
        return GrpcExporter(endpoint=s.endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=s.endpoint)


def span_processors() -> list[Any]:
    """Ray Serve's exporter hook (``RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH``): one
    batching OTLP processor for the configured endpoint."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    s = settings()
    if s is None:
        return []
    _ignore_undecodable_traceparent()
    return [BatchSpanProcessor(_exporter(s))]


def _ignore_undecodable_traceparent() -> None:
    """NOTE: Ray Serve 2.60's HTTP proxy decodes a request's ``traceparent``
    header as UTF-8 (``ASGIProxyRequest.populate_tracing_context`` in
    ``ray/serve/_private/proxy_request_response.py``) and, for bytes that are
    not, fails the request with a plain-text 500. A traceparent that does not
    parse is to be ignored (W3C Trace Context, 3.2.2.1): this hook, which runs in
    the proxy when it sets up tracing, makes it so. The request is then traced
    as one without a parent."""
    try:
        from ray.serve._private import proxy_request_response as prr
    except ImportError:
        return
    cls = prr.ASGIProxyRequest
    original: Any = cls.populate_tracing_context
    if getattr(original, "_moe_cluster", False):
        return

    def populate_tracing_context(self: Any) -> None:
        with contextlib.suppress(UnicodeDecodeError):
            original(self)

    populate_tracing_context._moe_cluster = True  # type: ignore[attr-defined]
    cls.populate_tracing_context = populate_tracing_context  # type: ignore[method-assign]


_installed = False


def install(component: str) -> bool:
    """Gives this process (an actor Ray Serve does not set up) the exporting
    tracer provider, if tracing is configured and no provider is set yet.
    Returns whether spans from this process are exported."""
    global _installed
    if _installed:
        return True
    s = settings()
    if s is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    provider = TracerProvider(
        sampler=ParentBasedTraceIdRatio(s.sampling_ratio),
        resource=Resource.create(
            {"service.name": s.service_name, "moe_cluster.component": component}
        ),
    )
    for processor in span_processors():
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _installed = True
    return True


def flush(timeout_s: float = 5.0) -> None:
    """Exports the spans this process has buffered."""
    provider = trace.get_tracer_provider()
    force = getattr(provider, "force_flush", None)
    if force is not None:
        force(int(timeout_s * 1000))


def traces_endpoint() -> str | None:
    """vLLM's ``otlp_traces_endpoint``: the configured endpoint, or None."""
    s = settings()
    return None if s is None else s.endpoint


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def carrier(span: Span | None = None) -> dict[str, str]:
    """The W3C trace context of ``span`` (default: the current one), to send along
    with a call; empty when nothing is recorded."""
    current = span if span is not None else trace.get_current_span()
    if not current.get_span_context().is_valid:
        return {}
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers, trace.set_span_in_context(current))
    return headers


def context_of(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The parent context a carrier (or a client's headers) names, if any."""
    if not headers:
        return None
    traceparent = headers.get("traceparent")
    if not traceparent:
        return None
    carrier_ = {"traceparent": traceparent}
    if state := headers.get("tracestate"):
        carrier_["tracestate"] = state
    ctx = _PROPAGATOR.extract(carrier_)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def fail(span: Span, exc: BaseException, error_type: str | None = None) -> None:
    """Marks ``span`` failed by ``exc`` (GenAI's ``error.type``: the class name
    unless given)."""
    span.set_status(Status(StatusCode.ERROR, str(exc)))
    span.set_attribute("error.type", error_type or type(exc).__name__)


def ids(span: Span | None = None) -> tuple[str, str]:
    """(trace id, span id) as hex, of ``span`` or the current span; empty strings
    when there is none."""
    ctx = (span if span is not None else trace.get_current_span()).get_span_context()
    if not ctx.is_valid:
        return "", ""
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


class Attr:
    """Span attribute names: the OpenTelemetry GenAI conventions, and the
    cluster's own under ``moe_cluster.``."""

    OPERATION = "gen_ai.operation.name"
    PROVIDER = "gen_ai.provider.name"
    REQUEST_MODEL = "gen_ai.request.model"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TEMPERATURE = "gen_ai.request.temperature"
    TOP_P = "gen_ai.request.top_p"
    TOP_K = "gen_ai.request.top_k"
    SEED = "gen_ai.request.seed"
    STREAM = "gen_ai.request.stream"
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    RESPONSE_ID = "gen_ai.response.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    TTFC = "gen_ai.response.time_to_first_chunk"
    ERROR_TYPE = "error.type"

    QOS = "moe_cluster.qos"
    TENANT = "moe_cluster.tenant"
    PROTOCOL = "moe_cluster.protocol"
    AUTH = "moe_cluster.auth"
    PROMPT_TOKENS = "moe_cluster.prompt_tokens"
    REPLICA = "moe_cluster.replica"
    NODE = "moe_cluster.node"
    EP_GROUP = "moe_cluster.ep.group"
    EP_RANK = "moe_cluster.ep.rank"
    EP_SIZE = "moe_cluster.ep.size"
    CACHED_TOKENS = "moe_cluster.cached_tokens"
    MIGRATIONS = "moe_cluster.migrations"
    CACHED_BLOCKS = "moe_cluster.router.cached_blocks"
    POLICY = "moe_cluster.router.policy"
    REASON = "moe_cluster.router.reason"
    QUEUE_WAIT = "moe_cluster.router.queue_wait_s"
    SHED_REASON = "moe_cluster.router.shed_reason"
    PREDICTED_EXPERTS = "moe_cluster.router.predicted_experts"
    ENGINE_QUEUED = "moe_cluster.engine.queued_s"
    ENGINE_PREFILL = "moe_cluster.engine.prefill_s"
    ENGINE_DECODE = "moe_cluster.engine.decode_s"
    ENGINE_TTFT = "moe_cluster.engine.time_to_first_token_s"
    KV_PAGES_ASKED = "moe_cluster.kv.pages_asked"
    KV_PAGES_HELD = "moe_cluster.kv.pages_in_engine"
    KV_PAGES_FOUND = "moe_cluster.kv.pages_found"
    KV_UNASKED = "moe_cluster.kv.unasked"  # the presence filter answered: no call
    KV_PAGES_LOADED = "moe_cluster.kv.pages_loaded"
    KV_BYTES_LOADED = "moe_cluster.kv.bytes_loaded"
    KV_CHECKSUM_FAILURES = "moe_cluster.kv.checksum_failures"
    KV_FETCH_WAIT = "moe_cluster.kv.fetch_wait_s"
    KV_FETCH_PAGES = "moe_cluster.kv.fetch.pages"
    KV_FETCH_BYTES = "moe_cluster.kv.fetch.bytes"
    KV_FETCH_SECONDS = "moe_cluster.kv.fetch.seconds"
    KV_FETCH_NODE = "moe_cluster.kv.fetch.from_node"


# -- logs that carry the trace ------------------------------------------------

REQUEST_ID: ContextVar[str] = ContextVar("moe_cluster_request_id", default="")
LOG_KEYS = ("moe_request_id", "trace_id", "span_id")
_log_context_installed = False


def install_log_context() -> None:
    """Adds ``moe_request_id``, ``trace_id`` and ``span_id`` to every record of the
    ``moe_cluster`` loggers in this process: Ray's JSON log encoding writes them
    as fields, its text encoding as ``key=value`` after the message, so a log line
    and its trace join on the trace id."""
    global _log_context_installed
    if _log_context_installed:
        return
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if record.name.startswith("moe_cluster"):
            rid = REQUEST_ID.get()
            trace_id, span_id = ids()
            if rid:
                record.moe_request_id = rid
            if trace_id:
                record.trace_id, record.span_id = trace_id, span_id
        return record

    logging.setLogRecordFactory(factory)
    _log_context_installed = True


class ContextFormatter(logging.Formatter):
    """``LEVEL logger: message`` and the record's request and trace ids as
    ``key=value`` (the text shape Ray writes), for processes that Ray's logging
    does not configure."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{k}={v}" for k in LOG_KEYS if (v := getattr(record, k, None))]
        return " ".join([line, *ids])


def install_process_logging() -> None:
    """For vLLM's engine-core and worker processes, which the page store's
    connector runs in: the ``moe_cluster`` loggers' records carry the request's
    ids (``install_log_context``) and go to stderr (the replica's log) with them.
    Idempotent; in a Ray worker (Ray's logging handles it) only the context."""
    install_log_context()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return
    root = logging.getLogger("moe_cluster")
    if any(isinstance(h.formatter, ContextFormatter) for h in root.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(ContextFormatter())
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False
