"""Every bad input gets a clear status naming the field, and serving goes on."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest

from deployments.proto import inference_pb2 as pb
from tests.integration.conftest import ENGINE, Served

CONTEXT = ENGINE["max_model_len"]

MODEL = "tiny-deepseek-v2"
IDS = pb.TokenIds(ids=[410, 465, 14])


def gen(**kw: Any) -> pb.GenerateRequest:
    if "text" not in kw:
        kw.setdefault("token_ids", IDS)
    return pb.GenerateRequest(**kw)


def sp(**kw: Any) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


INVALID = grpc.StatusCode.INVALID_ARGUMENT
# (case, request, expected code, text the details must contain)
GRPC_CASES = [
    ("no input", pb.GenerateRequest(), INVALID, "input"),
    ("empty text", gen(text=""), INVALID, "text: must not be empty"),
    (
        "empty token ids",
        gen(token_ids=pb.TokenIds()),
        INVALID,
        "token_ids.ids: must not be empty",
    ),
    (
        "token id beyond vocab",
        gen(token_ids=pb.TokenIds(ids=[5, 4096])),
        INVALID,
        "token_ids.ids[1]",
    ),
    (
        "negative token id",
        gen(token_ids=pb.TokenIds(ids=[-1])),
        INVALID,
        "token_ids.ids[0]",
    ),
    (
        "prompt longer than context",
        gen(token_ids=pb.TokenIds(ids=[7] * (CONTEXT + 88))),
        INVALID,
        f"context is {CONTEXT}",
    ),
    ("text over the byte limit", gen(text="x" * 5000), INVALID, "text"),
    ("max_tokens zero", gen(sampling=sp(max_tokens=0)), INVALID, "sampling.max_tokens"),
    (
        "max_tokens negative",
        gen(sampling=sp(max_tokens=-3)),
        INVALID,
        "sampling.max_tokens",
    ),
    (
        "max_tokens beyond context",
        gen(sampling=sp(max_tokens=CONTEXT + 88)),
        INVALID,
        "sampling.max_tokens",
    ),
    (
        "negative temperature",
        gen(sampling=sp(temperature=-0.5)),
        INVALID,
        "sampling.temperature",
    ),
    (
        "nan temperature",
        gen(sampling=sp(temperature=float("nan"))),
        INVALID,
        "sampling.temperature",
    ),
    (
        "temperature above vLLM's 2",
        gen(sampling=sp(temperature=2.5)),
        INVALID,
        "sampling.temperature: must be in [0, 2]",
    ),
    ("top_p zero", gen(sampling=sp(top_p=0.0)), INVALID, "sampling.top_p"),
    ("top_p above one", gen(sampling=sp(top_p=1.5)), INVALID, "sampling.top_p"),
    ("top_k negative", gen(sampling=sp(top_k=-5)), INVALID, "sampling.top_k"),
    ("empty stop string", gen(sampling=sp(stop=[""])), INVALID, "sampling.stop[0]"),
    (
        "stop token beyond vocab",
        gen(sampling=sp(stop_token_ids=[99999])),
        INVALID,
        "sampling.stop_token_ids[0]",
    ),
    ("bad request id", gen(request_id="has space"), INVALID, "request_id"),
    ("bad tenant", gen(tenant="a/b"), INVALID, "tenant"),
    ("unknown qos", gen(qos=9), INVALID, "qos"),
]


@pytest.mark.parametrize(
    ("request_msg", "code", "needle"),
    [c[1:] for c in GRPC_CASES],
    ids=[c[0] for c in GRPC_CASES],
)
def test_grpc_bad_input(
    served: Served, request_msg: Any, code: Any, needle: str
) -> None:
    client = served.client()
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(request_msg, timeout=30))
    assert e.value.code() == code, e.value.details()
    details = e.value.details() or ""
    assert needle in details
    assert "Traceback" not in details


def _raw_generate(served: Served, payload: bytes, api_key: str | None) -> grpc.RpcError:
    channel = grpc.insecure_channel(served.grpc_target)
    call = channel.unary_stream(
        "/moecluster.v1.Inference/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    md = [("authorization", f"Bearer {api_key}")] if api_key else []
    with pytest.raises(grpc.RpcError) as e:
        list(call(payload, metadata=md, timeout=30))
    return e.value


@pytest.mark.parametrize(
    ("field", "good", "bad"),
    [("text", b"hello", b"hel\xffo"), ("tenant", b"acme", b"ac\xc3e")],
)
def test_grpc_invalid_utf8_names_the_field(
    served: Served, field: str, good: bytes, bad: bytes
) -> None:
    valid = pb.GenerateRequest(text="hello", tenant="acme").SerializeToString()
    err = _raw_generate(served, valid.replace(good, bad), served.api_key)
    assert err.code() == INVALID
    assert f"field {field} is not valid UTF-8" in (err.details() or "")


def test_grpc_garbage_bytes(served: Served) -> None:
    err = _raw_generate(served, b"\xff\xff\xff\xff", served.api_key)
    assert err.code() == INVALID
    assert "not a valid moecluster.v1.GenerateRequest" in (err.details() or "")


def test_grpc_oversized_message_is_refused(served: Served) -> None:
    # Beyond the proxy's gRPC message limit the transport refuses it itself.
    req = gen(text="y" * (8 << 20))
    with pytest.raises(grpc.RpcError) as e:
        list(served.client().generate(req, timeout=60))
    assert e.value.code() in (INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.mark.parametrize("key", ["", "wrong-key"])
def test_grpc_wrong_api_key(served: Served, key: str) -> None:
    client = served.client(api_key=key)
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(gen(sampling=sp(max_tokens=2)), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        client.model_info()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
}
# (case, path, body, expected status, expected error.param)
HTTP_CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("unknown model", "completions", COMPLETION | {"model": "gpt-9"}, 400, "model"),
    ("empty prompt", "completions", COMPLETION | {"prompt": ""}, 400, "prompt"),
    ("missing prompt", "completions", {"model": MODEL}, 400, "prompt"),
    (
        "token beyond vocab",
        "completions",
        COMPLETION | {"prompt": [1, 5000]},
        400,
        "prompt[1]",
    ),
    (
        "several prompts",
        "completions",
        COMPLETION | {"prompt": ["a", "b"]},
        400,
        "prompt",
    ),
    (
        "prompt longer than context",
        "completions",
        COMPLETION | {"prompt": [7] * (CONTEXT + 88)},
        400,
        "prompt",
    ),
    (
        "max_tokens zero",
        "completions",
        COMPLETION | {"max_tokens": 0},
        400,
        "max_tokens",
    ),
    (
        "max_tokens beyond context",
        "completions",
        COMPLETION | {"max_tokens": 9999},
        400,
        "max_tokens",
    ),
    (
        "negative temperature",
        "completions",
        COMPLETION | {"temperature": -1},
        400,
        "temperature",
    ),
    (
        "temperature above vLLM's 2",
        "chat/completions",
        CHAT | {"temperature": 2.5},
        400,
        "temperature",
    ),
    ("top_p zero", "completions", COMPLETION | {"top_p": 0}, 400, "top_p"),
    ("top_p above one", "completions", COMPLETION | {"top_p": 1.01}, 400, "top_p"),
    ("n above one", "completions", COMPLETION | {"n": 2}, 400, "n"),
    (
        "wrong type",
        "completions",
        COMPLETION | {"max_tokens": "many"},
        400,
        "max_tokens",
    ),
    ("bad qos", "completions", COMPLETION | {"qos": "urgent"}, 400, "qos"),
    (
        "prompt over byte limit",
        "completions",
        COMPLETION | {"prompt": "z" * 5000},
        400,
        "prompt",
    ),
    ("no messages", "chat/completions", CHAT | {"messages": []}, 400, "messages"),
    (
        "bad role",
        "chat/completions",
        CHAT | {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    ("lone surrogate", "chat/completions", None, 400, "messages[0].content"),
    (
        "lone surrogate in stop",
        "completions",
        json.dumps(COMPLETION)[:-1].encode() + b', "stop": ["a\\udc00"]}',
        400,
        "stop[0]",
    ),
    (
        "nested too deeply",
        "completions",
        b"[" * 1000 + b"]" * 1000,
        400,
        "body",
    ),
    (
        "nested too deeply in a field",
        "completions",
        json.dumps(COMPLETION)[:-1].encode()
        + b', "tenant": '
        + b"[" * 990
        + b"]" * 990
        + b"}",
        400,
        "body",
    ),
    (
        "a field this server does not know",
        "chat/completions",
        CHAT | {"functions": [{"name": "f"}]},
        400,
        "functions",
    ),
    (
        "response_format of an unknown type",
        "chat/completions",
        CHAT | {"response_format": {"type": "xml"}},
        400,
        "response_format.type",
    ),
    (
        "invalid UTF-8 body",
        "completions",
        b'{"model": "m", "prompt": "\xff"}',
        400,
        "body",
    ),
    ("not JSON", "completions", b"{nope", 400, "body"),
    ("JSON array", "completions", b"[1, 2]", 400, "body"),
    (
        "oversized body",
        "completions",
        COMPLETION | {"prompt": "q" * 200_000},
        400,
        "body",
    ),
]
SURROGATE = (
    b'{"model": "tiny-deepseek-v2", "max_tokens": 2, '
    b'"messages": [{"role": "user", "content": "a\\ud800b"}]}'
)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [c[1:] for c in HTTP_CASES],
    ids=[c[0] for c in HTTP_CASES],
)
def test_http_bad_input(
    served: Served, path: str, body: Any, status: int, param: str | None
) -> None:
    if body is None:
        body = SURROGATE
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{served.http_base}/v1/{path}",
        content=content,
        headers={
            "Authorization": f"Bearer {served.api_key}",
            "Content-Type": "application/json",
        },
        timeout=30,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert err["message"] and "Traceback" not in err["message"]


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_http_wrong_api_key(served: Served, key: str | None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(
        f"{served.http_base}/v1/completions",
        json=COMPLETION,
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(f"{served.http_base}/v1/models", headers=headers, timeout=30)
    assert r.status_code == 401


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)],
)
def test_http_routing_errors_have_the_openai_shape(
    served: Served, method: str, path: str, status: int
) -> None:
    r = httpx.request(method, f"{served.http_base}{path}", timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == status
    assert err["message"]


def test_a_traceparent_that_is_not_utf8_is_ignored(served: Served) -> None:
    """Ray's proxy failed such a request with a plain-text 500; an unparsable
    traceparent is to be ignored (W3C Trace Context)."""
    import socket
    from urllib.parse import urlsplit

    body = json.dumps(COMPLETION).encode()
    request = b"\r\n".join(
        [
            b"POST /v1/completions HTTP/1.1",
            b"Host: x",
            b"Connection: close",
            b"Content-Type: application/json",
            f"Authorization: Bearer {served.api_key}".encode(),
            b"traceparent: 00-\xff\xfe\xfd-01",
            f"Content-Length: {len(body)}".encode(),
            b"",
            body,
        ]
    )
    url = urlsplit(served.http_base)
    with socket.create_connection((url.hostname, url.port), 60) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_requests_the_engine_would_refuse_never_open_a_breaker(
    served: Served,
) -> None:
    """More requests vLLM would refuse than the breaker's failure threshold: all
    are 400s, and every replica's breaker stays closed."""
    from tests.integration.test_router import router_snapshot

    for _ in range(8):
        r = httpx.post(
            f"{served.http_base}/v1/completions",
            json=COMPLETION | {"temperature": 3.0},
            headers={"Authorization": f"Bearer {served.api_key}"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
    snapshot = router_snapshot(served)
    assert {r.breaker for r in snapshot.replicas.values()} == {"closed"}


def test_still_serving_after_bad_inputs(served: Served) -> None:
    # Runs after the tables above (same module, file order).
    msgs = list(served.client().generate(gen(sampling=sp(max_tokens=4)), timeout=60))
    assert msgs[-1].finished.completion_tokens == 4
    r = httpx.post(
        f"{served.http_base}/v1/completions",
        json=COMPLETION,
        headers={"Authorization": f"Bearer {served.api_key}"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
