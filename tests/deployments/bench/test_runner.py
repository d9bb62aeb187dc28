"""The load generator against instant servers over real sockets."""

from __future__ import annotations

import pytest

from deployments.bench.backends import Backend, GrpcBackend, OpenAIBackend
from deployments.bench.runner import Limits, run_closed_loop, run_open_loop
from deployments.bench.workload import ClassSpec, LengthRange, Workload
from tests.deployments.bench.instant_servers import start_grpc, start_openai

WORKLOAD = Workload(
    classes=(
        ClassSpec(
            "realtime",
            share=1,
            input_len=LengthRange(4, 8),
            output_len=LengthRange(3, 6),
        ),
        ClassSpec(
            "background",
            share=1,
            input_len=LengthRange(4, 8),
            output_len=LengthRange(3, 6),
        ),
    ),
    vocab=(1, 50),
)


@pytest.fixture(params=["grpc", "openai"])
async def backend(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    if request.param == "grpc":
        server, target = await start_grpc()
        b: Backend = GrpcBackend(target)
        yield b
        await b.close()
        await server.stop(None)
    else:
        runner, url = await start_openai()
        b = OpenAIBackend(url)
        yield b
        await b.close()
        await runner.cleanup()


async def test_closed_loop_records_every_token(backend: Backend) -> None:
    records, duration = await run_closed_loop(
        backend, WORKLOAD.requests(), concurrency=4, limits=Limits(num_requests=40)
    )
    assert [r.index for r in records] == list(range(40))
    expected = list(__import__("itertools").islice(WORKLOAD.requests(), 40))
    for r, spec in zip(records, expected, strict=True):
        assert r.ok and r.qos == spec.qos
        assert r.output_tokens == spec.max_tokens == len(r.chunk_times)
        assert r.cached_tokens == len(spec.prompt) // 2
        assert r.prompt_tokens == len(spec.prompt) + 1  # as the server counted
        assert r.sent_s <= r.chunk_times[0] <= r.chunk_times[-1] <= r.end_s <= duration


async def test_open_loop_sends_on_schedule(backend: Backend) -> None:
    records, duration = await run_open_loop(
        backend, WORKLOAD.requests(rate=200.0), limits=Limits(duration_s=0.25)
    )
    assert 25 <= len(records) <= 80  # ~50 arrivals expected in 0.25 s
    for r in records:
        assert r.ok
        assert r.sent_s >= r.due_s - 0.001  # never early
    assert max(r.due_s for r in records) < 0.25 <= duration


async def test_refusals_are_recorded_not_raised(backend: Backend) -> None:
    w = Workload(classes=(ClassSpec(input_len=LengthRange(2, 2)),), vocab=(0, 1))
    records, _ = await run_closed_loop(
        backend, w.requests(), concurrency=2, limits=Limits(num_requests=4)
    )
    code = "RESOURCE_EXHAUSTED" if backend.name == "grpc" else "HTTP 429"
    assert [r.error for r in records] == [code] * 4
