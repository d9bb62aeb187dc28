"""The load generator's own cost, measured against servers that answer instantly.

    .venv/bin/python -m tests.perf.bench_overhead

With an instant server every millisecond of a request's end-to-end latency is the
generator plus the transport; compare it with the latency of a real server.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from multiprocessing import Queue

from deployments.bench.backends import Backend, GrpcBackend, OpenAIBackend
from deployments.bench.report import Slo, summarize
from deployments.bench.runner import Limits, run_closed_loop
from deployments.bench.workload import ClassSpec, LengthRange, Workload
from tests.deployments.bench.instant_servers import start_grpc, start_openai

OUTPUT_TOKENS = 64
REQUESTS = 400
CONCURRENCY = 16


async def measure(name: str, backend: Backend) -> None:
    workload = Workload(
        classes=(
            ClassSpec(
                input_len=LengthRange(128, 128),
                output_len=LengthRange(OUTPUT_TOKENS, OUTPUT_TOKENS),
            ),
        )
    )
    prompts = workload.requests()  # the warmup's are not sent again
    await run_closed_loop(backend, prompts, CONCURRENCY, Limits(20))
    records, duration = await run_closed_loop(
        backend, prompts, CONCURRENCY, Limits(REQUESTS)
    )
    s = summarize(records, duration, Slo())["all"]
    if s["errors"]:
        raise SystemExit(f"{name}: requests failed: {s['errors']}")
    print(
        f"{name:7s} {REQUESTS} req x {OUTPUT_TOKENS} tok, concurrency {CONCURRENCY}: "
        f"e2e mean {s['e2e_ms']['mean']:.1f} ms p99 {s['e2e_ms']['p99']:.1f} ms, "
        f"ttft p50 {s['ttft_ms']['p50']:.2f} ms, itl p50 {s['itl_ms']['p50']:.3f} ms; "
        f"sustains {s['request_rate']:.0f} req/s, {s['output_tok_s']:.0f} tok/s"
    )


def serve(kind: str, address: Queue) -> None:  # type: ignore[type-arg]
    """Runs one instant server in this (child) process until killed."""

    async def run() -> None:
        if kind == "grpc":
            _, target = await start_grpc()
        else:
            _, target = await start_openai()
        address.put(target)
        await asyncio.Event().wait()

    asyncio.run(run())


def main() -> None:
    # The server runs in its own process (own core), so the numbers are the
    # generator's cost plus the loopback transport, not the server's.
    ctx = multiprocessing.get_context("spawn")
    for kind in ("grpc", "openai"):
        address = ctx.Queue()
        proc = ctx.Process(target=serve, args=(kind, address), daemon=True)
        proc.start()
        target = address.get(timeout=60)

        async def go(k: str = kind, t: str = target) -> None:
            # grpc.aio binds a channel to the event loop it is created in.
            b: Backend = GrpcBackend(t) if k == "grpc" else OpenAIBackend(t)
            await measure(k, b)
            await b.close()

        asyncio.run(go())
        proc.kill()


if __name__ == "__main__":
    main()
