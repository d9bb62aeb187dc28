"""Where a QoS class's time to first token goes, request by request, from traces.

    python -m tests.otlp_receiver 4317 /tmp/spans.jsonl &        # the receiver
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 OTEL_TRACES_SAMPLER=always_on \\
        .venv/bin/python -m tests.perf.qos_flood --modes yield --duration 60 ...
    .venv/bin/python -m tests.perf.ttft_tail /tmp/spans.jsonl [--qos realtime]

Reads the spans a run exported (``tests.otlp_receiver``'s JSON lines) and splits
each request's time to first token at the ingress (its span's
``gen_ai.response.time_to_first_chunk``) into hops:

- ``admit``: the router's admission (``router.admit``), its queue wait included;
- ``to_engine``: from the ingress span's start to the engine replica's
  ``engine.generate`` (tokenizing, admission, Serve's handle call);
- ``vllm_in``: from the request reaching vLLM's ``AsyncLLM`` to its engine core
  taking it in (the core reads new requests between steps, so this holds the
  rest of the step under way);
- ``vllm_queue``: in vLLM's waiting queue (``moe_cluster.engine.queued_s``);
- ``vllm_prefill``: from its first scheduling to its first token
  (``moe_cluster.engine.prefill_s``);
- ``vllm_first``: vLLM's own time to first token, from ``AsyncLLM``
  (``moe_cluster.engine.time_to_first_token_s``): the three above;
- ``engine_first``: from ``engine.generate``'s start to its ``first_token`` event;
- ``back``: from the engine replica's first token to the ingress's.

Requests of the class are split into those that overlapped a background request
(under the flood) and those that did not (alone); each gets its percentiles and
its slowest requests, hop by hop, so a tail can be placed.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from deployments.bench.report import latency_stats
from tests.otlp_receiver import Span, read_spans

QOS = "moe_cluster.qos"
TTFC = "gen_ai.response.time_to_first_chunk"
HOPS = (
    "ttfc",
    "admit",
    "to_engine",
    "vllm_in",
    "vllm_queue",
    "vllm_prefill",
    "vllm_first",
    "engine_first",
    "back",
)


@dataclass
class Request:
    trace_id: str
    qos: str
    start_ns: int
    end_ns: int
    hops: dict[str, float]  # ms


def requests(path: Path) -> list[Request]:
    """Every traced request that got a first token, with its hops."""
    traces: dict[str, list[Span]] = {}
    for span in read_spans(path):
        traces.setdefault(span.trace_id, []).append(span)
    out = []
    for trace_id, spans in traces.items():
        # The ingress's request span: the one that records the first chunk (the
        # engine's span carries the class too).
        roots = [s for s in spans if TTFC in s.attributes and QOS in s.attributes]
        if not roots:
            continue
        root = roots[0]
        start = root.start_ns
        hops: dict[str, float] = {"ttfc": 1e3 * root.attributes[TTFC]}
        by_name = {s.name: s for s in spans}
        if (admit := by_name.get("router.admit")) is not None:
            hops["admit"] = (admit.end_ns - admit.start_ns) / 1e6
        engine = by_name.get("engine.generate")
        if engine is not None:
            a = engine.attributes
            hops["to_engine"] = (engine.start_ns - start) / 1e6
            if "moe_cluster.engine.queued_s" in a:
                hops["vllm_queue"] = 1e3 * a["moe_cluster.engine.queued_s"]
            if "moe_cluster.engine.prefill_s" in a:
                hops["vllm_prefill"] = 1e3 * a["moe_cluster.engine.prefill_s"]
            if "moe_cluster.engine.time_to_first_token_s" in a:
                hops["vllm_first"] = 1e3 * a["moe_cluster.engine.time_to_first_token_s"]
                if "vllm_queue" in hops and "vllm_prefill" in hops:
                    hops["vllm_in"] = (
                        hops["vllm_first"] - hops["vllm_queue"] - hops["vllm_prefill"]
                    )
            first = engine.event_at("first_token")
            root_first = root.event_at("first_token")
            if first is not None:
                hops["engine_first"] = (first - engine.start_ns) / 1e6
                if root_first is not None:
                    hops["back"] = (root_first - first) / 1e6
        qos = str(root.attributes[QOS])
        out.append(Request(trace_id, qos, start, root.end_ns, hops))
    return sorted(out, key=lambda r: r.start_ns)


def under_flood(reqs: list[Request], background: list[Request]) -> list[bool]:
    """Whether each request's wait for its first token overlapped a background
    request's life."""
    spans = sorted((b.start_ns, b.end_ns) for b in background)
    flags = []
    for r in reqs:
        first = r.start_ns + int(r.hops["ttfc"] * 1e6)
        flags.append(any(s < first and e > r.start_ns for s, e in spans))
    return flags


def _stats(values_ms: list[float]) -> dict[str, float]:
    """The bench's percentiles (``latency_stats``), and the most."""
    stats = latency_stats([v / 1e3 for v in values_ms])
    return stats | {"max": max(values_ms, default=math.nan)}


def table(reqs: list[Request], title: str, top: int) -> str:
    lines = [f"{title}: {len(reqs)} requests (ms)"]
    head = f"  {'':>14}" + "".join(f"{h:>13}" for h in HOPS)
    lines.append(head)
    stats = {h: _stats([r.hops[h] for r in reqs if h in r.hops]) for h in HOPS}
    for name in ("p50", "p90", "p99", "max"):
        row = [stats[h][name] for h in HOPS]
        lines.append(f"  {name:>14}" + "".join(f"{v:13.1f}" for v in row))
    lines.append(f"  slowest {top} by ttfc:")
    for r in sorted(reqs, key=lambda r: -r.hops["ttfc"])[:top]:
        cells = "".join(
            f"{r.hops[h]:13.1f}" if h in r.hops else f"{'-':>13}" for h in HOPS
        )
        lines.append(f"  {r.trace_id[:14]:>14}" + cells)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spans", type=Path, help="tests.otlp_receiver's JSON lines")
    parser.add_argument("--qos", default="realtime")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    every = requests(args.spans)
    mine = [r for r in every if r.qos == args.qos]
    flags = under_flood(mine, [r for r in every if r.qos == "background"])
    alone = [r for r, f in zip(mine, flags, strict=True) if not f]
    flood = [r for r, f in zip(mine, flags, strict=True) if f]
    print(table(alone, f"{args.qos}, no background in flight", args.top))
    print(table(flood, f"{args.qos}, under background", args.top))


if __name__ == "__main__":
    main()
