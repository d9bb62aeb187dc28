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
        ({"best_of": 2}, "best_of"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ],
)
def test_unserved_values_are_named(kw: dict[str, object], field: str) -> None:
    bad = openai_api.parse(CompletionRequest, body(**kw)).unsupported()
    assert bad is not None and bad.startswith(field)


@pytest.mark.parametrize(
    ("model", "kw", "field"),
    [
        # Fields this server does not know are refused, never ignored.
        (CompletionRequest, {"functions": [{}]}, "functions"),
        (CompletionRequest, {"tools": []}, "tools"),  # chat only
        (CompletionRequest, {"metadata": {"a": "b"}}, "metadata"),
        (CompletionRequest, {"logprobs": 21}, "logprobs"),
        (ChatCompletionRequest, {"function_call": "auto"}, "function_call"),
        (ChatCompletionRequest, {"prompt": "p"}, "prompt"),
        (ChatCompletionRequest, {"top_logprobs": 99}, "top_logprobs"),
    ],
)
def test_unknown_fields_are_refused_by_name(
    model: type, kw: dict[str, object], field: str
) -> None:
    data = {"model": "m"} | (
        {"prompt": "p"}
        if model is CompletionRequest
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    with pytest.raises(InvalidRequest) as e:
        openai_api.parse(model, json.dumps(data | kw).encode())
    assert e.value.field == field


def test_bodies_nest_up_to_the_limit() -> None:
    deep = b"[" * (openai_api.MAX_JSON_DEPTH - 2) + b"]" * (
        openai_api.MAX_JSON_DEPTH - 2
    )
    raw = body()[:-1] + b', "stream_options": {"include_usage": ' + deep + b"}}"
    assert openai_api.parse(CompletionRequest, raw).include_usage() is not None


@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}},
        {"stream_options": {"include_usage": True}},
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
    parses_tool_calls = True
    from deployments.ingress.validation import Limits

    limits = Limits(max_model_len=40, vocab_size=50, max_prompt_bytes=64)
    facts = type("Facts", (), {"name": "m"})()

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text]

    def __init__(self) -> None:
        self.tools: list[dict[str, object]] | None = None

    def encode_chat(
        self,
        messages: list[dict[str, str]],
        field: str,
        tools: list[dict[str, object]] | None = None,
    ) -> list[int]:
        self.tools = tools
        return [0] + [t for m in messages for t in self.encode_text(m["content"])]


def convert(kind: str, frontend: FakeFrontend | None = None, **kw: object) -> tuple:
    data = {"model": "m"} | (
        {"prompt": "p"} if kind == "completion" else {"messages": USER_MESSAGES}
    )
    return openai_api.engine_request(
        json.dumps(data | kw).encode(),
        kind,  # type: ignore[arg-type]
        frontend or FakeFrontend(),  # type: ignore[arg-type]
    )


USER_MESSAGES = [{"role": "user", "content": "ab"}]


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


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_response_format_becomes_the_engines_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    _, req, _ = convert("chat", response_format=fmt)
    c = req.sampling.structured
    assert c.kind == "json" and json.loads(c.value) == schema
    assert c.field == "response_format.json_schema.schema"
    fmt["json_schema"]["strict"] = True  # type: ignore[index]
    _, req, _ = convert("completion", response_format=fmt)
    assert json.loads(req.sampling.structured.value)["additionalProperties"] is False
    _, req, _ = convert("chat", response_format={"type": "json_object"})
    assert req.sampling.structured.kind == "json_object"
    _, req, _ = convert("chat", response_format={"type": "text"})
    assert req.sampling.structured is None and not req.tool_parser


def test_tools_render_and_choose_how_calls_are_made() -> None:
    frontend = FakeFrontend()
    parsed, req, _ = convert("chat", frontend, tools=[WEATHER])
    # auto (the default with tools): the engine parses DeepSeek's call tokens.
    assert frontend.tools == [WEATHER] and parsed.tool_choice_parsed.mode == "auto"
    assert req.tool_parser == "deepseek_v3" and req.sampling.structured is None
    assert json.loads(req.tools_json) == [WEATHER]
    named = {"type": "function", "function": {"name": "get_weather"}}
    parsed, req, _ = convert("chat", tools=[WEATHER], tool_choice=named)
    assert parsed.tool_choice_parsed.name == "get_weather" and not req.tool_parser
    params = WEATHER["function"]["parameters"]  # type: ignore[index]
    assert json.loads(req.sampling.structured.value) == params
    _, req, _ = convert("chat", tools=[WEATHER], tool_choice="required")
    schema = json.loads(req.sampling.structured.value)
    assert schema["type"] == "array" and schema["minItems"] == 1
    parsed, req, _ = convert("chat", tools=[WEATHER], tool_choice="none")
    assert not req.tool_parser and req.sampling.structured is None


def test_tool_history_is_rendered() -> None:
    frontend = FakeFrontend()
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "P"}'},
    }
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "ab"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
    ]
    _, req, _ = convert("chat", frontend, messages=messages, tools=[WEATHER])
    assert req.prompt_token_ids[:3] == (0, 47, 48)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 5}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"tools": [{"type": "code"}]}, "tools[0].type"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice.function.name",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content.str",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_structured_and_tool_errors_name_the_field(
    kw: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidRequest) as e:
        convert("chat", **kw)
    assert e.value.field == field


def test_logprobs_requests() -> None:
    _, req, _ = convert("chat", logprobs=True, top_logprobs=3)
    assert req.sampling.logprobs == 3
    _, req, _ = convert("chat", logprobs=True)
    assert req.sampling.logprobs == 0
    _, req, _ = convert("chat")
    assert req.sampling.logprobs is None
    _, req, _ = convert("completion", logprobs=2)
    assert req.sampling.logprobs == 2


def test_tool_calls_and_logprobs_in_responses() -> None:
    from deployments.protocol import TokenLogprob, ToolCallDelta

    fin = Finish("tool_calls", 3, 2, 0, "r")
    chat = ResponseShape("chat", "abc", "m")
    calls = [
        ToolCallDelta(0, "call_1", "get_weather", '{"city"'),
        ToolCallDelta(0, arguments=': "P"}'),
    ]
    message = chat.full("", fin, calls)["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "P"}'},
        }
    ]
    first, rest = (chat.chunk("", None, [c])["choices"][0]["delta"] for c in calls)
    assert first["tool_calls"][0] == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"arguments": '{"city"', "name": "get_weather"},
    }
    assert rest["tool_calls"][0] == {"index": 0, "function": {"arguments": ': "P"}'}}
    lps = [
        TokenLogprob(5, "é", -0.5, 1, ((5, "é", -0.5), (6, "b", -1.5))),
        TokenLogprob(6, "b", -2.0, 3, ()),
    ]
    content = chat.chunk("éb", None, (), lps)["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "é",
        "logprob": -0.5,
        "bytes": [195, 169],
        "top_logprobs": [
            {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
            {"token": "b", "logprob": -1.5, "bytes": [98]},
        ],
    }
    text = ResponseShape("completion", "abc", "m")
    lp = text.full("éb", Finish("length", 3, 2, 0, "r"), (), lps)["choices"][0]
    assert lp["logprobs"] == {
        "tokens": ["é", "b"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"é": -0.5, "b": -1.5}, {}],
        "text_offset": [0, 1],
    }


def test_auto_tool_choice_needs_the_tool_call_tokens() -> None:
    frontend = FakeFrontend()
    frontend.parses_tool_calls = False  # a tokenizer without DeepSeek's tokens
    with pytest.raises(InvalidRequest) as e:
        convert("chat", frontend, tools=[WEATHER])
    assert e.value.field == "tool_choice"
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, req, _ = convert("chat", frontend, tools=[WEATHER], tool_choice=named)
    assert req.sampling.structured is not None  # enforced, not parsed: served
