"""vLLM's deepseek_v3 tool parser on the tiny model's tokenizer, fed the way an
engine replica feeds it (one engine step at a time)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from cluster.tiny_tokenizer import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)
from deployments.engine.tools import DEEPSEEK_V3, ToolCallStream
from deployments.protocol import merge_tool_calls

TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                },
            },
        }
    ]
)


def call_text(name: str, args: str) -> str:
    head = f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{name}"
    return f"{head}\n```json\n{args}\n```{TOOL_CALL_END}"


def run(tokenizer: object, text: str) -> tuple[str, list, bool]:
    ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    stream = ToolCallStream(DEEPSEEK_V3, TOOLS, tokenizer)
    content, calls = [], []
    for i in ids:  # one token per engine step, its text as vLLM detokenizes it
        piece = tokenizer.decode([i])  # type: ignore[attr-defined]
        c, cs = stream.feed([i], piece)
        content.append(c)
        calls += cs
    calls += stream.finish()
    return "".join(content), list(merge_tool_calls(calls)), stream.called


def test_tool_call_tokens_are_single_non_special_tokens(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for t in (TOOL_CALLS_BEGIN, TOOL_CALL_BEGIN, TOOL_SEP, TOOL_CALL_END):
        [tid] = tok.encode(t, add_special_tokens=False)
        assert tok.decode([tid], skip_special_tokens=True) == t


def test_calls_are_parsed_out_of_the_stream(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = (
        "Let me check."
        + TOOL_CALLS_BEGIN
        + call_text("get_weather", '{"city": "Paris"}')
        + call_text("get_weather", '{"city": "Rome"}')
        + TOOL_CALLS_END
    )
    content, calls, called = run(tok, text)
    assert called and content == "Let me check."
    assert [(c.index, c.name) for c in calls] == [
        (0, "get_weather"),
        (1, "get_weather"),
    ]
    assert [json.loads(c.arguments) for c in calls] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    assert all(c.id for c in calls)


def test_plain_text_is_content(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    content, calls, called = run(tok, "the model serves tokens")
    assert content == "the model serves tokens" and not calls and not called
