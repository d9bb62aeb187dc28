"""``tests.perf.ttft_tail``: a request's time to first token, hop by hop, from the
spans ``tests.otlp_receiver`` writes (its JSON lines, written here by hand)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.perf import ttft_tail

MS = 1_000_000


def _span(
    trace: str,
    span_id: str,
    name: str,
    start_ms: float,
    end_ms: float,
    parent: str = "",
    attributes: dict[str, Any] | None = None,
    events: dict[str, float] | None = None,
) -> dict[str, Any]:
    events = events or {}
    return {
        "name": name,
        "trace_id": trace,
        "span_id": span_id,
        "parent_id": parent,
        "start_ns": int(start_ms * MS),
        "end_ns": int(end_ms * MS),
        "attributes": attributes or {},
        "events": [[e, {}] for e in events],
        "event_ns": [int(t * MS) for t in events.values()],
        "kind": 1,
        "status_code": 0,
        "status_message": "",
        "service": "moe-cluster",
    }


def _request(trace: str, qos: str, at: float, ttfc_ms: float) -> list[dict[str, Any]]:
    """An ingress span, its admission (2 ms) and its engine span (from +10 ms,
    first token 5 ms before the ingress's)."""
    first = at + ttfc_ms
    return [
        _span(
            trace,
            f"{trace}-root",
            "chat tiny",
            at,
            at + ttfc_ms + 50,
            parent="serve",  # under Serve's span for the handle call
            attributes={ttft_tail.QOS: qos, ttft_tail.TTFC: ttfc_ms / 1e3},
            events={"first_token": first},
        ),
        _span(trace, f"{trace}-admit", "router.admit", at + 1, at + 3, f"{trace}-root"),
        _span(
            trace,
            f"{trace}-engine",
            "engine.generate",
            at + 10,
            at + ttfc_ms + 50,
            f"{trace}-root",
            attributes={
                "moe_cluster.engine.queued_s": 0.004,
                "moe_cluster.engine.prefill_s": 0.2,
                "moe_cluster.engine.time_to_first_token_s": (ttfc_ms - 20) / 1e3,
            },
            events={"first_token": first - 5},
        ),
    ]


def test_hops_and_the_split_by_background(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spans = [
        *_request("rt-alone", "realtime", at=0, ttfc_ms=40),
        *_request("bg", "background", at=1000, ttfc_ms=100),  # in flight 1000-1150
        *_request("rt-flood", "realtime", at=1100, ttfc_ms=300),
        *_request("rt-after", "realtime", at=2000, ttfc_ms=50),
    ]
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in spans))
    reqs = ttft_tail.requests(path)
    assert [r.trace_id for r in reqs] == ["rt-alone", "bg", "rt-flood", "rt-after"]
    flood = reqs[2]
    assert flood.hops == pytest.approx(
        {
            "ttfc": 300,
            "admit": 2,
            "to_engine": 10,
            "vllm_in": 76,
            "vllm_queue": 4,
            "vllm_prefill": 200,
            "vllm_first": 280,
            "engine_first": 285,
            "back": 5,
        }
    )
    realtime = [r for r in reqs if r.qos == "realtime"]
    background = [r for r in reqs if r.qos == "background"]
    assert ttft_tail.under_flood(realtime, background) == [False, True, False]

    monkeypatch.setattr(sys, "argv", ["ttft_tail", str(path)])
    ttft_tail.main()
    out = capsys.readouterr().out
    assert "realtime, no background in flight: 2 requests" in out
    assert "realtime, under background: 1 requests" in out
    assert "rt-flood" in out.split("under background")[1]
