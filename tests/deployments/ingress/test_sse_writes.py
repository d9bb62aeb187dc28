"""The OpenAI handlers' server-sent events, write by write: a stream's last tokens
leave in the same write as its end."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

from deployments.ingress import deployment
from deployments.ingress.openai_api import ResponseShape
from deployments.protocol import EngineEvent, Finish, TokenDelta

FINISH = Finish("length", 3, 3, 0, "a")


async def scripted(
    events: list[EngineEvent | Exception],
) -> AsyncGenerator[EngineEvent, None]:
    for event in events:
        if isinstance(event, Exception):
            raise event
        yield event


async def writes(events: list[EngineEvent | Exception]) -> list[list[object]]:
    """Each write of the response, as the data lines in it ("[DONE]" as is)."""
    stream = scripted(events)
    first = await anext(stream)
    shape = ResponseShape("completion", "r", "m")
    out = []
    async for write in deployment._sse(shape, first, stream, True):
        lines = [x[6:] for x in write.decode().split("\n\n") if x]
        out.append([x if x == "[DONE]" else json.loads(x) for x in lines])
    return out


def texts(write: list[object]) -> list[str | None]:
    """The text of each chunk of ``write`` that has a choice; None for usage."""
    return [
        c["choices"][0]["text"] if isinstance(c, dict) and c["choices"] else None
        for c in write
        if c != "[DONE]"
    ]


async def test_the_last_tokens_finish_usage_and_done_are_one_write() -> None:
    got = await writes(
        [
            TokenDelta((1,), "a"),
            TokenDelta((2,), "b"),
            TokenDelta((3,), "c", finishing=True),
            FINISH,
        ]
    )
    assert [texts(w) for w in got[:2]] == [["a"], ["b"]]
    last = got[2]
    assert texts(last) == ["c", "", None]
    assert last[1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert last[-1] == "[DONE]" and len(got) == 3


async def test_tokens_after_a_finishing_delta_keep_their_order() -> None:
    # A resumed stream's held-back text may follow the engine's last delta.
    got = await writes(
        [TokenDelta((1,), "a", finishing=True), TokenDelta((), "b"), FINISH]
    )
    assert [texts(w) for w in got] == [["a", "b"], ["", None]]


async def test_a_finishing_delta_then_a_failure_still_reaches_the_client() -> None:
    got = await writes(
        [TokenDelta((1,), "a"), TokenDelta((2,), "b", finishing=True), RuntimeError()]
    )
    assert texts(got[0]) == ["a"]
    tokens, error = got[1]
    assert tokens["choices"][0]["text"] == "b"  # type: ignore[index]
    assert "error" in error  # type: ignore[operator]
    assert got[2:] == [["[DONE]"]]
