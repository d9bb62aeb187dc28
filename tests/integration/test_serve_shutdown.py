"""Stopping `moe-cluster serve` (SIGTERM, as Ctrl-C or Kubernetes sends it) while a
stream runs: the stream runs to its end; a request sent meanwhile is refused with
UNAVAILABLE / 503 and a retry hint (not left hanging, not Serve's 404 of an app
already gone) and health checks say NOT_SERVING; the command exits 0 and leaves
none of its processes running. With one engine on the node, the engine core
computes on a core of its own (engine.cpu_cores: reserved).

Its own cluster, in a child process, beside the session's (which idles)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deployments.cli import DEFAULT_CONFIG
from deployments.proto import inference_pb2 as pb
from deployments.proto import inference_pb2_grpc as pb_grpc
from tests.integration.conftest import ENGINE, free_port
from tests.otlp_receiver import untraced_env

MAX_TOKENS = 600  # runs well past the signal on either CPU


def _request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
    )


def _main_thread_cores(p: psutil.Process) -> set[int] | None:
    try:
        return os.sched_getaffinity(p.pid)
    except ProcessLookupError:
        return None


def check_core_layout(tree: list[psutil.Process], log: str) -> None:
    """engine.cpu_cores reserved with one one-thread engine: its engine core's main
    thread computes on the node's last core, alone; every other process the
    command started, Ray's included, and the engine core's other threads run on
    the other cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        assert "engines share the cores" in log, log
        return
    slot, serving = {cores[-1]}, set(cores[:-1])
    assert f"engines on cores {cores[-1]} (one slot each)" in log, log
    engines = []
    for p in tree:
        try:
            if p.cmdline()[:1] == ["VLLM::EngineCore"]:
                engines.append(p)
        except (psutil.NoSuchProcess, IndexError):
            pass
    assert len(engines) == 1, engines
    pid = engines[0].pid
    assert os.sched_getaffinity(pid) == slot
    threads = {int(t) for t in os.listdir(f"/proc/{pid}/task")} - {pid}
    assert threads and all(os.sched_getaffinity(t) == serving for t in threads)
    elsewhere = {p.pid: _main_thread_cores(p) for p in tree if p.pid != pid}
    assert all(c in (serving, None) for c in elsewhere.values()), elsewhere


@pytest.mark.timeout(600)
def test_stopping_serve_lets_streams_finish_and_refuses_new_ones(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = yaml.safe_load(Path(DEFAULT_CONFIG).read_text())
    http, grpc_port = free_port(), free_port()
    config["model"]["path"] = str(tiny_model)
    config["engine"] |= {
        k: ENGINE[k] for k in ("attention_backend", "kv_cache_memory_bytes")
    }
    config["deployment"] |= {"num_replicas": 1, "drain_timeout_s": 60}
    several = len(os.sched_getaffinity(0)) >= 2
    config["engine"]["cpu_cores"] = "reserved" if several else "shared"
    config["server"] |= {"http_port": http, "grpc_port": grpc_port}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "serve.log"
    cli = Path(sys.executable).parent / "moe-cluster"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(cli), "serve", "--config", str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=untraced_env(),
        )
    try:
        deadline = time.monotonic() + 300
        while "is serving" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "serve not ready in 300 s"
            time.sleep(1)
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.InferenceStub(channel)
        serving = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30
        )
        assert serving.status == health_pb2.HealthCheckResponse.SERVING
        check_core_layout(tree, log.read_text())
        late: list[tuple[object, str]] = []

        def send_late() -> None:
            try:
                list(stub.Generate(_request(4), timeout=30))
                late.append(("OK", ""))
            except grpc.RpcError as e:
                late.append((e.code(), e.details() or ""))
            r = httpx.post(
                f"http://127.0.0.1:{http}/v1/completions",
                json={"model": "tiny-deepseek-v2", "prompt": "hi", "max_tokens": 2},
                timeout=30,
            )
            late.append((r.status_code, r.text))
            late.append(("Retry-After", r.headers.get("Retry-After", "")))
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=30
            )
            late.append(("health", health.status))
            r = httpx.get(f"http://127.0.0.1:{http}/health", timeout=30)
            late.append((r.status_code, r.text))

        tokens, finished, stopped_at = 0, None, 0.0
        for msg in stub.Generate(_request(MAX_TOKENS), timeout=300):
            if msg.HasField("chunk"):
                tokens += len(msg.chunk.token_ids)
                if not stopped_at and tokens >= 20:
                    proc.send_signal(signal.SIGTERM)
                    stopped_at = time.monotonic()
                    while "stopping" not in log.read_text():
                        assert time.monotonic() < stopped_at + 30, "no stop begun"
                        time.sleep(0.05)
                    sender = threading.Thread(target=send_late, daemon=True)
                    sender.start()
            elif msg.HasField("finished"):
                finished = msg.finished
        assert finished is not None and tokens == MAX_TOKENS
        assert finished.finish_reason == "length"
        sender.join(60)
        grpc_answer, http_answer, retry, health, http_health = late
        assert grpc_answer[0] == grpc.StatusCode.UNAVAILABLE, late
        assert "shutting down" in grpc_answer[1] and "retry after" in grpc_answer[1]
        assert http_answer[0] == 503, late
        assert '"error"' in http_answer[1] and "shutting down" in http_answer[1]
        assert retry == ("Retry-After", "1")
        # Health says the cluster is going: a balancer that probes it stops here.
        assert health == ("health", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert http_health == (503, '{"status":"unavailable"}'), http_health
        assert proc.wait(180) == 0, log.read_text()[-3000:]
        # Ray's own processes (its dashboard's heads) end a moment after it.
        _, alive = psutil.wait_procs(tree, timeout=30)
        left = []
        for p in alive:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append((p.pid, p.name()))
            except psutil.NoSuchProcess:
                pass
        assert not left, f"still running after serve exited: {left}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(180)
