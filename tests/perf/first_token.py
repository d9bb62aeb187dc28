"""The first token at one stream, by protocol and prompt form: where a server's
fixed cost per request shows.

    .venv/bin/python -m tests.perf.first_token [moe|vllm-uni|...] [--rounds N]
        [--server-args "..."] [--label L]

Starts one system as ``make bench-peers`` does (one replica, one core), then runs
``--rounds`` rounds, one request at a time: a ``GET /v1/models`` (the front door
alone: for moe-cluster HAProxy and the ingress's HTTP server), and two-token
streamed completions of S1's prompts (every one new to the server), sent as
text over HTTP (as bench-peers sends them), as token ids over HTTP and, for
moe-cluster, as token ids over gRPC. Prints each kind's p10 / p50 / p90 from
the request's start to its first chunk at the client, and appends them to
``tests/perf/results/first_token.jsonl``. With ``OTEL_TRACES_SAMPLER=always_on``
and an OTLP endpoint in the environment, moe-cluster traces every request, and
``python -m tests.perf.ttft_tail`` splits them hop by hop.

With ``--cpu-requests N`` it then measures the fixed CPU a request costs each
process of the system: the CPU each uses serving nothing for ``--cpu-idle``
seconds, then while N more two-token requests (text over HTTP, as bench-peers
sends them, every prompt new) are served one at a time; per process, what it
used less its idle rate over as long, divided by N. A two-token request is
almost all fixed cost: its admission, its stream's start and end, its
bookkeeping, one prefill and one decode step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import psutil

from deployments.bench.backends import Chunk, GrpcBackend
from deployments.bench.cli import text_prompts
from deployments.bench.workload import RequestSpec
from tests.perf.compare_peers import PEERS, PORT, RESULTS, S1, Server, is_moe
from tests.perf.peers import MODEL_DIR, NAME
from tests.perf.s1_profile import by_title, cpu, processes

MAX_TOKENS = 2


def _http(client: httpx.Client, prompt: str | list[int]) -> float:
    """Seconds to the first chunk with a choice in it; reads the rest."""
    body = {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    began = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            data = line[6:] if line.startswith("data: ") else "[DONE]"
            if first is None and data != "[DONE]" and json.loads(data).get("choices"):
                first = time.perf_counter() - began
    if first is None:
        raise RuntimeError("the stream ended without a choice")
    return first


async def _grpc(backend: GrpcBackend, spec: RequestSpec) -> float:
    began = time.perf_counter()
    first = None
    async for event in backend.stream(replace(spec, max_tokens=MAX_TOKENS)):
        if first is None and isinstance(event, Chunk):
            first = time.perf_counter() - began
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def _models(client: httpx.Client) -> float:
    began = time.perf_counter()
    client.get("/v1/models").raise_for_status()
    return time.perf_counter() - began


def measure(
    grpc: bool, rounds: int, specs: Iterator[RequestSpec]
) -> dict[str, list[float]]:
    text = text_prompts(str(MODEL_DIR))
    times: dict[str, list[float]] = {"models": [], "http_text": [], "http_ids": []}
    if grpc:
        times["grpc_ids"] = []
    loop = asyncio.new_event_loop()
    backend = None
    if grpc:
        asyncio.set_event_loop(loop)
        backend = GrpcBackend(f"127.0.0.1:{PORT + 1}")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=60) as client:
            for _ in range(20):  # connections open, every path warm
                _models(client)
            for _ in range(rounds):
                times["models"].append(_models(client))
                times["http_text"].append(_http(client, text(next(specs).prompt)))
                times["http_ids"].append(_http(client, list(next(specs).prompt)))
                if backend is not None:
                    spec = next(specs)
                    times["grpc_ids"].append(
                        loop.run_until_complete(_grpc(backend, spec))
                    )
    finally:
        if backend is not None:
            loop.run_until_complete(backend.close())
        loop.close()
    return times


def per_request(
    used: dict[str, float],
    idle_per_s: dict[str, float],
    wall_s: float,
    requests: int,
) -> dict[str, float]:
    """Milliseconds of CPU a request, per process title: what each used
    (``used``, seconds) serving ``requests`` one at a time for ``wall_s``, less
    what it uses serving nothing for as long (``idle_per_s``, seconds a second).
    A process that used no more than idle counts 0."""
    out = {}
    for name, seconds in used.items():
        extra = seconds - idle_per_s.get(name, 0.0) * wall_s
        out[name] = max(0.0, 1000 * extra / requests)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def fixed_cpu(
    procs: list[psutil.Process],
    specs: Iterator[RequestSpec],
    requests: int,
    idle_s: float,
) -> tuple[dict[str, float], dict[str, float]]:
    """(CPU ms a request less idle, idle CPU ms a second) per process title,
    with ``requests`` two-token text requests over HTTP one at a time."""
    text = text_prompts(str(MODEL_DIR))
    before = cpu(procs)
    time.sleep(idle_s)
    idle = {k: v / idle_s for k, v in by_title(before, cpu(procs)).items()}
    with httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=60) as client:
        _http(client, text(next(specs).prompt))  # the connection open
        before, began = cpu(procs), time.perf_counter()
        for _ in range(requests):
            _http(client, text(next(specs).prompt))
        used, wall = by_title(before, cpu(procs)), time.perf_counter() - began
    idle_ms = {k: 1000 * v for k, v in idle.items() if v > 0}
    return per_request(used, idle, wall, requests), idle_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    keys = [peer.key for peer in PEERS]
    p.add_argument("system", nargs="?", choices=keys, default="moe")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--label", default="")
    p.add_argument(
        "--cpu-requests",
        type=int,
        default=0,
        help="then this many two-token requests for each process's fixed CPU a "
        "request (less what it uses serving nothing)",
    )
    p.add_argument(
        "--cpu-idle",
        type=float,
        default=10.0,
        help="seconds of the server serving nothing, for the idle CPU subtracted",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="more arguments for the system's server (moe-cluster: e.g. "
        "--kvstore-json '{\"enabled\": false}')",
    )
    args = p.parse_args()
    base = next(peer for peer in PEERS if peer.key == args.system)
    extra = shlex.split(args.server_args)
    peer = base.with_args(extra)
    logs = Path(tempfile.mkdtemp(prefix="first-token-"))
    started = time.time()
    server = Server(peer, 1, logs / "server.log")
    fixed: dict[str, float] = {}
    idle: dict[str, float] = {}
    try:
        time.sleep(5.0)  # past the start's last work (warmup, first reports)
        specs = iter(S1.requests())  # one stream of prompts: none sent twice
        times = measure(is_moe(args.system), args.rounds, specs)
        if args.cpu_requests:
            procs = processes(started)
            fixed, idle = fixed_cpu(procs, specs, args.cpu_requests, args.cpu_idle)
    finally:
        server.stop()
    out: dict[str, object] = {
        "system": args.system,
        "label": args.label,
        "server_args": args.server_args,
    }
    if args.cpu_requests:
        out["cpu_requests"] = args.cpu_requests
        out["cpu_ms_per_request"] = {k: round(v, 3) for k, v in fixed.items() if v}
        out["idle_cpu_ms_per_s"] = {k: round(v, 1) for k, v in idle.items()}
        total = sum(fixed.values())
        print(
            f"{args.system} fixed CPU a request, less idle "
            f"({args.cpu_requests} two-token requests): {total:.2f} ms"
        )
        for name, ms in fixed.items():
            if ms >= 0.05:
                print(f"    {name:45s} {ms:7.2f} ms")
    for kind, values in times.items():
        v = sorted(1e3 * t for t in values)
        tenth = len(v) // 10
        p10, p50, p90 = v[tenth], statistics.median(v), v[len(v) - 1 - tenth]
        stats = f"p10 {p10:6.2f}  p50 {p50:6.2f}  p90 {p90:6.2f} ms"
        print(f"{args.system} {kind:10s} {stats}")
        out[kind] = {"p10": p10, "p50": p50, "p90": p90}
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / "first_token.jsonl").open("a") as f:
        f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
