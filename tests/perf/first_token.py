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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from deployments.bench.backends import Chunk, GrpcBackend
from deployments.bench.cli import text_prompts
from deployments.bench.workload import RequestSpec
from tests.perf.compare_peers import PEERS, PORT, RESULTS, S1, Server, is_moe
from tests.perf.peers import MODEL_DIR, NAME

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


def measure(grpc: bool, rounds: int) -> dict[str, list[float]]:
    specs = iter(S1.requests())
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    keys = [peer.key for peer in PEERS]
    p.add_argument("system", nargs="?", choices=keys, default="moe")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--label", default="")
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
    server = Server(peer, 1, logs / "server.log")
    try:
        time.sleep(5.0)  # past the start's last work (warmup, first reports)
        times = measure(is_moe(args.system), args.rounds)
    finally:
        server.stop()
    out: dict[str, object] = {
        "system": args.system,
        "label": args.label,
        "server_args": args.server_args,
    }
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
