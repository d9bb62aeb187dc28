"""Past the engines' capacity, requests are refused at once with a retry hint."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx

from deployments.proto import inference_pb2 as pb
from tests.integration.conftest import Served

# 2 replicas x 6 running + 12 queued (normal) = 24 admitted; the rest are refused.
FLOOD = 40


def one(served: Served, i: int) -> tuple[Any, Any, int]:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[7 + i]),
        sampling=pb.SamplingParams(max_tokens=96, temperature=0, ignore_eos=True),
    )
    call = served.client().generate(request, timeout=120)
    try:
        n = sum(len(m.chunk.token_ids) for m in call if m.HasField("chunk"))
        return grpc.StatusCode.OK, None, n
    except grpc.RpcError as e:
        return e.code(), e.details(), 0


def test_a_flood_is_partly_refused_with_a_retry_hint_and_nothing_hangs(
    served: Served,
) -> None:
    with ThreadPoolExecutor(FLOOD) as pool:
        results = list(pool.map(lambda i: one(served, i), range(FLOOD)))
    codes = [code for code, _, _ in results]
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served_ok = [r for r in results if r[0] == grpc.StatusCode.OK]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert refused and served_ok
    for _, details, _ in refused:
        hint = re.search(r"\(retry after ([0-9.]+) s\)$", details)
        assert "normal queue is full" in details and hint, details
        assert 0.5 <= float(hint.group(1)) <= 30
    assert all(n == 96 for _, _, n in served_ok)


def test_http_overload_is_429_with_retry_after(served: Served) -> None:
    body = {
        "model": "tiny-deepseek-v2",
        "prompt": [5, 6],
        "max_tokens": 96,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {served.api_key}"}

    def post(_: int) -> httpx.Response:
        return httpx.post(
            f"{served.http_base}/v1/completions",
            json=body,
            headers=headers,
            timeout=120,
        )

    with ThreadPoolExecutor(FLOOD) as pool:
        responses = list(pool.map(post, range(FLOOD)))
    statuses = {r.status_code for r in responses}
    assert statuses == {200, 429}, statuses
    limited = next(r for r in responses if r.status_code == 429)
    assert 1 <= int(limited.headers["Retry-After"]) <= 30
    assert limited.json()["error"]["type"] == "rate_limit_error"
