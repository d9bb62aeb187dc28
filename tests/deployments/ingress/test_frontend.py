"""Frontend logic against a scripted engine stream (a process boundary)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from ray.serve.exceptions import BackPressureError, RequestCancelledError

from deployments.ingress.errors import (
    AlreadyInFlight,
    DeadlineMissed,
    EngineUnavailable,
    Overloaded,
    PermissionDenied,
    Unauthenticated,
    status_of,
)
from deployments.ingress.frontend import Credential, Frontend, ModelFacts
from deployments.ingress.validation import Limits
from deployments.protocol import (
    EngineEvent,
    EngineRequest,
    Finish,
    Sampling,
    Started,
    TokenDelta,
)

FACTS = ModelFacts("m", "DeepseekV2ForCausalLM", 64, 100, 4, 3, 16, 1, 2, 4, 2)


class ScriptedStream:
    """Yields ``script`` items: events; exceptions to raise; "hang" (until
    cancelled); "dead" (forever: a replica on a lost node, which no cancel
    reaches); a float (a pause of that many seconds)."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.cancelled = asyncio.Event()
        self.cancel_raises: BaseException | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        if self.cancel_raises is not None:
            raise self.cancel_raises

    async def _events(self) -> AsyncIterator[EngineEvent]:
        for item in self.script:
            if self.cancelled.is_set():
                raise RequestCancelledError("x")
            if item == "hang":
                await self.cancelled.wait()
                raise RequestCancelledError("x")
            if item == "dead":
                await asyncio.Event().wait()
            if isinstance(item, float):
                await asyncio.sleep(item)
                continue
            if isinstance(item, BaseException):
                raise item
            await asyncio.sleep(0)
            yield item

    def __aiter__(self) -> AsyncIterator[EngineEvent]:
        return self._events()


def make(
    script: list[Any], *retries: list[Any], keys: tuple[Any, ...] = ()
) -> tuple[Frontend, ScriptedStream]:
    """A Frontend whose engine plays ``script``, then ``retries`` on reopening."""
    streams = [ScriptedStream(s) for s in (script, *retries)]
    opened = iter(streams)
    fe = Frontend(
        tokenizer=None,
        facts=FACTS,
        limits=Limits(64, 100, 1000),
        api_keys=keys,
        open_stream=lambda _req: next(opened),
    )
    return fe, streams[0]


REQ = EngineRequest("r1", (1, 2, 3), Sampling(max_tokens=4))
TOKENS = [Started("rep-a"), TokenDelta((5,), "a"), TokenDelta((6, 7), "bc")]
DONE = Finish("length", 3, 3, 0, "rep-a")


async def collect(fe: Frontend, deadline: float | None = None) -> list[EngineEvent]:
    return [e async for e in fe.stream(REQ, deadline)]


async def test_events_pass_through_and_the_request_leaves_the_table() -> None:
    fe, stream = make([*TOKENS, DONE])
    assert await collect(fe) == [*TOKENS, DONE]
    assert fe.in_flight() == [] and not stream.cancelled.is_set()


async def test_abort_ends_the_stream_with_an_abort_finish() -> None:
    fe, stream = make([*TOKENS, "hang"])
    events = fe.stream(REQ)
    seen = [await anext(events) for _ in range(3)]
    assert fe.in_flight() == ["r1"]
    assert fe.abort("r1") is True
    rest = [e async for e in events]
    assert rest == [Finish("abort", 3, 3, 0, "rep-a")]
    assert seen == TOKENS and stream.cancelled.is_set()
    assert fe.abort("r1") is False and fe.in_flight() == []


async def test_an_abort_wins_over_events_already_on_their_way() -> None:
    """An engine stream that still delivers what it had (its Finish among it)
    after the cancel: the client's stream ends as aborted all the same."""

    class Undeterred(ScriptedStream):
        def cancel(self) -> None:
            pass  # the cancel takes effect later; these events are in flight

    stream = Undeterred([*TOKENS, DONE])
    fe = Frontend(
        tokenizer=None,
        facts=FACTS,
        limits=Limits(64, 100, 1000),
        api_keys=(),
        open_stream=lambda _req: stream,
    )
    events = fe.stream(REQ)
    assert [await anext(events) for _ in range(2)] == TOKENS[:2]
    assert fe.abort("r1") is True
    rest = [e async for e in events]
    assert rest == [Finish("abort", 3, 1, 0, "rep-a")]
    assert fe.in_flight() == []


async def test_a_missed_first_token_deadline_cancels_the_engine_request() -> None:
    fe, stream = make([Started("rep-a"), "hang"])
    with pytest.raises(DeadlineMissed, match="deadline_ms=50"):
        await collect(fe, deadline=0.05)
    assert stream.cancelled.is_set() and fe.in_flight() == []


async def test_the_deadline_bounds_only_the_first_token() -> None:
    fe, _ = make([*TOKENS, DONE])
    assert (await collect(fe, deadline=5.0))[-1] == DONE


async def test_backpressure_is_overload_with_a_retry_hint() -> None:
    refused = BackPressureError(num_queued_requests=9, max_queued_requests=8)
    fe, stream = make([refused])
    stream.cancel_raises = refused  # as Serve's cancel() of a refused request
    with pytest.raises(Overloaded) as e:
        await collect(fe)
    assert e.value.retry_after_s == 1.0


async def test_a_failure_before_output_is_retried_on_a_new_stream() -> None:
    dead = [Started("rep-a"), RuntimeError("engine dead")]
    fe, first = make(dead, [*TOKENS, DONE])
    assert await collect(fe) == [*TOKENS, DONE]
    assert first.cancelled.is_set()


async def test_repeated_failures_are_unavailable_without_internals() -> None:
    dead = [Started("rep-a"), RuntimeError("segfault at 0xdead")]
    fe, stream = make(dead, dead, dead)
    with pytest.raises(EngineUnavailable) as e:
        await collect(fe)
    assert "0xdead" not in str(e.value) and stream.cancelled.is_set()
    assert fe.in_flight() == []


async def test_a_failure_after_output_is_not_retried() -> None:
    fe, _ = make([*TOKENS, RuntimeError("engine dead")], [*TOKENS, DONE])
    events = fe.stream(REQ)
    assert [await anext(events) for _ in range(3)] == TOKENS
    with pytest.raises(EngineUnavailable):
        await anext(events)


async def test_a_stream_without_finish_is_unavailable() -> None:
    fe, _ = make(TOKENS)
    with pytest.raises(EngineUnavailable):
        await collect(fe)


async def test_duplicate_in_flight_ids_are_refused() -> None:
    fe, _ = make([*TOKENS, "hang"])
    events = fe.stream(REQ)
    await anext(events)
    with pytest.raises(AlreadyInFlight):
        await collect(fe)
    fe.abort("r1")
    assert [e async for e in events][-1].reason == "abort"  # type: ignore[union-attr]


def test_authentication() -> None:
    fe, _ = make([], keys=("k1", "k2"))
    fe.authenticate("Bearer k2")
    fe.authenticate("k1")
    for bad in (None, "", "Bearer nope", "Bearer k1x"):
        with pytest.raises(Unauthenticated):
            fe.authenticate(bad)
    open_fe, _ = make([])
    open_fe.authenticate(None)


def test_a_key_binds_its_requests_to_its_tenants() -> None:
    fe, _ = make([], keys=("bare", ("acme-key", ("acme", "acme-eu")), ("gw", ("*",))))
    bare, acme, gateway = (fe.authenticate(k) for k in ("bare", "acme-key", "gw"))

    def runs_as(credential: Credential, tenant: str) -> str:
        return fe.bind(credential, dataclasses.replace(REQ, tenant=tenant)).tenant

    # A request naming none runs as its key's first tenant.
    assert (runs_as(bare, ""), runs_as(acme, ""), runs_as(gateway, "")) == (
        "",
        "acme",
        "",
    )
    assert runs_as(acme, "acme-eu") == "acme-eu"
    assert runs_as(gateway, "anyone") == "anyone"
    for credential, tenant in [(bare, "acme"), (acme, "globex"), (bare, "x")]:
        with pytest.raises(PermissionDenied, match=f"tenant '{tenant}' is not allowed"):
            runs_as(credential, tenant)
    assert status_of(PermissionDenied("x")).grpc_code.name == "PERMISSION_DENIED"
    assert status_of(PermissionDenied("x")).http_status == 403


async def test_only_a_key_allowing_its_tenant_finds_a_request_to_abort() -> None:
    fe, _ = make([*TOKENS, "hang"], keys=(("a", ("acme",)), ("g", ("globex",))))
    events = fe.stream(dataclasses.replace(REQ, tenant="acme"))
    await anext(events)
    assert fe.abort("r1", fe.authenticate("g")) is False  # not there, for globex
    assert fe.abort("r1", fe.authenticate("a")) is True
    assert [e async for e in events][-1].reason == "abort"  # type: ignore[union-attr]


def test_text_is_encoded_as_vllms_completions_encode_it(tiny_model: Path) -> None:
    """A text prompt reaches the engine as the ids bare vLLM's completions give
    it (DeepSeek's BOS first); a chat prompt has the template's one BOS."""
    from transformers import AutoTokenizer

    from cluster.tiny_tokenizer import BOS

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    fe = Frontend(
        tokenizer=tok,
        facts=FACTS,
        limits=Limits(64, 100, 1000),
        api_keys=(),
        open_stream=lambda _req: ScriptedStream([]),
    )
    text = "hello world"
    # vLLM's completions: tokenizer(prompt, add_special_tokens=True).
    assert fe.encode_text(text) == tok(text, add_special_tokens=True).input_ids
    assert fe.encode_text(text)[0] == BOS.id
    chat = fe.encode_chat([{"role": "user", "content": text}], "messages")
    assert chat[0] == BOS.id and chat.count(BOS.id) == 1
