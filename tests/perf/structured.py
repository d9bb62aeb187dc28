"""What a JSON-schema constraint costs per token: TPOT with and without it.

    make bench-structured     # or: .venv/bin/python -m tests.perf.structured

One engine replica of the tiny model (one core). Closed loop over OpenAI HTTP
streaming, ``--requests`` per point at concurrency 1 and 4, each request the same
chat prompt and ``OUTPUT`` tokens: unconstrained (``ignore_eos``), and under a JSON
schema whose every valid answer is an array of ``ITEMS`` integers (the grammar
decides where it ends; ``max_tokens`` only bounds it). TPOT is (last token time -
first token time) / (tokens - 1) per request, from the client's stream; TTFT
includes compiling the schema (xgrammar caches compiled grammars).

Writes ``tests/perf/results/structured.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig

RESULTS = Path(__file__).parent / "results"
APP = "moe-cluster-structured-bench"
ITEMS = 48
OUTPUT = 160
SCHEMA = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": ITEMS,
            "maxItems": ITEMS,
        }
    },
    "required": ["values"],
    "additionalProperties": False,
}


def _config(model: str) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "model": {"path": model},
            "engine": {
                "max_model_len": 2048,
                "kv_cache_memory_bytes": 256 << 20,
                "max_num_seqs": 16,
                "omp_num_threads": 1,
            },
            "deployment": {"num_replicas": 1, "num_cpus": 1},
            "server": {"app_name": APP, "http_port": 18143, "grpc_port": 18144},
        }
    )


def _one(client: Any, constrained: bool, out: list[dict[str, Any]]) -> None:
    extra: dict[str, Any] = {"ignore_eos": True}
    if constrained:
        fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}
        extra = {"response_format": fmt}
    start = time.monotonic()
    first = last = None
    text = []
    stream = client.chat.completions.create(
        model="tiny-deepseek-v2",
        messages=[{"role": "user", "content": "List some numbers."}],
        max_tokens=OUTPUT if not constrained else 4 * OUTPUT,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.monotonic()
            first = first or now
            last = now
            text.append(chunk.choices[0].delta.content)
    assert usage is not None and first is not None and last is not None
    n = usage.completion_tokens
    if constrained:
        assert len(json.loads("".join(text))["values"]) == ITEMS  # it obeyed
    out.append(
        {
            "ttft_ms": (first - start) * 1e3,
            "tpot_ms": (last - first) / max(n - 1, 1) * 1e3,
            "tokens": n,
        }
    )


def point(client: Any, constrained: bool, concurrency: int, requests: int) -> Any:
    out: list[dict[str, Any]] = []
    left = [requests]
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            _one(client, constrained, out)

    t = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t
    return {
        "tpot_ms_p50": statistics.median(o["tpot_ms"] for o in out),
        "ttft_ms_p50": statistics.median(o["ttft_ms"] for o in out),
        "tokens_mean": statistics.mean(o["tokens"] for o in out),
        "output_tok_s": sum(o["tokens"] for o in out) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()

    import openai
    import ray
    from ray import serve

    from deployments.app import deploy, prepare_model

    model = str(Path(".models/tiny-deepseek-v2").resolve())
    ray.init(num_cpus=2, include_dashboard=False, namespace="moe-cluster-bench")
    results: dict[str, Any] = {}
    try:
        config = prepare_model(_config(model))
        deploy(config)
        base = f"http://127.0.0.1:{config.server.http_port}/v1"
        client = openai.OpenAI(base_url=base, api_key="-")
        _one(client, True, [])  # first-call costs (and the schema's compile) first
        _one(client, False, [])
        for c in (1, 4):
            for name, constrained in (("none", False), ("json_schema", True)):
                key = f"{name} c={c}"
                results[key] = point(client, constrained, c, args.requests)
                print(key, results[key], flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    lines = [
        "| constraint | concurrency | TPOT p50 (ms) | TTFT p50 (ms) | tokens "
        "| output tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        name, c = key.split(" c=")
        lines.append(
            f"| {name} | {c} | {r['tpot_ms_p50']:.2f} | {r['ttft_ms_p50']:.0f} "
            f"| {r['tokens_mean']:.0f} | {r['output_tok_s']:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "structured.json").write_text(json.dumps(results, indent=2))
    (RESULTS / "structured.md").write_text(
        "Written by `python -m tests.perf.structured` (2-core machine, one engine "
        f"replica): {args.requests} chat requests per point, unconstrained "
        f"({OUTPUT} tokens) against a JSON schema of {ITEMS} integers.\n\n"
        + table
        + "\n"
    )


if __name__ == "__main__":
    main()
