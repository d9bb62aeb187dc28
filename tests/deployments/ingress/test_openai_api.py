from __future__ import annotations

import json

import pytest

from deployments.ingress import openai_api
from deployments.ingress.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
)
from deployments.ingress.validation import InvalidRequest
from deployments.protocol import Finish


def body(**kw: object) -> bytes:
    return json.dumps({"model": "m", "prompt": "p"} | kw).encode()


def test_parse_and_extensions() -> None:
    req = openai_api.parse(CompletionRequest, body(qos="background", deadline_ms=30))
    assert openai_api.qos_of(req).name == "BACKGROUND" and req.deadline_ms == 30
    assert req.stop_list() == [] and req.unsupported() is None
    assert openai_api.parse(CompletionRequest, body(stop="x")).stop_list() == ["x"]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"\xff", "body"),
        (b"{", "body"),
        (b"3", "body"),
        (json.dumps({"prompt": "p"}).encode(), "model"),
        (body(max_tokens="x"), "max_tokens"),
        (body(deadline_ms=-1), "deadline_ms"),
        # Nested past Python's recursion limit: at the top, or inside a field.
        (b"[" * 5000 + b"]" * 5000, "body"),
        (body()[:-1] + b', "tenant": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body"),
        (body()[:-1] + b', "stop": ' + b'{"a":' * 3000 + b"1" + b"}" * 3001, "body"),
        # ... and past the server's own limit, well within Python's.
        (body()[:-1] + b', "tools": ' + b"[" * 200 + b"]" * 200 + b"}", "body"),
    ],
)
def test_parse_errors_name_the_field(raw: bytes, field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        openai_api.parse(CompletionRequest, raw)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"n": 3}, "n"),
        ({"echo": True}, "echo"),
        ({"logprobs": 2}, "logprobs"),
        ({"best_of": 2}, "best_of"),
        ({"tools": [{}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"functions": [{}]}, "functions"),
    ],
)
def test_unsupported_fields_are_named(kw: dict[str, object], field: str) -> None:
    assert openai_api.parse(CompletionRequest, body(**kw)).unsupported() == field


def test_bodies_nest_up_to_the_limit() -> None:
    deep = b"[" * (openai_api.MAX_JSON_DEPTH - 1) + b"]" * (
        openai_api.MAX_JSON_DEPTH - 1
    )
    parsed = openai_api.parse(CompletionRequest, body()[:-1] + b', "x": ' + deep + b"}")
    assert parsed.unsupported() is None  # an unknown field, ignored


@pytest.mark.parametrize(
    "kw",
    [
        {"response_format": {"type": "text"}},
        {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}},
        {"tool_choice": "none"},
    ],
)
def test_defaults_of_unserved_fields_pass(kw: dict[str, object]) -> None:
    assert openai_api.parse(CompletionRequest, body(**kw)).unsupported() is None


def test_shapes() -> None:
    fin = Finish("stop", 3, 2, 1, "r", migrations=1)
    chat = ResponseShape("chat", "abc", "m")
    full = chat.full("hi", fin)
    assert full["id"] == "chatcmpl-abc" and full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert full["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
        "migrations": 1,
    }
    assert chat.chunk("x")["choices"][0]["delta"] == {"content": "x"}
    text = ResponseShape("completion", "abc", "m")
    assert text.chunk("", "length")["choices"][0]["finish_reason"] == "length"
    assert openai_api.sse("[DONE]") == b"data: [DONE]\n\n"
    req = openai_api.parse(
        ChatCompletionRequest,
        json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        ).encode(),
    )
    assert req.messages[0].content == "x"


class FakeFrontend:
    from deployments.ingress.validation import Limits

    limits = Limits(max_model_len=40, vocab_size=50, max_prompt_bytes=64)
    facts = type("Facts", (), {"name": "m"})()

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text]

    def encode_chat(self, messages: list[dict[str, str]], field: str) -> list[int]:
        return [0] + [t for m in messages for t in self.encode_text(m["content"])]


def convert(kind: str, **kw: object) -> tuple:
    return openai_api.engine_request(body(**kw), kind, FakeFrontend())  # type: ignore[arg-type]


def test_completion_conversion() -> None:
    _, req, deadline = convert(
        "completion", prompt="abc", qos="realtime", deadline_ms=20
    )
    assert req.prompt_token_ids == (47, 48, 49) and req.qos.name == "REALTIME"
    assert req.sampling.max_tokens == 16 and deadline == 0.02  # OpenAI's default
    _, req, _ = convert("completion", prompt=[1, 2], max_tokens=5, stop="z")
    assert req.prompt_token_ids == (1, 2) and req.sampling.stop == ("z",)


def test_chat_conversion() -> None:
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "ab"}]
    _, req, deadline = convert("chat", messages=messages, max_completion_tokens=3)
    assert req.prompt_token_ids == (0, 47, 48) and req.sampling.max_tokens == 3
    assert deadline is None


@pytest.mark.parametrize(
    ("kind", "kw", "field"),
    [
        ("completion", {"model": "other"}, "model"),
        ("completion", {"n": 2}, "n"),
        ("completion", {"prompt": "x" * 65}, "prompt"),
        ("completion", {"prompt": [1] * 40}, "prompt"),
        ("completion", {"prompt": ["a", "b"]}, "prompt"),
        ("completion", {"max_tokens": 0}, "max_tokens"),
        ("chat", {"messages": [{"role": "user", "content": "y" * 40}] * 2}, "messages"),
    ],
)
def test_conversion_errors_name_the_field(
    kind: str, kw: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidRequest) as e:
        convert(kind, **kw)
    assert e.value.field == field


def test_qos_and_deadline_headers_apply_unless_the_body_sets_them() -> None:
    def conv(headers: dict[str, str], **kw: object) -> tuple:
        return openai_api.engine_request(
            body(**kw),
            "completion",
            FakeFrontend(),  # type: ignore[arg-type]
            headers,
        )

    _, req, deadline = conv({"x-qos": "Realtime", "x-deadline-ms": "250"}, prompt="a")
    assert req.qos.name == "REALTIME" and deadline == 0.25
    _, req, deadline = conv(
        {"x-qos": "realtime", "x-deadline-ms": "250"},
        prompt="a",
        qos="background",
        deadline_ms=0,
    )
    assert req.qos.name == "BACKGROUND" and deadline is None
    with pytest.raises(InvalidRequest, match="whole number") as e:
        conv({"x-deadline-ms": "-5"}, prompt="a")
    assert e.value.field == "X-Deadline-Ms"
    with pytest.raises(InvalidRequest, match="realtime, normal, background") as e:
        conv({"x-qos": "urgent"}, prompt="a")
    assert e.value.field == "X-QoS"
