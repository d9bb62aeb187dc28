"""Every metric infra/'s dashboard and alert rules query is one a running
cluster exports: this session's (scraped from Ray's endpoint after traffic that
produces each), or, for cross-node fetches, the 2-node run's (tests/kvstore)."""

from __future__ import annotations

import contextlib
from typing import Any

import grpc
import httpx

from deployments.proto import inference_pb2 as pb
from tests.infra import files
from tests.integration.conftest import Served, wait_until
from tests.integration.test_metrics import NOT_ON_CPU_MLA, ON_CPU_MLA, some_traffic
from tests.kvstore.two_nodes import FETCH_METRICS


def exported_names(served: Served) -> set[str]:
    body = httpx.get(served.metrics_url, timeout=10).text
    return {
        line.split("{")[0].split(" ")[0]
        for line in body.splitlines()
        if line and not line.startswith("#")
    }


def base(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_every_queried_metric_is_exported(served: Served, engine_handle: Any) -> None:
    some_traffic(served, engine_handle)
    client = served.client()
    try:  # a shed (RESOURCE_EXHAUSTED), so the shed counter exists
        list(
            client.generate(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[5, 6]),
                    sampling=pb.SamplingParams(max_tokens=2),
                    qos=pb.REALTIME,
                    deadline_ms=1,
                ),
                timeout=30,
            )
        )
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        client.close()
    used = files.queried_metrics()
    elsewhere = {base(m) for m in FETCH_METRICS}  # tests/kvstore/test_two_nodes
    if ON_CPU_MLA:  # not reported by CPU_MLA engines (see test_metrics)
        elsewhere |= NOT_ON_CPU_MLA

    def missing() -> dict[str, set[str]]:
        names = exported_names(served)
        return {
            m: where
            for m, where in used.items()
            if m not in names and base(m) not in elsewhere
        }

    with contextlib.suppress(AssertionError):
        wait_until(lambda: not missing(), timeout=90, what="every queried metric")
    assert missing() == {}
    assert {base(m) for m in used} & elsewhere  # the fetch panels are there too
