"""A real OTLP/gRPC trace receiver for the tests: what an OpenTelemetry Collector's
``otlp`` receiver is to the cluster, keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    service: str  # the resource's service.name
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def error(self) -> bool:
        return self.status_code == 2

    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        spans = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=[
                                (e.name, {a.key: _value(a.value) for a in e.attributes})
                                for e in s.events
                            ],
                            status_code=s.status.code,
                            status_message=s.status.message,
                            service=str(resource.get("service.name", "")),
                            resource=resource,
                        )
                    )
        self._receiver.add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPReceiver:
    def __init__(self, port: int) -> None:
        self.port = port
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _Servicer(self), self._server
        )
        self._server.add_insecure_port(f"127.0.0.1:{port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OTLPReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=1)

    def add(self, spans: list[Span]) -> None:
        with self._lock:
            self._spans += spans

    def spans(self, trace_id: str | None = None) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if trace_id in (None, s.trace_id)]

    def wait_for(
        self, trace_id: str, names: set[str], timeout_s: float = 60.0
    ) -> list[Span]:
        """The trace's spans once every name in ``names`` (a span name, or the
        start of one) has arrived; the spans so far when time runs out."""
        give_up = time.monotonic() + timeout_s
        while True:
            got = self.spans(trace_id)
            if all(any(s.name.startswith(n) for s in got) for n in names):
                return got
            if time.monotonic() > give_up:
                return got
            time.sleep(0.25)


def tree(spans: list[Span]) -> str:
    """The spans as an indented tree (parent before children, by start time)."""
    by_parent: dict[str, list[Span]] = {}
    ids = {s.span_id for s in spans}
    for s in sorted(spans, key=lambda s: s.start_ns):
        by_parent.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    t0 = min((s.start_ns for s in spans), default=0)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in by_parent.get(parent, []):
            ms = (s.end_ns - s.start_ns) / 1e6
            at = (s.start_ns - t0) / 1e6
            flag = " ERROR" if s.error else ""
            lines.append(
                f"{'  ' * depth}{s.name}  [{s.service}] +{at:.1f} ms, {ms:.1f} ms{flag}"
            )
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
