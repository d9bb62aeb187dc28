"""Seeded malformed inputs for both protocols (and valid ones mixed in).

``cases(seed, n)`` yields ``n`` cases, the same ones for the same seed. Each is
one request as the wire carries it:

- gRPC ``Generate`` as raw bytes: random field values, invalid UTF-8 in string
  fields, mutated wire bytes (bit flips, truncation, splices, unknown fields),
  huge messages;
- HTTP: wrong JSON types in every field, huge and deeply nested bodies, bad
  headers and methods (a raw request line for those no client library sends),
  garbage ``response_format`` and ``tools``.

A ``valid`` case must be served (a short greedy generation); every other case may
be refused, but only with a client error (see ``runner.py``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from deployments.proto import inference_pb2 as pb

MODEL = "tiny-deepseek-v2"
VALID_EVERY = 25  # one valid request among this many cases
MAX_TOKENS = 2  # a valid case's generation (short: thousands of cases run)


@dataclass(frozen=True)
class GrpcCase:
    kind: str  # what the case tries, for the report
    payload: bytes  # a serialized moecluster.v1.GenerateRequest, or not
    valid: bool = False
    protocol: Literal["grpc"] = "grpc"


@dataclass(frozen=True)
class HttpCase:
    kind: str
    method: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes | None = None  # a whole request written to the socket as it is
    valid: bool = False
    protocol: Literal["http"] = "http"


Case = GrpcCase | HttpCase

# Values of every JSON type, and the edges each field's validation must handle.
JSON_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    -(2**63) - 1,
    10**400,  # beyond a float
    3.5,
    -0.0,
    1e308,
    "",
    "x",
    "\ud800",  # a lone surrogate (written as the JSON escape)
    "\u0000",
    "é" * 50,
    " " * 3,
    [],
    [1, 2],
    ["a"],
    [[1]],
    {},
    {"a": 1},
    {"type": "json_schema"},
]
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "response_format",
    "presence_penalty",
    "logit_bias",
    "user",
    "qos",
    "deadline_ms",
    "tenant",
    "request_id",
    "echo",
    "suffix",
    "best_of",
]
GARBAGE_FORMATS: list[Any] = [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
    {"type": "json_schema", "json_schema": "not a schema"},
    {"type": "regex"},
    "json",
    [{"type": "text"}],
    {"type": "text", "extra": [1, 2, 3]},
]
GARBAGE_TOOLS: list[Any] = [
    [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    [{"type": "function"}],
    [{}],
    "tools",
    [None],
    {"function": {"name": "x"}},
]
HEADER_VALUES = [
    "",
    " ",
    "Bearer",
    "Bearer \t",
    "Basic Zm9vOmJhcg==",
    "x" * 8000,
    "Bearer " + "k" * 512,
    "realtime",
    "urgent",
    "-5",
    "1e9",
    "99999999999999999999",
    "ünïcode",
]
BAD_METHOD_LINES = [
    b"GE T /v1/completions HTTP/1.1",
    b"POST /v1/completions HTTP/9.9",
    b"POST  HTTP/1.1",
    b"\x00\x01\x02 / HTTP/1.1",
    b"POST /v1/completions",
]


def valid_completion(rng: random.Random) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": rng.choice(["hello", "the router", "a b c"]),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def valid_chat(rng: random.Random) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": rng.choice(["hi", "tokens?"])}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def valid_grpc(rng: random.Random) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[rng.randrange(3, 1000) for _ in range(3)]),
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        qos=rng.choice([pb.REALTIME, pb.NORMAL, pb.BACKGROUND]),
    )


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


def _short(body: dict[str, Any]) -> dict[str, Any]:
    """A body whose mutation left it without a length (a chat completion then
    runs to the end of the context) gets a short one: thousands of cases run."""
    limits = [body.get(k) for k in ("max_tokens", "max_completion_tokens")]
    if not any(isinstance(v, int) and not isinstance(v, bool) for v in limits):
        body["max_completion_tokens" if "max_tokens" in body else "max_tokens"] = 2
    return body


def _nested(depth: int, inner: bytes = b"1") -> bytes:
    if depth % 2:
        return b'{"a":' * depth + inner + b"}" * depth
    return b"[" * depth + inner + b"]" * depth


def http_case(rng: random.Random) -> HttpCase:
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    chat = path.endswith("chat/completions")
    base = valid_chat(rng) if chat else valid_completion(rng)
    weights = {
        "wrong type": 30,
        "missing field": 8,
        "nested": 8,
        "huge": 2,
        "not json": 8,
        "bad header": 8,
        "bad method": 8,
        "bad path": 5,
        "response_format": 8,
        "tools": 8,
        "messages": 7,
    }
    kind = rng.choices(list(weights), list(weights.values()))[0]
    body: Any = dict(base)
    headers: dict[str, str] = {"Content-Type": "application/json"}
    if kind == "wrong type":
        for name in rng.sample(FIELDS, rng.randint(1, 3)):
            body[name] = rng.choice(JSON_VALUES)
        return HttpCase(kind, "POST", path, _json(_short(body)), headers)
    if kind == "missing field":
        body.pop(rng.choice(list(body)))
        return HttpCase(kind, "POST", path, _json(_short(body)), headers)
    if kind == "nested":
        depth = rng.choice([50, 129, 200, 990, 1000, 5000, 50_000])
        name = rng.choice(["tenant", "prompt", "stop", "tools", "x"])
        raw = _json(body)[:-1] + f', "{name}": '.encode() + _nested(depth) + b"}"
        if rng.random() < 0.3:
            raw = _nested(depth)
        return HttpCase(f"nested {depth}", "POST", path, raw, headers)
    if kind == "huge":
        size = rng.choice([1 << 16, 1 << 20, 3 << 20])
        body["prompt" if not chat else "messages"] = (
            "z" * size if not chat else [{"role": "user", "content": "z" * size}]
        )
        return HttpCase(f"huge {size}", "POST", path, _json(body), headers)
    if kind == "not json":
        raw = rng.choice(
            [
                b"",
                b"{",
                b"null",
                b"[]",
                b'"text"',
                b"\xff\xfe\x00",
                _json(body)[: rng.randint(1, 40)],
                _json(body).replace(b'"', b"'"),
                b"{" + bytes(rng.randrange(256) for _ in range(60)),
            ]
        )
        return HttpCase(kind, "POST", path, raw, headers)
    if kind == "bad header":
        # Written on the socket: no client library sends these.
        name = rng.choice(
            ["Authorization", "X-QoS", "X-Deadline-Ms", "Content-Type", "traceparent"]
        )
        value = rng.choice(HEADER_VALUES).encode()
        if rng.random() < 0.2:
            value = bytes(rng.randrange(128, 256) for _ in range(8))  # not ASCII
        content = _json(body)
        raw = b"\r\n".join(
            [
                f"POST {path} HTTP/1.1".encode(),
                b"Host: fuzz",
                b"Connection: close",
                b"Content-Type: application/json",
                f"Content-Length: {len(content)}".encode(),
                name.encode() + b": " + value,
                b"",
                content,
            ]
        )
        return HttpCase(f"bad header {name}", "POST", path, b"", headers, raw=raw)
    if kind == "bad method":
        if rng.random() < 0.5:
            method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
            return HttpCase(kind, method, path, _json(body), headers)
        line = rng.choice(BAD_METHOD_LINES)
        raw = line + b"\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
        return HttpCase("bad request line", "POST", path, b"", headers, raw=raw)
    if kind == "bad path":
        bad = rng.choice(["/v1/nope", "/v1/completions/x", "/v2/completions", "/%ff"])
        return HttpCase(kind, "POST", bad, _json(body), headers)
    if kind == "response_format":
        body["response_format"] = rng.choice(GARBAGE_FORMATS)
        return HttpCase(kind, "POST", path, _json(body), headers)
    if kind == "tools":
        body["tools"] = rng.choice(GARBAGE_TOOLS)
        if rng.random() < 0.5:
            body["tool_choice"] = rng.choice(["auto", "required", {"type": "x"}, 5])
        return HttpCase(kind, "POST", "/v1/chat/completions", _json(body), headers)
    # messages
    body = valid_chat(rng)
    body["messages"] = rng.choice(
        [
            [{"role": "tool", "content": "x"}],
            [{"role": "user"}],
            [{"role": "user", "content": None}],
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            [{"content": "no role"}],
            "hi",
            [1, 2],
            [{"role": "user", "content": "a\ud800b"}],
        ]
    )
    return HttpCase(kind, "POST", "/v1/chat/completions", _json(body), headers)


def _flip(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def _random_request(rng: random.Random) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    if rng.random() < 0.5:
        req.token_ids.ids.extend(
            rng.choice([-1, 0, 5, 4095, 4096, 2**31 - 1])
            for _ in range(rng.randint(0, 4))
        )
    else:
        req.text = rng.choice(["", "x", "hello " * 50, "\x00", "é"])
    s = req.sampling
    s.max_tokens = rng.choice([0, 1, 2, -1, 2**31 - 1, -(2**31)])
    s.temperature = rng.choice([0.0, -1.0, 2.0, 2.5, float("nan"), float("inf")])
    s.top_p = rng.choice([0.0, 0.5, 1.0, 1.5, float("nan")])
    s.top_k = rng.choice([0, -1, -2, 2**31 - 1])
    if rng.random() < 0.3:
        s.seed = rng.choice([0, 2**63 - 1, -(2**63)])
    if rng.random() < 0.3:
        s.stop.extend(rng.choice([[""], ["a"] * 20, ["x" * 300], ["ok"]]))
    if rng.random() < 0.3:
        s.stop_token_ids.extend([rng.choice([-5, 0, 4096, 99999])])
    req.qos = rng.choice([0, 1, 2, 3, 7, -1])
    req.deadline_ms = rng.choice([0, 1, 50, 2**32 - 1])
    req.tenant = rng.choice(["", "acme", "a/b", "x" * 200])
    req.request_id = rng.choice(["", "fuzz-1", "has space", "r" * 200])
    if req.deadline_ms == 0 and s.max_tokens > MAX_TOKENS:
        s.max_tokens = MAX_TOKENS  # keep the accidentally valid ones short
    return req


def _invalid_utf8(rng: random.Random) -> bytes:
    req = valid_grpc(rng)
    name = rng.choice(["text", "tenant", "request_id", "stop"])
    marker = "MARK"
    if name == "text":
        req.ClearField("token_ids")
        req.text = f"a{marker}b"
    elif name == "stop":
        req.sampling.stop.append(marker)
    else:
        setattr(req, name, marker)
    bad = rng.choice([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
    return req.SerializeToString().replace(marker.encode(), bad)


def grpc_case(rng: random.Random) -> GrpcCase:
    kinds = {"random fields": 40, "invalid utf-8": 20, "mutated": 25, "garbage": 14}
    kind = rng.choices([*kinds, "huge"], [*kinds.values(), 1])[0]
    if kind == "random fields":
        return GrpcCase(kind, _random_request(rng).SerializeToString())
    if kind == "invalid utf-8":
        return GrpcCase(kind, _invalid_utf8(rng))
    wire = valid_grpc(rng).SerializeToString()
    if kind == "mutated":
        how = rng.choice(["flip", "truncate", "splice", "unknown field"])
        if how == "flip":
            return GrpcCase("mutated: flip", _flip(rng, wire))
        if how == "truncate":
            return GrpcCase("mutated: truncate", wire[: rng.randrange(len(wire))])
        if how == "splice":
            i = rng.randrange(len(wire))
            junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            return GrpcCase("mutated: splice", wire[:i] + junk + wire[i:])
        # Field 99, length-delimited: unknown to the schema (protobuf keeps it).
        return GrpcCase("mutated: unknown field", wire + b"\x9a\x06\x03abc")
    if kind == "garbage":
        n = rng.choice([0, 1, 7, 100, 5000])
        return GrpcCase(kind, bytes(rng.randrange(256) for _ in range(n)))
    size = rng.choice([1 << 20, 9 << 20])  # under and over the proxy's limit
    req = valid_grpc(rng)
    req.ClearField("token_ids")
    req.text = "y" * size
    return GrpcCase(f"huge {size}", req.SerializeToString())


def cases(seed: int, n: int) -> Iterator[Case]:
    """``n`` cases, one valid among every ``VALID_EVERY``, half per protocol."""
    rng = random.Random(seed)
    for i in range(n):
        grpc_side = rng.random() < 0.5
        if i % VALID_EVERY == VALID_EVERY - 1:
            if grpc_side:
                yield GrpcCase("valid", valid_grpc(rng).SerializeToString(), True)
            else:
                chat = rng.random() < 0.5
                body = valid_chat(rng) if chat else valid_completion(rng)
                path = "/v1/chat/completions" if chat else "/v1/completions"
                yield HttpCase("valid", "POST", path, _json(body), valid=True)
            continue
        yield grpc_case(rng) if grpc_side else http_case(rng)
