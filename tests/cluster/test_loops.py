import asyncio
import logging

import pytest

from cluster.loops import every


async def test_a_failing_step_is_logged_and_the_next_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []

    async def step() -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("flaky")

    log = logging.getLogger("test.loops")
    task = asyncio.create_task(every(0.01, step, what="the job", logger=log))
    while len(calls) < 4:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "the job failed: RuntimeError('flaky')" in caplog.text
    assert calls[:4] == [0, 1, 2, 3]


async def test_cancelling_stops_it_between_steps() -> None:
    ran = asyncio.Event()

    async def step() -> None:
        ran.set()

    task = asyncio.create_task(
        every(3600, step, what="x", logger=logging.getLogger("t"), first_after=0)
    )
    await asyncio.wait_for(ran.wait(), 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_interval_function_and_a_wake_event() -> None:
    calls: list[float] = []
    waits = iter([0.01, 0.01, 3600.0])  # then it waits for the event
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def step() -> None:
        calls.append(loop.time())

    task = asyncio.create_task(
        every(
            lambda: next(waits, 3600.0),
            step,
            what="x",
            logger=logging.getLogger("t"),
            first_after=0,
            wake=wake,
        )
    )
    try:
        while len(calls) < 3:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert len(calls) == 3  # waiting its long interval
        woken = loop.time()
        wake.set()
        while len(calls) < 4:
            await asyncio.sleep(0.005)
        assert calls[3] - woken < 0.5
        assert not wake.is_set()  # cleared for the next wait
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
