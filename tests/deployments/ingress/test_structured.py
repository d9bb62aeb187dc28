from __future__ import annotations

import json
from collections.abc import AsyncGenerator

import pytest

from deployments.ingress import structured
from deployments.ingress.structured import ToolChoice
from deployments.ingress.validation import InvalidRequest
from deployments.protocol import EngineEvent, Finish, Started, TokenDelta


def test_strict_schemas_close_every_object() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "c": {"type": "array", "items": {"type": "object"}},
            "d": {"type": "object", "additionalProperties": True},
        },
    }
    strict = structured.strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["additionalProperties"] is False
    assert strict["properties"]["c"]["items"]["additionalProperties"] is False
    assert strict["properties"]["d"]["additionalProperties"] is True  # as set
    assert "additionalProperties" not in schema  # the client's is left alone


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: structured.json_schema([], "s"), "s"),
        (lambda: structured.json_schema({"minimum": "x"}, "s"), "s"),
        (
            lambda: structured.json_schema({"type": "object", "x": "y" * 70000}, "s"),
            "s",
        ),
        (lambda: structured.regex("", "r"), "r"),
        (lambda: structured.regex("a\x00", "r"), "r"),
        (lambda: structured.grammar("  ", "g"), "g"),
        (lambda: structured.choice([], "c"), "c"),
        (lambda: structured.choice(["a", ""], "c"), "c[1]"),
        (lambda: structured.tools({"a": 1}), "tools"),
        (
            lambda: structured.tools(
                [{"type": "function", "function": {"name": "a b"}}]
            ),
            "tools[0].function.name",
        ),
        (
            lambda: structured.tools(
                [{"type": "function", "function": {"name": "f", "parameters": []}}]
            ),
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_constraints_name_their_field(make: object, field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        make()  # type: ignore[operator]
    assert e.value.field == field


async def events(
    *texts: str, reason: str = "stop"
) -> AsyncGenerator[EngineEvent, None]:
    yield Started("r")
    for i, t in enumerate(texts):
        yield TokenDelta((i,), t)
    yield Finish(reason, 1, len(texts), 0, "r")  # type: ignore[arg-type]


async def shaped(choice: ToolChoice, *texts: str, reason: str = "stop") -> list:
    return [
        e async for e in structured.shape_calls(events(*texts, reason=reason), choice)
    ]


async def test_a_named_call_streams_its_arguments() -> None:
    out = await shaped(ToolChoice("named", "f"), '{"a"', ": 1}")
    deltas = [e for e in out if isinstance(e, TokenDelta)]
    assert [d.text for d in deltas] == ["", ""]
    [first], [second] = (d.tool_calls for d in deltas)
    assert first.name == "f" and first.id.startswith("call_") and first.index == 0
    assert not second.name and not second.id
    assert json.loads(first.arguments + second.arguments) == {"a": 1}
    assert out[-1].reason == "tool_calls" and out[-1].completion_tokens == 2


async def test_required_calls_come_whole_at_the_end() -> None:
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    out = await shaped(ToolChoice("required"), text[:10], text[10:])
    calls = [c for e in out if isinstance(e, TokenDelta) for c in e.tool_calls]
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "f", {"a": 1}),
        (1, "g", {}),
    ]
    assert out[-1].reason == "tool_calls"
    # Token ids still stream (gRPC clients see them); text does not.
    assert [e.token_ids for e in out if isinstance(e, TokenDelta)][:2] == [(0,), (1,)]


async def test_a_call_cut_short_is_content_not_a_call() -> None:
    out = await shaped(ToolChoice("required"), '[{"name": "f", "par', reason="length")
    assert "".join(e.text for e in out if isinstance(e, TokenDelta)) == (
        '[{"name": "f", "par'
    )
    assert out[-1].reason == "length"
    assert not [c for e in out if isinstance(e, TokenDelta) for c in e.tool_calls]


async def test_without_a_forced_choice_events_pass_unchanged() -> None:
    out = await shaped(ToolChoice("auto"), "hi")
    assert out == [e async for e in events("hi")]
