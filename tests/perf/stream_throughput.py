"""Tokens/s of greedy streams over gRPC against a running moe-cluster.

    .venv/bin/python -m tests.perf.stream_throughput --streams 1 8 --max-tokens 256

Prints, per concurrency level: output tokens/s over all streams, per-stream
tokens/s, mean time to first token and mean inter-token gap. A measurement, not a
test: the full benchmark CLI with workloads and SLOs supersedes it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from deployments.client import InferenceClient
from deployments.proto import inference_pb2 as pb


@dataclass(frozen=True)
class StreamResult:
    tokens: int
    ttft_s: float
    duration_s: float


def one_stream(target: str, api_key: str, i: int, max_tokens: int) -> StreamResult:
    client = InferenceClient(target, api_key)
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[100 + i, 200 + i, 300 + i]),
        sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )
    start = time.perf_counter()
    first = None
    tokens = 0
    for msg in client.generate(request, timeout=600):
        if msg.HasField("chunk"):
            if first is None:
                first = time.perf_counter() - start
            tokens += len(msg.chunk.token_ids)
    client.close()
    return StreamResult(tokens, first or 0.0, time.perf_counter() - start)


def run(
    target: str, api_key: str, streams: int, max_tokens: int, quiet: bool = False
) -> None:
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(
            pool.map(
                lambda i: one_stream(target, api_key, i, max_tokens), range(streams)
            )
        )
    wall = time.perf_counter() - start
    if quiet:
        return
    total = sum(r.tokens for r in results)
    per_stream = statistics.mean(r.tokens / r.duration_s for r in results)
    ttft = statistics.mean(r.ttft_s for r in results)
    itl = statistics.mean(
        (r.duration_s - r.ttft_s) / max(r.tokens - 1, 1) for r in results
    )
    print(
        f"streams={streams:3d}  tokens={total:6d}  wall={wall:6.2f}s  "
        f"output={total / wall:7.1f} tok/s  per-stream={per_stream:6.1f} tok/s  "
        f"ttft={ttft * 1000:6.1f} ms  itl={itl * 1000:5.1f} ms",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="127.0.0.1:9000")
    p.add_argument("--api-key", default="")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds per level")
    args = p.parse_args()
    for n in args.streams:
        for _ in range(args.warmup):
            run(args.target, args.api_key, n, 16, quiet=True)
        run(args.target, args.api_key, n, args.max_tokens)


if __name__ == "__main__":
    main()
