"""Tenants are bound to API keys: a request may name only a tenant its key
allows (the tenant salts the KV cache: naming another would reach, or time, its
cached prompts), and one that names none runs as its key's first tenant."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import httpx
import pytest

from deployments.proto import inference_pb2 as pb
from tests.integration.conftest import (
    ACME_TENANTS,
    METERED_TENANT,
    TENANT_KEY,
    Served,
    wait_until,
)


def generate(served: Served, key: str, **kw: Any) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(max_tokens=2, temperature=0),
        **kw,
    )
    return list(served.client(key).generate(request, timeout=60))


def complete(served: Served, key: str, tenant: str) -> httpx.Response:
    """An OpenAI HTTP completion with ``key`` naming ``tenant``."""
    return httpx.post(
        f"{served.http_base}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny-deepseek-v2", "prompt": "hi", "max_tokens": 2}
        | {"tenant": tenant},
        timeout=60,
    )


def test_a_key_may_name_only_its_tenants(served: Served) -> None:
    for tenant in ACME_TENANTS:
        assert generate(served, TENANT_KEY, tenant=tenant)[-1].finished
    with pytest.raises(grpc.RpcError) as e:
        generate(served, TENANT_KEY, tenant="globex")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "tenant 'globex' is not allowed for this API key" in (
        e.value.details() or ""
    )
    r = complete(served, TENANT_KEY, "globex")
    assert r.status_code == 403, r.text
    assert r.json()["error"]["type"] == "permission_error"
    # The key that allows any tenant still does.
    assert generate(served, served.api_key, tenant="globex")[-1].finished


def test_a_request_naming_no_tenant_runs_as_its_keys_first(served: Served) -> None:
    assert generate(served, TENANT_KEY, request_id="tenant-default-1")[-1].finished
    assert served.traces is not None
    traces = served.traces

    def request_span() -> Any:
        return next(
            (
                s
                for s in traces.spans()
                if s.name.startswith("text_completion")
                and s.attributes.get("gen_ai.response.id") == "tenant-default-1"
            ),
            None,
        )

    span = wait_until(request_span, 30, "the request's span")
    assert span.attributes["moe_cluster.tenant"] == ACME_TENANTS[0]


def test_a_key_cannot_abort_another_tenants_request(served: Served) -> None:
    msgs: list[pb.GenerateResponse] = []
    streaming = threading.Event()

    def run() -> None:
        request = pb.GenerateRequest(
            request_id="not-yours-1",
            token_ids=pb.TokenIds(ids=[5, 6, 7]),
            sampling=pb.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
            tenant="globex",
        )
        for msg in served.client().generate(request, timeout=120):
            msgs.append(msg)
            streaming.set()

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    assert streaming.wait(60)
    # In flight, but not the acme key's to find.
    assert served.client(TENANT_KEY).abort("not-yours-1") is False
    reader.join(120)
    assert msgs[-1].finished.finish_reason == "length"  # it ran to the end
    assert msgs[-1].finished.completion_tokens == 200


def test_a_tenant_over_its_rate_limit_is_refused_with_a_retry_hint(
    served: Served,
) -> None:
    """The metered tenant may send 2 at once, then one per 5 s, through every
    ingress replica together (the router keeps the buckets)."""
    for _ in range(2):
        assert generate(served, served.api_key, tenant=METERED_TENANT)[-1].finished
    with pytest.raises(grpc.RpcError) as e:
        generate(served, served.api_key, tenant=METERED_TENANT)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = e.value.details() or ""
    assert "tenant metered is over its limit of 0.2 requests/s" in details
    assert "retry after" in details
    r = complete(served, served.api_key, METERED_TENANT)
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["Retry-After"]) <= 5
    assert "over its limit" in r.json()["error"]["message"]
    # Other tenants are not held back by it.
    assert generate(served, served.api_key, tenant="unmetered")[-1].finished
