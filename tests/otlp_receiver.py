"""A real OTLP/gRPC trace receiver for the tests: what an OpenTelemetry Collector's
``otlp`` receiver is to the cluster, keeping every span it is sent.

It runs in a child process (``python -m tests.otlp_receiver PORT FILE``), which
appends each span to FILE as a JSON line; ``OTLPReceiver`` starts it and reads the
file. Decoding the cluster's spans thus takes no time from the test process, whose
threads time the requests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
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
    event_ns: list[int] = field(default_factory=list)  # each event's time

    @property
    def error(self) -> bool:
        return self.status_code == 2

    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]

    def event_at(self, name: str) -> int | None:
        """When the first event called ``name`` happened (ns), if it did."""
        for (event, _), ns in zip(self.events, self.event_ns, strict=False):
            if event == name:
                return ns
        return None


def span_of(line: bytes | str) -> Span:
    """One span of the receiver's file (a JSON line)."""
    d = json.loads(line)
    d["events"] = [tuple(e) for e in d["events"]]
    return Span(**d)


def read_spans(path: Path) -> list[Span]:
    """Every span in a receiver's file (``python -m tests.otlp_receiver``'s)."""
    return [span_of(line) for line in path.read_bytes().splitlines() if line]


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out: Any) -> None:
        self._out = out
        self._lock = threading.Lock()

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
                            event_ns=[e.time_unix_nano for e in s.events],
                        )
                    )
        lines = "".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in spans)
        with self._lock:
            self._out.write(lines)
            self._out.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def serve(port: int, path: str) -> None:
    """The child process: receives until killed."""
    with open(path, "a") as out:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _Servicer(out), server
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("ready", flush=True)
        server.wait_for_termination()


class OTLPReceiver:
    def __init__(self, port: int) -> None:
        self.port = port
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self._dir = tempfile.TemporaryDirectory(prefix="otlp-")
        self._path = Path(self._dir.name) / "spans.jsonl"
        self._path.touch()
        self._read = 0  # bytes of the file parsed so far
        self._proc: subprocess.Popen[str] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OTLPReceiver:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.otlp_receiver",
                str(self.port),
                str(self._path),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the OTLP receiver did not start")
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
        self._dir.cleanup()

    def spans(self, trace_id: str | None = None) -> list[Span]:
        with self._lock:
            with self._path.open("rb") as f:
                f.seek(self._read)
                data = f.read()
            end = data.rfind(b"\n") + 1  # whole lines only
            self._read += end
            self._spans += [span_of(line) for line in data[:end].splitlines()]
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


def untraced_env() -> dict[str, str]:
    """This process's environment without the trace export the session turned
    on: for child clusters whose tests are not about traces (they would add their
    export's CPU to timing-sensitive runs on the session's two cores)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OTEL_", "RAY_SERVE_TRACING_"))
    }


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


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
