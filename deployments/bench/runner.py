"""When to send: closed loop at a fixed concurrency or open loop at Poisson arrivals.

Every request gets a ``RequestRecord`` with times relative to the run's start
(``time.perf_counter``): when it was due, sent, each chunk, and the end.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from deployments.bench.backends import Backend, Chunk, Done, RequestFailed
from deployments.bench.workload import RequestSpec


@dataclass(slots=True)
class RequestRecord:
    index: int
    qos: str
    prompt_tokens: int  # as the server counted them when it says; else ids sent
    max_tokens: int
    prefix_group: int | None
    due_s: float  # planned arrival (open loop); send time in closed loop
    sent_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_s: float = 0.0
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.sent_s if self.chunk_times else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.chunk_times or self.output_tokens < 2:
            return None
        return (self.end_s - self.chunk_times[0]) / (self.output_tokens - 1)

    def itls_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]


@dataclass(frozen=True, slots=True)
class Limits:
    """When to stop sending: after ``num_requests`` or ``duration_s`` (first met)."""

    num_requests: int | None = None
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give a number of requests or a duration")


async def send_one(
    backend: Backend, spec: RequestSpec, t0: float, due_s: float
) -> RequestRecord:
    rec = RequestRecord(
        spec.index,
        spec.qos,
        len(spec.prompt),
        spec.max_tokens,
        spec.prefix_group,
        due_s,
    )
    rec.sent_s = time.perf_counter() - t0
    try:
        async for event in backend.stream(spec):
            if isinstance(event, Chunk):
                rec.chunk_times.append(time.perf_counter() - t0)
                rec.chunk_tokens.append(event.tokens)
            elif isinstance(event, Done):
                rec.output_tokens = event.output_tokens or 0
                rec.cached_tokens = event.cached_tokens
                # Cached shares and token rates count the server's tokens.
                rec.prompt_tokens = event.prompt_tokens or rec.prompt_tokens
    except RequestFailed as e:
        rec.error = e.code
    except Exception as e:  # a client-side failure is a result too, not a crash
        rec.error = type(e).__name__
    rec.end_s = time.perf_counter() - t0
    if rec.ok and not rec.output_tokens:  # the server did not count them
        rec.output_tokens = sum(rec.chunk_tokens)
    return rec


async def run_closed_loop(
    backend: Backend,
    requests: Iterator[RequestSpec],
    concurrency: int,
    limits: Limits,
    on_done: Callable[[RequestRecord], None] = lambda _: None,
) -> tuple[list[RequestRecord], float]:
    """``concurrency`` workers each send a request as soon as their last one ends."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    budget = limits.num_requests

    def take() -> RequestSpec | None:
        nonlocal budget
        if budget is not None:
            if budget == 0:
                return None
            budget -= 1
        if (
            limits.duration_s is not None
            and time.perf_counter() - t0 >= limits.duration_s
        ):
            return None
        return next(requests)

    async def worker() -> None:
        while (spec := take()) is not None:
            rec = await send_one(backend, spec, t0, time.perf_counter() - t0)
            records.append(rec)
            on_done(rec)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index), time.perf_counter() - t0


async def run_open_loop(
    backend: Backend,
    requests: Iterator[RequestSpec],
    limits: Limits,
    on_done: Callable[[RequestRecord], None] = lambda _: None,
) -> tuple[list[RequestRecord], float]:
    """Sends each request at its planned arrival, whether or not others finished.
    A run that ``limits.duration_s`` ends lasts at least that long: the window's
    last arrivals may finish before it closes, and rates are over the window."""
    records: list[RequestRecord] = []
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()

    async def one(spec: RequestSpec) -> None:
        rec = await send_one(backend, spec, t0, spec.arrival_s)
        records.append(rec)
        on_done(rec)

    window = None  # the duration that ended the sending, if it did
    for sent, spec in enumerate(requests):
        if limits.num_requests is not None and sent >= limits.num_requests:
            break
        if limits.duration_s is not None and spec.arrival_s >= limits.duration_s:
            window = limits.duration_s
            break
        delay = spec.arrival_s - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(spec))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    while window is not None and (left := window - (time.perf_counter() - t0)) > 0:
        await asyncio.sleep(left)
    return sorted(records, key=lambda r: r.index), time.perf_counter() - t0
