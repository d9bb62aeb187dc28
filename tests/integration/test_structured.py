"""Structured outputs, tool calls and logprobs on the real engines, through the
``openai`` package (HTTP) and ``moecluster.v1`` (gRPC).

The tiny model's weights are random: whatever it writes under a constraint
obeys the constraint only because the engine's grammar enforces it. Schemas
here bound every string (enums, patterns) so that a valid answer fits in
``max_tokens``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from deployments.proto import inference_pb2 as pb
from deployments.protocol import EngineRequest, Sampling, TokenDelta
from tests.integration.conftest import PLATFORM, Served

MODEL = "tiny-deepseek-v2"
# The same request on another run (another replica, a cached prefix) computes
# the same logprobs up to the engine dtype's rounding.
TOLERANCE = 1e-4 if PLATFORM.dtype == "float32" else 5e-2
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "units": {"type": "string", "pattern": "^[CF]$"},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for some days.",
        "parameters": SCHEMA,
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http_base}/v1", api_key=served.api_key)


def json_schema_format(strict: bool = True) -> Any:
    return {
        "type": "json_schema",
        "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": strict},
    }


@pytest.mark.parametrize("temperature", [0, 1])
def test_a_json_schema_answer_validates(
    client: openai.OpenAI, temperature: float
) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format=json_schema_format(),
        max_tokens=64,
        temperature=temperature,
        seed=7,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_json_object_gives_json(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=48,
        temperature=0,
    )
    text = r.choices[0].message.content or ""
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # random weights may write a long object: a prefix of one
        assert r.choices[0].finish_reason == "length"


def test_a_streamed_json_schema_answer_validates(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="Forecast:",
        # Completions has no response_format in the openai package: as vLLM's.
        extra_body={"response_format": json_schema_format(strict=False)},
        max_tokens=64,
        temperature=0,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    assert len(chunks) >= 3  # streamed, not one blob
    text = "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def named(name: str) -> Any:
    return {"type": "function", "function": {"name": name}}


def test_a_named_tool_choice_returns_a_valid_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[CLOCK, WEATHER],
        tool_choice=named("get_weather"),
        max_tokens=64,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_a_streamed_named_tool_call_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice=named("get_weather"),
        max_tokens=64,
        temperature=0,
        stream=True,
    )
    pieces = [
        (c.choices[0].delta, c.choices[0].finish_reason) for c in stream if c.choices
    ]
    calls = [tc for delta, _ in pieces for tc in delta.tool_calls or []]
    assert len(calls) >= 2  # the arguments came in pieces
    assert calls[0].id and calls[0].function and calls[0].function.name == "get_weather"
    assert all(tc.index == 0 and not tc.id for tc in calls[1:])
    args = "".join(tc.function.arguments or "" for tc in calls if tc.function)
    jsonschema.validate(json.loads(args), SCHEMA)
    assert pieces[-1][1] == "tool_calls"


def test_required_tool_choice_calls_defined_tools(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[CLOCK, WEATHER],
        tool_choice="required",
        max_tokens=96,
        temperature=0,
    )
    choice = r.choices[0]
    if choice.finish_reason == "length":  # random weights may call many times
        pytest.skip("the model's call list did not fit 96 tokens")  # pragma: no cover
    assert choice.finish_reason == "tool_calls"
    schemas = {"get_weather": SCHEMA, "get_time": CLOCK["function"]["parameters"]}
    for call in choice.message.tool_calls or []:
        jsonschema.validate(
            json.loads(call.function.arguments), schemas[call.function.name]
        )
    assert choice.message.tool_calls


def test_auto_tool_choice_and_tool_history(client: openai.OpenAI) -> None:
    # The model decides; with random weights it answers in text, which the
    # engine's deepseek_v3 parser passes on as content.
    history: list[Any] = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 1, "units": "C"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=8, temperature=0
    )
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0
    )
    with_tools = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    # The template lists the tools and renders the calls and their results.
    assert with_tools.usage and plain.usage and r.usage
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert r.usage.prompt_tokens > with_tools.usage.prompt_tokens + 20


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"tool_choice": named("get_time"), "tools": [WEATHER]},
            "tool_choice.function.name",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"parallel_tool_calls": False, "tools": [WEATHER]}, "parallel_tool_calls"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    client: openai.OpenAI, kw: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, **kw
        )
    assert param in str(e.value)


def test_a_schema_the_grammar_cannot_compile_is_400(
    client: openai.OpenAI, served: Served
) -> None:
    # A valid JSON Schema whose $ref leads nowhere: the engine's grammar
    # backends refuse it when it arrives, before scheduling it.
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        )
    assert "response_format.json_schema.schema" in str(e.value)


def engine_logprobs(
    served: Served, engine_handle: Any, ids: list[int], n: int, k: int
) -> list[Any]:
    """The engine replica's own answer to the same greedy request."""
    request = EngineRequest(
        uuid.uuid4().hex, tuple(ids), Sampling(max_tokens=n, temperature=0, logprobs=k)
    )
    gen = engine_handle.options(stream=True).generate.remote(request)
    out: list[Any] = []
    for event in gen:
        if isinstance(event, TokenDelta):
            out += event.logprobs
    return out


def test_logprobs_are_the_engines_own(
    client: openai.OpenAI, served: Served, engine_handle: Any
) -> None:
    prompt = [410, 465, 14, 318, 496]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert lp and lp.tokens and lp.token_logprobs and lp.top_logprobs
    own = engine_logprobs(served, engine_handle, prompt, 6, 3)
    assert [e.text for e in own] == lp.tokens
    assert lp.token_logprobs == pytest.approx([e.logprob for e in own], abs=TOLERANCE)
    for top, e in zip(lp.top_logprobs, own, strict=True):
        assert len(top) == 3 and max(top.values()) == pytest.approx(
            e.logprob, abs=TOLERANCE
        )
    # Chat, streamed: one entry per token, the top 2 each.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    content = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert len(content) == 6
    for e in content:
        assert len(e.top_logprobs) == 2 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(e.bytes or []) == e.token.encode()
    # gRPC: the same numbers as HTTP's completion.
    client_grpc = served.client()
    try:
        events = list(
            client_grpc.generate(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingParams(max_tokens=6, temperature=0, logprobs=3),
                )
            )
        )
    finally:
        client_grpc.close()
    entries = [e for r in events if r.HasField("chunk") for e in r.chunk.logprobs]
    assert [e.token for e in entries] == lp.tokens
    assert [e.logprob for e in entries] == pytest.approx(
        lp.token_logprobs, abs=TOLERANCE
    )
    assert all(e.rank == 1 and len(e.top) == 3 for e in entries)


# -- gRPC -------------------------------------------------------------------------


def grpc_run(served: Served, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    c = served.client()
    try:
        return list(c.generate(req, timeout=60))
    finally:
        c.close()


def chat(content: str = "What is the weather in Paris?") -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(role="user", content=content)])


def test_grpc_json_schema_and_json_object(served: Served) -> None:
    for structured in (
        pb.StructuredOutput(json_schema=json.dumps(SCHEMA), strict=True),
        pb.StructuredOutput(json_object=True),
    ):
        events = grpc_run(
            served,
            pb.GenerateRequest(
                chat=chat(),
                sampling=pb.SamplingParams(
                    max_tokens=64, temperature=0, structured=structured
                ),
            ),
        )
        text = "".join(r.chunk.text for r in events if r.HasField("chunk"))
        finished = events[-1].finished
        if structured.HasField("json_schema"):
            assert finished.finish_reason == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert text.startswith("{")
            if finished.finish_reason == "stop":
                assert isinstance(json.loads(text), dict)


def test_grpc_regex_and_choice(served: Served) -> None:
    for structured, check in (
        (pb.StructuredOutput(regex="[a-c]{3}-[0-9]{2}"), r"^[a-c]{3}-[0-9]{2}$"),
        (pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no"])), "^(yes|no)$"),
    ):
        events = grpc_run(
            served,
            pb.GenerateRequest(
                text="Answer:",
                sampling=pb.SamplingParams(max_tokens=16, structured=structured),
            ),
        )
        import re

        text = "".join(r.chunk.text for r in events if r.HasField("chunk"))
        assert re.match(check, text), text


def grpc_tool(spec: Any) -> pb.Tool:
    fn = spec["function"]
    return pb.Tool(
        name=fn["name"],
        description=fn.get("description", ""),
        parameters_json=json.dumps(fn["parameters"]),
    )


def test_grpc_named_tool_call_validates(served: Served) -> None:
    events = grpc_run(
        served,
        pb.GenerateRequest(
            chat=chat(),
            tools=[grpc_tool(CLOCK), grpc_tool(WEATHER)],
            tool_function="get_weather",
            sampling=pb.SamplingParams(max_tokens=64, temperature=0),
        ),
    )
    pieces = [t for r in events if r.HasField("chunk") for t in r.chunk.tool_calls]
    assert len(pieces) >= 2 and pieces[0].name == "get_weather"
    assert "".join(r.chunk.text for r in events if r.HasField("chunk")) == ""
    finished = events[-1].finished
    assert finished.finish_reason == "tool_calls"
    [call] = finished.tool_calls
    assert call.name == "get_weather" and call.id == pieces[0].id
    assert call.arguments == "".join(p.arguments for p in pieces)
    jsonschema.validate(json.loads(call.arguments), SCHEMA)


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (
            pb.GenerateRequest(
                text="x",
                sampling=pb.SamplingParams(
                    structured=pb.StructuredOutput(json_schema="{not json")
                ),
            ),
            "sampling.structured.json_schema",
        ),
        (
            pb.GenerateRequest(
                text="x",
                sampling=pb.SamplingParams(
                    structured=pb.StructuredOutput(grammar="root ::= missing")
                ),
            ),
            "sampling.structured.grammar",
        ),
        (pb.GenerateRequest(text="x", tools=[grpc_tool(WEATHER)]), "tools"),
        (
            pb.GenerateRequest(
                chat=chat(), tool_function="nope", tools=[grpc_tool(WEATHER)]
            ),
            "tool_function",
        ),
        (
            pb.GenerateRequest(text="x", sampling=pb.SamplingParams(logprobs=50)),
            "sampling.logprobs",
        ),
    ],
)
def test_grpc_bad_constraints_are_invalid_argument(
    served: Served, req: pb.GenerateRequest, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as e:
        grpc_run(served, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (e.value.details() or "")
