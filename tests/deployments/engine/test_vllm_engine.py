import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from cluster.platform import Backend, EnginePlatform
from cluster.qos import QoS
from deployments.engine.vllm_engine import VLLMEngine
from deployments.ep.group import GroupRank
from deployments.protocol import (
    EngineRequest,
    Finish,
    RequestRejected,
    Sampling,
    Started,
    TokenDelta,
)
from tests.deployments.engine.fakes import FakeAsyncLLM, Step

STEPS = [Step([5], "a"), Step([6, 7], "bc"), Step([8], "d", finish="length", cached=16)]


def request(rid: str = "r1", qos: QoS = QoS.NORMAL, tenant: str = "") -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=tuple(range(20)),
        sampling=Sampling(max_tokens=4, temperature=0.5, stop=("x",)),
        qos=qos,
        tenant=tenant,
    )


async def collect(engine: VLLMEngine, req: EngineRequest) -> list[object]:
    return [event async for event in engine.generate(req)]


async def test_a_stream_opens_with_started_and_ends_with_one_finish() -> None:
    llm = FakeAsyncLLM(STEPS)
    engine = VLLMEngine(llm, "replica-a")  # type: ignore[arg-type]
    events = await collect(engine, request(qos=QoS.REALTIME, tenant="acme"))

    assert events[0] == Started("replica-a")
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    assert [t for d in deltas for t in d.token_ids] == [5, 6, 7, 8]
    assert "".join(d.text for d in deltas) == "abcd"
    assert events[-1] == Finish("length", 20, 4, 16, "replica-a")
    assert sum(isinstance(e, Finish) for e in events) == 1
    prompt, params, rid, priority = llm.calls[0]
    # The tenant salts the prefix cache; the class is vLLM's priority.
    assert prompt["cache_salt"] == "acme"
    assert prompt["prompt_token_ids"] == list(range(20))
    assert (rid, priority) == ("r1", int(QoS.REALTIME))
    assert (params.max_tokens, params.temperature, params.stop) == (4, 0.5, ["x"])
    assert engine.tokens_generated == 4 and not llm.aborted


@pytest.mark.parametrize("interval_s", [0.0, 3600.0])
async def test_the_tokens_before_the_finish_say_it_follows(interval_s: float) -> None:
    # Sent at once (no interval) or held until the finish (one far off): either
    # way the last delta is marked, and only it, so a hop can send it with the
    # Finish.
    llm = FakeAsyncLLM(STEPS)
    engine = VLLMEngine(llm, "replica-a", stream_interval_s=interval_s)  # type: ignore[arg-type]
    events = await collect(engine, request())

    deltas = [e for e in events if isinstance(e, TokenDelta)]
    assert [t for d in deltas for t in d.token_ids] == [5, 6, 7, 8]
    assert [d.finishing for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert events[-2] is deltas[-1] and isinstance(events[-1], Finish)


async def test_a_consumer_that_goes_away_aborts_its_engine_request() -> None:
    hold = asyncio.Event()
    llm = FakeAsyncLLM(STEPS, hold=hold)
    engine = VLLMEngine(llm, "replica-a")  # type: ignore[arg-type]
    stream = engine.generate(request("gone"))
    assert isinstance(await anext(stream), Started)
    assert isinstance(await anext(stream), TokenDelta)
    assert engine.stats().request_ids == ("gone",)
    await stream.aclose()
    assert llm.aborted == ["gone"]
    assert engine.stats().request_ids == ()


async def test_an_engine_failure_raises_out_of_the_stream_without_a_finish() -> None:
    llm = FakeAsyncLLM(STEPS, fail_after=1, failure=RuntimeError("engine core died"))
    engine = VLLMEngine(llm, "replica-a")  # type: ignore[arg-type]
    seen: list[object] = []
    with pytest.raises(RuntimeError, match="engine core died"):
        async for event in engine.generate(request()):
            seen.append(event)
    assert not any(isinstance(e, Finish) for e in seen)


async def test_what_vllm_refuses_in_a_request_is_raised_as_the_requests_fault() -> None:
    from vllm.exceptions import VLLMValidationError

    # Refused by vLLM's SamplingParams (temperature above its 2.0)...
    engine = VLLMEngine(FakeAsyncLLM(STEPS), "replica-a")  # type: ignore[arg-type]
    hot = dataclasses.replace(
        request(), sampling=Sampling(max_tokens=4, temperature=2.5)
    )
    with pytest.raises(RequestRejected, match="temperature") as e:
        await collect(engine, hot)
    assert e.value.parameter == "temperature"
    # ... or when vLLM validates it at its first step.
    refused = VLLMValidationError("prompt too long", parameter="prompt")
    llm = FakeAsyncLLM(STEPS, fail_after=0, failure=refused)
    engine = VLLMEngine(llm, "replica-a")  # type: ignore[arg-type]
    with pytest.raises(RequestRejected, match="prompt too long") as e:
        await collect(engine, request())
    assert e.value.parameter == "prompt"
    assert llm.aborted == ["r1"] and engine.stats().request_ids == ()
    # An engine failure stays one.
    llm = FakeAsyncLLM(STEPS, fail_after=0, failure=RuntimeError("engine core died"))
    engine = VLLMEngine(llm, "replica-a")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        await collect(engine, request())


async def test_vllm_finish_reasons_map_onto_the_protocol_ones() -> None:
    for vllm_reason, ours in [("stop", "stop"), ("abort", "abort"), ("eos", "stop")]:
        llm = FakeAsyncLLM([Step([1], finish=vllm_reason)])
        engine = VLLMEngine(llm, "a")  # type: ignore[arg-type]
        finish = (await collect(engine, request()))[-1]
        assert isinstance(finish, Finish) and finish.reason == ours


async def test_stats_are_assembled_once_from_the_engine_its_node_and_group() -> None:
    engine = VLLMEngine(FakeAsyncLLM(), "replica-a")  # type: ignore[arg-type]
    assert engine.stats().attention_backend == ""  # not started: nothing read back
    engine.platform = EnginePlatform(Backend.CPU_MLA, "float32", 16, False)
    engine.warmed = (2, 32)
    group = GroupRank("g1", 1, 2, "10.0.0.1", 4242)
    stats = engine.stats("node-1", group)
    assert (stats.replica_id, stats.node_id) == ("replica-a", "node-1")
    assert (stats.group, stats.rank, stats.group_size) == ("g1", 1, 2)
    assert (stats.attention_backend, stats.dtype, stats.block_size) == (
        "CPU_MLA",
        "float32",
        16,
    )
    assert (stats.warmed_prefixes, stats.warmed_cached_tokens) == (2, 32)


async def test_has_work_covers_requests_begun_since_the_last_call() -> None:
    engine = VLLMEngine(FakeAsyncLLM(STEPS), "a")  # type: ignore[arg-type]
    assert not engine.has_work()
    await collect(engine, request())
    assert engine.has_work()  # it ran and finished since the last call
    assert not engine.has_work()


async def test_expert_load_is_polled_into_a_window_per_layer() -> None:
    llm = FakeAsyncLLM()
    engine = VLLMEngine(llm, "a")  # type: ignore[arg-type]
    await engine.measure_expert_load(60)
    await engine.poll_expert_load()
    load = engine.expert_load_snapshot()
    assert load is not None and load.layers == (1, 2)
    assert load.per_expert() == [1, 2, 2, 3]


async def test_warmup_records_what_it_loaded_and_runs_as_background() -> None:
    llm = FakeAsyncLLM([Step([1], finish="length", cached=32)])
    engine = VLLMEngine(llm, "a")  # type: ignore[arg-type]
    await engine.warm([([1, 2, 3], "", "t1"), (None, "hello", "")], timeout_s=5)
    assert engine.warmed == (2, 64)
    prompts = [c[0] for c in llm.calls]
    assert prompts[0]["cache_salt"] == "t1" and prompts[1]["prompt"] == "hello"
    assert {c[3] for c in llm.calls} == {int(QoS.BACKGROUND)}


async def test_tool_calls_in_the_output_become_calls_and_finish_with_tool_calls(
    tiny_model: object,
) -> None:
    # What a released checkpoint writes for a call, one token per engine step
    # (DeepSeek's tool-call tokens are single tokens of the tiny tokenizer).
    import json

    from transformers import AutoTokenizer

    from cluster.tiny_tokenizer import (
        TOOL_CALL_BEGIN,
        TOOL_CALL_END,
        TOOL_CALLS_BEGIN,
        TOOL_CALLS_END,
        TOOL_SEP,
    )

    tok = AutoTokenizer.from_pretrained(tiny_model)
    args = '{"city": "Rome"}'
    text = (
        f"Sure.{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}function{TOOL_SEP}get_weather"
        f"\n```json\n{args}\n```{TOOL_CALL_END}{TOOL_CALLS_END}"
    )
    ids = tok.encode(text, add_special_tokens=False)
    steps = [Step([i], tok.decode([i])) for i in ids]
    steps[-1] = dataclasses.replace(steps[-1], finish="stop")
    llm = FakeAsyncLLM(steps)
    llm.tokenizer = tok  # type: ignore[attr-defined]
    engine = VLLMEngine(llm, "replica-a")  # type: ignore[arg-type]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    req = dataclasses.replace(
        request(),
        sampling=Sampling(max_tokens=len(ids)),
        tool_parser="deepseek_v3",
        tools_json=json.dumps(tools),
    )
    events = await collect(engine, req)
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    assert "".join(d.text for d in deltas) == "Sure."
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0].name == "get_weather" and calls[0].id
    assert json.loads("".join(c.arguments for c in calls)) == json.loads(args)
    assert [t for d in deltas for t in d.token_ids] == ids  # every token still sent
    assert events[-1].reason == "tool_calls"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("qos", "woken"),
    [(QoS.REALTIME, True), (QoS.NORMAL, True), (QoS.BACKGROUND, False)],
)
async def test_a_request_that_is_not_background_wakes_the_engine_first(
    tmp_path: Path, qos: QoS, woken: bool
) -> None:
    from deployments.engine.realtime_board import RealtimeBoard

    # engine.background_cpu_yield: the engine's slot (its scheduler's; this
    # process plays the engine) and the frontend's view of the board.
    engine_side = RealtimeBoard(tmp_path / "board")
    llm = FakeAsyncLLM(STEPS)
    engine = VLLMEngine(llm, "replica-a")  # type: ignore[arg-type]
    engine.board = RealtimeBoard(tmp_path / "board", claim=False)
    # Another engine's view of the board (fresh for as long as the test runs).
    others = RealtimeBoard(tmp_path / "board", fresh_s=60, claim=False)
    sent = time.monotonic()
    await collect(engine, request(qos=qos))
    assert engine_side.woken_since(sent) is woken
    # A realtime request marks its engine before the engine's first step with it.
    assert others.others_hold_realtime(time.monotonic()) is (qos == QoS.REALTIME)
    others.close()
    engine.board.close()
    engine_side.close()
