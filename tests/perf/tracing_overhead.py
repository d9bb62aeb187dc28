"""S1 (one engine replica, closed loop) with tracing off and on at ratio 1.0, in
one run: each phase starts `moe-cluster serve` afresh (tracing is chosen before
Ray starts), drives it over gRPC at 1 and 4 streams, and stops it gracefully.

    .venv/bin/python -m tests.perf.tracing_overhead [--rounds 2]

With tracing on every request is traced (a sampled client ``traceparent`` is not
needed at ratio 1.0) and exported over OTLP/gRPC to a receiver in this process,
which counts what arrives.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml

from deployments.bench.backends import GrpcBackend
from deployments.bench.report import Slo, summarize
from deployments.bench.runner import Limits, run_closed_loop
from deployments.bench.workload import ClassSpec, LengthRange, RequestSpec, Workload
from tests.otlp_receiver import OTLPReceiver

CONFIG = Path("cluster/configs/tiny-cpu.yaml")
S1 = Workload(
    (
        ClassSpec(
            "normal", input_len=LengthRange(128, 128), output_len=LengthRange(64, 64)
        ),
    ),
    seed=1,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """`moe-cluster serve` with one engine replica, in a child process."""

    def __init__(self, traces_endpoint: str | None, log: Path) -> None:
        config = yaml.safe_load(CONFIG.read_text())
        self.http, self.grpc = free_port(), free_port()
        config["deployment"]["num_replicas"] = 1
        config["server"] |= {"http_port": self.http, "grpc_port": self.grpc}
        fd, self._config = tempfile.mkstemp(suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "RAY_SERVE_TRACING"))
        }
        if traces_endpoint is not None:
            env |= {
                "OTEL_EXPORTER_OTLP_ENDPOINT": traces_endpoint,
                "OTEL_TRACES_SAMPLER": "always_on",
            }
        self._log = log.open("w")
        cli = Path(sys.executable).parent / "moe-cluster"
        self.proc = subprocess.Popen(
            [str(cli), "serve", "--config", self._config],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited; see {log}")
            if "is serving" in log.read_text():
                return
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"serve not ready in 300 s; see {log}")

    def stop(self) -> None:
        """SIGTERM: serve shuts each vLLM engine down, then Ray."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            print("serve did not stop in 120 s", file=sys.stderr)
        self._log.close()
        os.unlink(self._config)


def cluster_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root``'s process tree (Ray, proxies, replicas,
    vLLM's engine cores)."""
    total = 0.0
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def s1(
    target: str,
    concurrency: int,
    n: int,
    root: int,
    prompts: Iterator[RequestSpec],
) -> dict[str, Any]:
    """The S1 summary, plus ``cpu_ms_per_request``: the cluster's CPU time per
    request, less noisy on a shared machine than tokens per second. ``prompts``
    goes on from the cluster's last point: none is sent twice (the page store
    would answer it)."""
    backend = GrpcBackend(target)
    try:
        await run_closed_loop(backend, prompts, concurrency, Limits(4))
        cpu = cluster_cpu_s(root)
        records, duration = await run_closed_loop(
            backend, prompts, concurrency, Limits(n)
        )
        cpu = cluster_cpu_s(root) - cpu
    finally:
        await backend.close()
    out: dict[str, Any] = summarize(records, duration, Slo())["all"]
    return out | {"cpu_ms_per_request": cpu * 1000 / n}


def phase(
    name: str, traced: bool, receiver: OTLPReceiver, logs: Path
) -> dict[str, Any]:
    cluster = Cluster(receiver.endpoint if traced else None, logs / f"{name}.log")
    try:
        before = len(receiver.spans())
        target, prompts = f"127.0.0.1:{cluster.grpc}", S1.requests()
        out = {
            c: asyncio.run(s1(target, c, n, cluster.proc.pid, prompts))
            for c, n in ((1, 24), (4, 48))
        }
        time.sleep(2)  # the last batches of spans
        spans = len(receiver.spans()) - before
    finally:
        cluster.stop()
    for c, s in out.items():
        if s["errors"]:
            raise SystemExit(f"{name} c={c}: {s['errors']} requests failed")
        print(
            f"{name:12s} c={c}: {s['output_tok_s']:6.1f} tok/s, "
            f"TTFT p50 {s['ttft_ms']['p50']:6.1f} ms, TPOT p50 "
            f"{s['tpot_ms']['p50']:5.2f} ms, cluster CPU "
            f"{s['cpu_ms_per_request']:5.1f} ms/request, spans exported {spans}",
            flush=True,
        )
    return {
        "spans": spans,
        **{c: s["output_tok_s"] for c, s in out.items()},
        **{f"cpu{c}": s["cpu_ms_per_request"] for c, s in out.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    receiver = OTLPReceiver(free_port()).start()
    logs = Path(tempfile.mkdtemp(prefix="tracing-overhead-"))
    results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    try:
        for r in range(args.rounds):
            for traced in (False, True):
                name = f"{'on ' if traced else 'off'} (run {r + 1})"
                results[traced].append(phase(name, traced, receiver, logs))
    finally:
        receiver.stop()
    for c in (1, 4):
        off = statistics.median(x[c] for x in results[False])
        on = statistics.median(x[c] for x in results[True])
        cpu_off = statistics.median(x[f"cpu{c}"] for x in results[False])
        cpu_on = statistics.median(x[f"cpu{c}"] for x in results[True])
        print(
            f"S1 c={c}: tracing off {off:.1f} tok/s, on (ratio 1.0) {on:.1f} tok/s: "
            f"{(on / off - 1) * 100:+.1f}%; cluster CPU per request {cpu_off:.1f} "
            f"-> {cpu_on:.1f} ms ({(cpu_on / cpu_off - 1) * 100:+.1f}%)"
        )
    assert all(x["spans"] > 0 for x in results[True]), "no spans arrived"
    assert all(x["spans"] == 0 for x in results[False]), "spans with tracing off"
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
