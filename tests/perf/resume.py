"""What a resumed stream waits for, with the page store and without it.

    make bench-resume       # or: .venv/bin/python -m tests.perf.resume [--streams 4]

Two engine replicas of the tiny model (one core each). ``--streams`` greedy gRPC
streams, each a distinct 1024-token prompt and 256 output tokens, run on both;
once each has 64 tokens the app is scaled to one replica with a 1 s drain
timeout, so the stopped replica's streams are handed off and resumed on the other
(prompt + tokens so far, 1088 tokens). The resumed request's time to first token
is the seam the client sees: the longest pause in its stream. With the store
(``kvstore.enabled: true``) the new replica loads the saved blocks; without it,
it computes them again.

Writes ``tests/perf/results/resume.{json,md}``.
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
from tests.integration.test_kvstore import unique_prompt

RESULTS = Path(__file__).parent / "results"
APP = "moe-cluster-resume-bench"
PROMPT, OUTPUT, HAND_OFF_AFTER = 1024, 256, 64


def _config(model: str, store: bool, replicas: int) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "model": {"path": model},
            "engine": {
                "max_model_len": 2048,
                "kv_cache_memory_bytes": 256 << 20,
                "max_num_seqs": 16,
                "enforce_eager": True,
                "omp_num_threads": 1,
            },
            "deployment": {
                "num_replicas": replicas,
                "num_cpus": 1,
                "drain_timeout_s": 1,
            },
            "kvstore": {"enabled": store, "capacity_bytes": 512 << 20},
            "server": {"app_name": APP, "http_port": 18133, "grpc_port": 18134},
        }
    )


def _stream(client: Any, prompt: list[int], out: dict[str, Any]) -> None:
    import grpc

    from deployments.proto import inference_pb2 as pb

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True),
    )
    out["at"], out["tokens"] = [], 0
    try:
        for msg in client.generate(request, timeout=300):
            if msg.HasField("chunk"):
                out["at"].append(time.monotonic())
                out["tokens"] += len(msg.chunk.token_ids)
            else:
                out["finished"] = msg.finished
    except grpc.RpcError as e:
        out["error"] = f"{e.code().name}: {e.details()}"
        out["tokens"] = max(out["tokens"], HAND_OFF_AFTER)  # not waited for


def run(model: str, store: bool, streams: int) -> list[dict[str, Any]]:
    from ray import serve

    from deployments.app import deploy, prepare_model, scale_engines
    from deployments.ingress.client import InferenceClient
    from kvstore import actor as kv_actor

    config = prepare_model(_config(model, store, 2))
    deploy(config, external_scaler=True)
    try:
        client = InferenceClient(f"127.0.0.1:{config.server.grpc_port}", "", APP)
        _stream(client, unique_prompt(8), {})  # first-call costs out of the way
        outs: list[dict[str, Any]] = [{} for _ in range(streams)]
        threads = [
            threading.Thread(target=_stream, args=(client, unique_prompt(PROMPT), o))
            for o in outs
        ]
        for t in threads:
            t.start()
        while any(o.get("tokens", 0) < HAND_OFF_AFTER for o in outs):
            time.sleep(0.05)
        scale_engines(APP, 1)
        for t in threads:
            t.join(300)
        if failed := [o["error"] for o in outs if "error" in o]:
            raise RuntimeError(f"streams failed: {failed}")
        moved = []
        for o in outs:
            f = o["finished"]
            if f.migrations:
                gaps = [b - a for a, b in zip(o["at"], o["at"][1:], strict=False)]
                moved.append({"seam_ms": max(gaps) * 1e3, "cached": f.cached_tokens})
        return moved
    finally:
        serve.delete(APP)
        kv_actor.kill(APP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()

    import ray
    from ray import serve

    model = str(Path(".models/tiny-deepseek-v2").resolve())
    ray.init(num_cpus=2, include_dashboard=False, namespace="moe-cluster-bench")
    results: dict[str, Any] = {}
    try:
        for mode, store in (("store", True), ("no store", False)):
            results[mode] = run(model, store, args.streams)
            print(mode, results[mode], flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    lines = [
        "| mode | resumed streams | resumed TTFT p50 (ms) | max (ms) "
        "| cached tokens of each |",
        "|---|---|---|---|---|",
    ]
    for mode, moved in results.items():
        seams = [m["seam_ms"] for m in moved]
        cells = (
            f"{statistics.median(seams):.0f} | {max(seams):.0f}" if seams else "- | -"
        )
        cached = ", ".join(str(m["cached"]) for m in moved)
        lines.append(f"| {mode} | {len(moved)} | {cells} | {cached} |")
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "resume.json").write_text(json.dumps(results, indent=2))
    (RESULTS / "resume.md").write_text(
        "Written by `python -m tests.perf.resume` (2-core machine): streams of a "
        f"{PROMPT}-token prompt handed off after {HAND_OFF_AFTER} tokens by a "
        "scale-down, resumed on the other replica.\n\n" + table + "\n"
    )


if __name__ == "__main__":
    main()
