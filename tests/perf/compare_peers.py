"""The same tiny model and workloads served by moe-cluster and by its peers.

    make bench-peers        # or: .venv/bin/python -m tests.perf.compare_peers

Peers, each started alone on this machine with one core per engine replica:
bare vLLM (``vllm serve`` as it runs by default; with ``--disable-log-stats``;
and with the single-process executor moe-cluster's CPU engines use), Ray Serve
LLM (default router, and its PrefixCacheAffinityRouter), and moe-cluster (in S3
also with ``router.policy: prefix``; its default is least-loaded). vLLM's
per-step statistics and Prometheus metrics are on wherever a peer runs by
default: in ``vllm serve``, in Ray Serve LLM (``log_engine_metrics``) and in
moe-cluster; the statistics-off column shows what they cost bare vLLM. All are
driven over OpenAI HTTP by ``moe-cluster bench``'s load generator with the same
seeded workloads:

- S1: one replica, closed loop, one and four streams at a time (serving
  overhead), 144 and 432 requests of 128 + 64 tokens (~45-55 s a point on 2
  cores). No prompt is sent twice to one server, warmup included, so no prefix
  cache (vLLM's, or moe-cluster's page store) answers any part of one;
- S2: one replica, a realtime stream (0.5 req/s) under a background flood at 2x
  the baseline's measured capacity (Poisson, 30 s);
- S3: two replicas, 4 shared prefixes of 512 tokens + 32 distinct tokens each,
  8 streams (prefix reuse across replicas);
- S3b: two replicas with 64 MiB of KV cache each, 32 shared prefixes of ~1,600
  tokens + ~100 distinct, 16 output tokens, 4 streams for 90 s: a prefix working
  set 3-4x one engine's cache, which only a shared store can hold.
- S3c: a replica joins a warm cluster. One replica serves 8 shared prefixes of
  ~1,600 tokens + ~100 distinct, 16 output tokens, 4 streams, for 30 s; then a
  second replica is added (as an external autoscaler does) while the load goes on
  for 90 s. Reported: the whole 90 s, and the 20 s after the new replica runs.

Prompts are sent as text (the seeded token ids decoded with the model's
tokenizer), the form every peer's router understands; random ids decode to text
that re-tokenizes to ~1.2x the nominal lengths, the same text for every peer.

moe-cluster runs every scenario over its gRPC API too (rows "gRPC: ..."), held
against the peers' HTTP figures: the others serve OpenAI HTTP only. Its gRPC
prompts are the token ids the servers get from that text, so both APIs carry
the same prompts. S1, S2 and S3 go on over gRPC on the server their HTTP run
used, with prompts that server has not seen (S2's flood drawn with another
seed); S3b and S3c start a fresh server for it. The Serve-proxy setting runs S1
over both, the prefix policy S3.

Writes ``tests/perf/results/peers-<backend>.json`` (summaries) and
``peers-<backend>.md`` (the table of ratios), named by the engines' attention
backend (``amx_mla`` on a CPU with AMX, ``cpu_mla`` on any other), so a later
change can be compared with this one on the same kind of CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import psutil

from deployments.bench.backends import Backend, GrpcBackend, OpenAIBackend
from deployments.bench.cli import text_prompt_ids, text_prompts
from deployments.bench.report import Slo, summarize, summarize_group
from deployments.bench.runner import Limits, run_closed_loop, run_open_loop
from deployments.bench.workload import (
    ClassSpec,
    LengthRange,
    PrefixGroups,
    RequestSpec,
    Workload,
)
from tests.perf.peers import ENV, MODEL_DIR, NAME, vllm_command

RESULTS = Path(__file__).parent / "results"
PORT = 8100
READY_TIMEOUT_S = 400
REALTIME_SLO = Slo(ttft_ms=1000)


def lengths(n: int) -> LengthRange:
    return LengthRange(n, n)


S1 = Workload(
    (ClassSpec("normal", input_len=lengths(128), output_len=lengths(64)),), seed=1
)
FLOOD_SHAPE = ClassSpec("background", input_len=lengths(128), output_len=lengths(64))
S3 = Workload(
    (ClassSpec("normal", input_len=lengths(32), output_len=lengths(32)),),
    prefix=PrefixGroups(4, 512),
    seed=3,
)
# Nominal lengths: the prompts, sent as text, re-tokenize to ~1.2x (~1,600 + ~100).
S3B = Workload(
    (ClassSpec("normal", input_len=lengths(84), output_len=lengths(16)),),
    prefix=PrefixGroups(32, 1330),
    seed=5,
)
S3B_KV_CACHE_MIB = 64
S3B_SECONDS = 90.0
S3C = Workload(
    (ClassSpec("normal", input_len=lengths(84), output_len=lengths(16)),),
    prefix=PrefixGroups(8, 1330),
    seed=6,
)
S3C_WARM_S = 30.0  # one replica, before the second is added
S3C_SECONDS = 90.0  # from the moment the second is asked for
S3C_AFTER_S = 20.0  # "after": requests sent this long after the new one runs
SCENARIOS = ("S1", "S2", "S3", "S3b", "S3c")


@dataclass(frozen=True)
class Peer:
    key: str
    label: str
    command: Callable[[int], list[str]]  # replicas -> argv
    scenarios: tuple[str, ...]
    uses_ray: bool = True
    env: tuple[tuple[str, str], ...] = ()
    # Of ``scenarios``, those also run over moe-cluster's gRPC API.
    grpc: tuple[str, ...] = ()

    def with_args(self, extra: Sequence[str]) -> Peer:
        """This peer, its server started with ``extra`` after its own arguments."""
        command, more = self.command, tuple(extra)
        return replace(self, command=lambda replicas: [*command(replicas), *more])


def is_moe(key: str) -> bool:
    """Whether peer ``key`` is moe-cluster (in some setting), which the table's
    ratios hold against the others."""
    return key.startswith("moe")


def _module(*args: str) -> Callable[[int], list[str]]:
    def argv(replicas: int) -> list[str]:
        module = [sys.executable, "-m", "tests.perf.peers", *args]
        return [*module, "--port", str(PORT), "--replicas", str(replicas)]

    return argv


# vLLM's CPU default runs the model in a worker process beside the engine core,
# both spinning; moe-cluster's CPU engines run it in the engine core
# (engine.executor: uni). The same choice, given to bare vLLM:
UNI = (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),)
UNI_ARGS = ["--distributed-executor-backend", "uni"]

PEERS = (
    Peer("vllm", "vLLM", lambda _: vllm_command(PORT), ("S1", "S2"), uses_ray=False),
    Peer(
        "vllm-nostats",
        "vLLM, statistics off",
        lambda _: vllm_command(PORT, stats=False),
        ("S1",),
        uses_ray=False,
    ),
    Peer(
        "vllm-uni",
        "vLLM, uni executor",
        lambda _: [*vllm_command(PORT), *UNI_ARGS],
        ("S1",),
        uses_ray=False,
        env=UNI,
    ),
    Peer("rsllm", "Ray Serve LLM", _module("ray-serve-llm"), ("S1", "S2", "S3")),
    Peer(
        "rsllm-prefix",
        "Ray Serve LLM + prefix router",
        _module("ray-serve-llm", "--prefix-router"),
        ("S3", "S3b", "S3c"),
    ),
    Peer(
        "moe-proxy",
        "moe-cluster, Serve proxy",
        _module("moe-cluster"),
        ("S1",),
        grpc=("S1",),
    ),
    # Its HTTP and gRPC through HAProxy to the ingress replicas (server.haproxy).
    Peer(
        "moe",
        "moe-cluster",
        _module("moe-cluster", "--server-json", '{"haproxy": true}'),
        ("S1", "S2", "S3", "S3b", "S3c"),
        grpc=("S1", "S2", "S3", "S3b", "S3c"),
    ),
    # S3 with the router placing by cached prefix instead of load (the default).
    Peer(
        "moe-prefix",
        "moe-cluster, prefix policy",
        _module(
            "moe-cluster",
            "--server-json",
            '{"haproxy": true}',
            "--router-json",
            '{"policy": "prefix"}',
        ),
        ("S3",),
        grpc=("S3",),
    ),
)


def backend_for_peers() -> OpenAIBackend:
    # Text prompts (the seeded ids, decoded): Ray Serve LLM's prefix-aware router
    # divides by the prompt text's length and fails on token-id prompts.
    return OpenAIBackend(
        f"http://127.0.0.1:{PORT}", NAME, detokenize=text_prompts(str(MODEL_DIR))
    )


Prompts = Callable[[Iterator[RequestSpec]], Iterator[RequestSpec]]


def api(grpc: bool = False) -> tuple[Backend, Prompts]:
    """moe-cluster's gRPC API (token ids), or the OpenAI HTTP API every peer has
    (text), with what a request stream goes through on its way to it: the same
    prompts over both (``as_served`` for gRPC)."""
    if grpc:
        return GrpcBackend(f"127.0.0.1:{PORT + 1}"), as_served
    return backend_for_peers(), iter


@functools.cache
def _served_ids() -> Callable[[tuple[int, ...]], list[int]]:
    return text_prompt_ids(str(MODEL_DIR))


def as_served(stream: Iterator[RequestSpec]) -> Iterator[RequestSpec]:
    """``stream`` with each prompt the token ids the servers get from the text
    ``backend_for_peers`` sends (``text_prompt_ids``), for the gRPC API: the same
    prompts over both APIs. Lazily, so the load generator tokenizes a request
    when it takes it, before its clock starts."""
    ids = _served_ids()
    for spec in stream:
        yield replace(spec, prompt=tuple(ids(spec.prompt)))


def grpc_key(scenario: str) -> str:
    """The result key of ``scenario`` over gRPC (``S3`` -> ``S3g``)."""
    return f"{scenario}g"


class Server:
    """One peer's server process group, ready when /v1/models answers (and, for
    the Ray-based peers, every replica runs).

    ``own_session``: the server runs in a session of its own (each peer alike).
    Where the kernel groups CPU time by session (``sched_autogroup_enabled``),
    a busy server's session and the load generator's then get equal shares,
    whatever the processes' nice values; on 2 cores the load generator's
    threads waited, runnable, up to 2.8 s at a time under overload, and every
    latency it measured included that. Without it (a process group of its own
    in the caller's session) threads compete one by one, as without autogroups:
    Ray runs its workers at nice 15, so a client stands in for one on another
    machine."""

    def __init__(
        self,
        peer: Peer,
        replicas: int,
        log: Path,
        extra: tuple[str, ...] = (),
        own_session: bool = True,
    ) -> None:
        self.peer = peer
        self.log = log.open("w")
        env = os.environ | ENV | dict(peer.env)
        started = time.monotonic()
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            [*peer.command(replicas), *extra],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=own_session,
            process_group=None if own_session else 0,
        )
        deadline = started + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{peer.label} exited; see {log}")
            try:
                r = httpx.get(f"http://127.0.0.1:{PORT}/v1/models", timeout=2)
                # Ray Serve LLM lists models before its engine replicas run.
                all_up = not peer.uses_ray or "READY" in log.read_text()
                if r.status_code == 200 and all_up:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            self.stop()
            raise RuntimeError(
                f"{peer.label} not ready in {READY_TIMEOUT_S} s; see {log}"
            )
        self.startup_s = time.monotonic() - started
        self.log_path = log

    def add_replica(self) -> None:
        """Asks a ``--scalable`` server for one more engine replica."""
        os.kill(self.proc.pid, signal.SIGUSR1)

    def scaled(self, timeout_s: float) -> tuple[float, float] | None:
        """After ``add_replica``: how long until Serve ran the new replica, and
        when (``time.perf_counter``); None if it did not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log_path.read_text().splitlines():
                if line.startswith("SCALED "):
                    _, _, seconds, at = line.split()
                    return float(seconds), float(at)
            time.sleep(1)
        return None

    def stop(self) -> None:
        """SIGTERM (graceful engine shutdown), then clean up what is left."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.peer.uses_ray:
            ray = str(Path(sys.executable).parent / "ray")
            subprocess.run([ray, "stop", "--force"], capture_output=True, check=False)
        # Any vLLM process this peer started and left behind would skew the next,
        # and an HAProxy (server.haproxy) would hold its ports: the group's
        # SIGTERM reaches Ray's daemons too, and a server whose shutdown can no
        # longer reach them does not end what Serve started.
        for proc in psutil.process_iter(["name", "create_time"]):
            name = proc.info["name"] or ""
            if (name.startswith("VLLM::") or name == "haproxy") and (
                proc.info["create_time"] >= self.started_at
            ):
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
        self.log.close()


async def drive(
    backend: Backend,
    workload: Workload,
    slo: Slo,
    *,
    concurrency: int | None = None,
    n: int = 0,
    warmup: int = 0,
    duration_s: float | None = None,
    requests: Iterator[RequestSpec] | None = None,
) -> dict[str, Any]:
    """Runs ``workload`` on ``backend`` (then closes it) and summarizes: closed loop
    at ``concurrency`` for ``n`` requests after ``warmup`` unrecorded ones, or open
    loop for ``duration_s`` when no concurrency is given.

    The warmup's requests are the stream's first, and the recorded ones follow
    them: none is sent twice, so no server answers a recorded prompt from a cache
    the warmup filled. ``requests`` continues a stream an earlier call began."""
    stream = workload.requests() if requests is None else requests
    try:
        if concurrency is None:
            limits = Limits(duration_s=duration_s)
            records, duration = await run_open_loop(backend, stream, limits)
        else:
            if warmup:
                await run_closed_loop(backend, stream, concurrency, Limits(warmup))
            records, duration = await run_closed_loop(
                backend, stream, concurrency, Limits(n or None, duration_s)
            )
    finally:
        await backend.close()
    return summarize(records, duration, slo)


async def closed(
    workload: Workload,
    concurrency: int,
    n: int,
    warmup: int = 2,
    grpc: bool = False,
    duration_s: float | None = None,
    requests: Iterator[RequestSpec] | None = None,
) -> Any:
    """Closed loop: ``n`` requests, or as many as ``duration_s`` allows (n=0)."""
    client, prompts = api(grpc)
    return await drive(
        client,
        workload,
        REALTIME_SLO,
        concurrency=concurrency,
        n=n,
        warmup=warmup,
        duration_s=duration_s,
        requests=prompts(workload.requests() if requests is None else requests),
    )


async def joining(server: Server, grpc: bool = False) -> dict[str, Any]:
    """S3c: the working set warms on one replica; a second is added under the
    load. The summary of the recorded window, and of the requests sent in the
    ``S3C_AFTER_S`` after the new replica ran (``after``)."""
    client, prompts = api(grpc)
    try:
        warm = prompts(S3C.requests())
        await run_closed_loop(client, warm, 4, Limits(None, S3C_WARM_S))
        server.add_replica()
        t0 = time.perf_counter()
        records, duration = await run_closed_loop(
            client, prompts(S3C.requests()), 4, Limits(None, S3C_SECONDS)
        )
    finally:
        await client.close()
    out = summarize(records, duration, REALTIME_SLO)
    scaled = server.scaled(120)
    if scaled is not None:
        seconds, at = scaled
        ran = at - t0
        after = [r for r in records if ran <= r.sent_s < ran + S3C_AFTER_S]
        out["after"] = summarize_group(after, S3C_AFTER_S, REALTIME_SLO)
        out["after"]["new_replica_running_s"] = seconds
    return out


async def flood(
    background_rate: float, duration_s: float, grpc: bool = False, seed: int = 2
) -> Any:
    """S2: realtime at 0.5 req/s under background at ``background_rate``, open
    loop for ``duration_s``."""
    realtime = ClassSpec(
        "realtime", rate=0.5, input_len=lengths(64), output_len=lengths(32)
    )
    background = ClassSpec(
        "background",
        rate=background_rate,
        input_len=FLOOD_SHAPE.input_len,
        output_len=FLOOD_SHAPE.output_len,
    )
    workload = Workload((realtime, background), seed=seed)
    client, prompts = api(grpc)
    return await drive(
        client,
        workload,
        REALTIME_SLO,
        duration_s=duration_s,
        requests=prompts(workload.requests()),
    )


def run_peer(
    peer: Peer,
    capacity: dict[str, float],
    logs: Path,
    scenarios: frozenset[str] = frozenset(SCENARIOS),
    grpc: frozenset[str] = frozenset(SCENARIOS),
) -> dict[str, Any]:
    """Runs ``scenarios`` on ``peer``; those of them in ``grpc`` and the peer's
    ``grpc`` also over moe-cluster's gRPC API, under ``grpc_key``.

    S1, S2 and S3 run over gRPC on the server their HTTP run used, with prompts
    it has not seen (so no prefix cache answers one the HTTP run sent). S3b and
    S3c get a fresh server for each API: after 90 s the page store holds the
    whole working set, or the new replica has joined."""
    out: dict[str, Any] = {}
    kv = ("--kv-cache-mib", str(S3B_KV_CACHE_MIB))
    over_grpc = grpc & set(peer.grpc)
    for replicas, names, extra, api in (
        (1, ("S1", "S2"), (), "both"),
        (2, ("S3",), (), "both"),
        (2, ("S3b",), kv, "http"),
        (2, ("S3b",), kv, "grpc"),
        (1, ("S3c",), ("--scalable",), "http"),
        (1, ("S3c",), ("--scalable",), "grpc"),
    ):
        todo = [s for s in names if s in peer.scenarios and s in scenarios]
        if api == "grpc":
            todo = [s for s in todo if s in over_grpc]
        if not todo:
            continue
        tag = "-grpc" if api == "grpc" else ""
        print(f"== {peer.label}: {replicas} replica(s), {todo}{tag}", flush=True)
        try:
            log = logs / f"{peer.key}-{replicas}-{'-'.join(todo)}{tag}.log"
            server = Server(peer, replicas, log, extra)
        except RuntimeError as e:
            out["error"] = str(e)
            continue
        out[f"startup_s_{replicas}"] = server.startup_s
        also = api == "both"  # then gRPC after HTTP on this server
        try:
            if "S1" in todo:
                # One stream of prompts for the server's four points, each point
                # continuing where the last stopped: a prompt sent again would be
                # answered from whatever prefix cache the server keeps, which S1
                # (serving overhead) must not measure. Every peer gets the same
                # prompts at the same point.
                s1 = S1.requests()
                out["S1"] = asyncio.run(closed(S1, 1, S1_N, requests=s1))
                out["S1c4"] = asyncio.run(closed(S1, 4, S1C4_N, requests=s1))
                if also and "S1" in over_grpc:  # the gRPC API, requests alike
                    out["S1g"] = asyncio.run(
                        closed(S1, 1, S1_N, grpc=True, requests=s1)
                    )
                    out["S1gc4"] = asyncio.run(
                        closed(S1, 4, S1C4_N, grpc=True, requests=s1)
                    )
            if "S2" in todo:
                if "rate" not in capacity:  # the first peer's capacity sets the load
                    w = Workload((FLOOD_SHAPE,), seed=4)
                    capacity["rate"] = asyncio.run(closed(w, 16, 48))["all"][
                        "request_rate"
                    ]
                    capacity["measured_on"] = peer.label  # type: ignore[assignment]
                rate = 2 * capacity["rate"]
                out["S2"] = asyncio.run(flood(rate, 30.0))
                if also and "S2" in over_grpc:
                    # The same rates and shapes, drawn afresh: the flood's own
                    # prompts again would be answered from the page store.
                    out[grpc_key("S2")] = asyncio.run(
                        flood(rate, 30.0, grpc=True, seed=7)
                    )
            if "S3" in todo:
                s3 = S3.requests()  # gRPC goes on with the same prefixes
                out["S3"] = asyncio.run(
                    closed(S3, concurrency=8, n=48, warmup=4, requests=s3)
                )
                if also and "S3" in over_grpc:
                    out[grpc_key("S3")] = asyncio.run(
                        closed(S3, concurrency=8, n=48, grpc=True, requests=s3)
                    )
            if "S3b" in todo:
                name = grpc_key("S3b") if api == "grpc" else "S3b"
                out[name] = asyncio.run(
                    closed(
                        S3B,
                        concurrency=4,
                        n=0,
                        warmup=4,
                        grpc=api == "grpc",
                        duration_s=S3B_SECONDS,
                    )
                )
            if "S3c" in todo:
                name = grpc_key("S3c") if api == "grpc" else "S3c"
                out[name] = asyncio.run(joining(server, grpc=api == "grpc"))
        except Exception as e:  # a peer that fails is a result too
            out["error"] = repr(e)
        finally:
            server.stop()
    return out


# Requests per S1 point: ~45-55 s of closed loop at one and at four streams on a
# 2-core machine. The pace of these machines moves by up to 60% per token from
# one 8-s stretch to the next (``tests.perf.s1_batches``); a 20-s point rode
# on two or three such stretches, so a single slow one decided it.
S1_N = 144
S1C4_N = 432


def prefix_rows(scenario: str, klass: str = "all", label: str = "") -> list[Any]:
    """The prefix scenarios' rows: TTFT, throughput and the cached share."""
    return [
        (scenario, klass, "ttft_ms", "p50", f"{label}TTFT p50 (ms)", False),
        (scenario, klass, "ttft_ms", "p99", f"{label}TTFT p99 (ms)", False),
        (scenario, klass, "output_tok_s", None, f"{label}output tok/s", True),
        (
            scenario,
            klass,
            "cached_prompt_share",
            None,
            f"{label}prompt tokens from cache",
            True,
        ),
    ]


def s2_rows(scenario: str, label: str = "") -> list[Any]:
    """S2's rows: realtime's first token and goodput, background's throughput."""
    return [
        (
            scenario,
            "realtime",
            "ttft_ms",
            "p50",
            f"{label}realtime TTFT p50 (ms)",
            False,
        ),
        (
            scenario,
            "realtime",
            "ttft_ms",
            "p99",
            f"{label}realtime TTFT p99 (ms)",
            False,
        ),
        (
            scenario,
            "realtime",
            "goodput",
            None,
            f"{label}realtime goodput, TTFT<=1s (req/s)",
            True,
        ),
        (
            scenario,
            "background",
            "output_tok_s",
            None,
            f"{label}background output tok/s",
            True,
        ),
        (scenario, "all", "errors", None, f"{label}refused/failed requests", None),
    ]


def s3c_rows(scenario: str, label: str = "") -> list[Any]:
    """S3c's rows: the whole window, when the new replica ran, and after."""
    return [
        *prefix_rows(scenario, label=label),
        (
            scenario,
            "after",
            "new_replica_running_s",
            None,
            f"{label}new replica running after (s)",
            False,
        ),
        *prefix_rows(scenario, "after", f"{label}after it runs: "),
    ]


GRPC = "gRPC: "
ROWS = [
    ("S1", "all", "ttft_ms", "p50", "TTFT p50 (ms)", False),
    ("S1", "all", "tpot_ms", "p50", "TPOT p50 (ms)", False),
    ("S1", "all", "e2e_ms", "p50", "E2E p50 (ms)", False),
    ("S1", "all", "output_tok_s", None, "output tok/s", True),
    ("S1c4", "all", "ttft_ms", "p50", "c=4 TTFT p50 (ms)", False),
    ("S1c4", "all", "tpot_ms", "p50", "c=4 TPOT p50 (ms)", False),
    ("S1c4", "all", "output_tok_s", None, "c=4 output tok/s", True),
    ("S1g", "all", "ttft_ms", "p50", "gRPC: TTFT p50 (ms)", False),
    ("S1g", "all", "output_tok_s", None, "gRPC: output tok/s", True),
    ("S1gc4", "all", "ttft_ms", "p50", "gRPC c=4: TTFT p50 (ms)", False),
    ("S1gc4", "all", "output_tok_s", None, "gRPC c=4: output tok/s", True),
    *s2_rows("S2"),
    *s2_rows(grpc_key("S2"), GRPC),
    *prefix_rows("S3"),
    *prefix_rows(grpc_key("S3"), label=GRPC),
    *prefix_rows("S3b"),
    *prefix_rows(grpc_key("S3b"), label=GRPC),
    *s3c_rows("S3c"),
    *s3c_rows(grpc_key("S3c"), GRPC),
]


# A peer that serves HTTP only is held against moe-cluster's gRPC with its HTTP.
HTTP_OF = {"S1g": "S1", "S1gc4": "S1c4"} | {
    grpc_key(s): s for s in ("S2", "S3", "S3b", "S3c")
}


def machine() -> str:
    """The CPU and the engines' settings, for the table's header."""
    from tests.perf.peers import ENGINE, platform_kwargs

    flags: set[str] = set()
    model = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
        elif key.strip() == "model name":
            model = value.strip()
    wide = sorted(f for f in flags if f.startswith(("amx", "avx512")))
    p = platform_kwargs()
    return (
        f"Machine: {model}, {os.cpu_count()} cores; "
        f"{'AMX' if any(f.startswith('amx') for f in flags) else 'no AMX'} "
        f"({', '.join(wide) or 'no AVX-512'}).\n"
        f"Every engine: {p['attention_backend']}, {p['dtype']}, "
        f"{p['block_size']}-token blocks, one OpenMP thread, "
        f"max_num_seqs {ENGINE['max_num_seqs']}, eager.\n\n"
    )


def per_cpu(stem: str) -> str:
    """``{stem}-amx_mla`` or ``{stem}-cpu_mla``, by the backend the engines get on
    this CPU: a result file per kind of CPU. ``{stem}-cpu_mla-on-amx`` where
    ``MOE_CLUSTER_BENCH_BACKEND`` has an AMX machine run the reference backend."""
    from cluster.platform import has_amx
    from tests.perf.peers import platform_kwargs

    backend = str(platform_kwargs()["attention_backend"]).lower()
    return f"{stem}-{backend}{'-on-amx' if backend == 'cpu_mla' and has_amx() else ''}"


def cell(
    results: dict[str, Any], peer: str, row: tuple[Any, ...]
) -> float | str | None:
    scenario, klass, metric, stat, _, _ = row
    if not is_moe(peer):
        scenario = HTTP_OF.get(scenario, scenario)
    s = results.get(peer, {}).get(scenario, {}).get(klass)
    if s is None:
        return None
    value = s[metric]
    if metric == "errors":
        return sum(value.values())
    return value[stat] if stat else value


def _fmt(v: float | str | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _startup(result: dict[str, Any]) -> float:
    return float(result.get("startup_s_1", result.get("startup_s_2", 0.0)))


def markdown(results: dict[str, Any], capacity: dict[str, Any]) -> str:
    peers = [p for p in PEERS if p.key in results]
    head = "| scenario | metric | " + " | ".join(p.label for p in peers)
    refs = [p for p in peers if not is_moe(p.key)]
    head += " | moe-cluster vs " + " | moe-cluster vs ".join(p.label for p in refs)
    head += " |"
    lines = [machine() + head, "|" + "---|" * (head.count("|") - 1)]
    for row in ROWS:
        values = [cell(results, p.key, row) for p in peers]
        moe = cell(results, "moe", row)
        ratios = []
        for p, v in zip(peers, values, strict=True):
            if is_moe(p.key):
                continue
            ok = isinstance(v, (int, float)) and isinstance(moe, (int, float)) and v
            ratios.append(f"{moe / v:.2f}x" if ok else "-")  # type: ignore[operator]
        shown = [_fmt(v) for v in values]
        lines.append(f"| {row[0]} | {row[4]} | " + " | ".join(shown + ratios) + " |")
    startup = ", ".join(f"{p.label} {_startup(results[p.key]):.0f} s" for p in peers)
    rate = capacity.get("rate", 0.0)
    lines += [
        "",
        f"Ratios are moe-cluster / peer (for latencies lower is better). S2 offers "
        f"background at 2 x {rate:.2f} req/s (capacity measured on "
        f"{capacity.get('measured_on', '-')}).",
        f"Start-up to the first ready answer: {startup}.",
    ]
    errors = {
        p.label: results[p.key]["error"] for p in peers if "error" in results[p.key]
    }
    if errors:
        lines.append(f"Failures: {errors}")
    return "\n".join(lines) + "\n"


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    logs = RESULTS / "logs"
    logs.mkdir(exist_ok=True)
    if not (MODEL_DIR / "config.json").exists():
        from cluster.tiny_model import write_tiny_model

        write_tiny_model(MODEL_DIR)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("peers", nargs="*", help="run only these (vllm, rsllm, ...)")
    parser.add_argument(
        "--capacity",
        type=float,
        help="S2 baseline capacity in req/s (reuse an earlier run's, to compare)",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="run only these (a partial run does not replace the recorded table)",
    )
    args = parser.parse_args()
    only = set(args.peers)
    scenarios = frozenset(args.scenarios.split(","))
    partial = bool(only) or scenarios != set(SCENARIOS)
    capacity: dict[str, Any] = {}
    if args.capacity:
        capacity = {"rate": args.capacity, "measured_on": "an earlier run"}
    results: dict[str, Any] = {}
    stem = per_cpu("peers")
    for peer in PEERS:
        if only and peer.key not in only:
            continue
        results[peer.key] = run_peer(peer, capacity, logs, scenarios)
        name = f"{stem}.json" if not partial else "peers-partial.json"
        (RESULTS / name).write_text(
            json.dumps({"capacity": capacity, "results": results}, indent=1)
        )
    table = markdown(results, capacity)
    if not partial:  # a partial run does not replace the recorded comparison
        (RESULTS / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
