"""The same tiny model and workloads served by moe-cluster and by its peers.

    make bench-peers        # or: .venv/bin/python -m tests.perf.compare_peers

Peers, each started alone on this machine with one core per engine replica:
bare vLLM (``vllm serve``), Ray Serve LLM (default router, and its
PrefixCacheAffinityRouter), and moe-cluster. All are driven over OpenAI HTTP by
``moe-cluster bench``'s load generator with the same seeded workloads:

- S1: one replica, closed loop, one stream at a time (serving overhead);
- S2: one replica, a realtime stream (0.5 req/s) under a background flood at 2x
  the baseline's measured capacity (Poisson, 30 s);
- S3: two replicas, 4 shared prefixes of 512 tokens + 32 distinct tokens each,
  8 streams (prefix reuse across replicas).

Prompts are sent as text (the seeded token ids decoded with the model's
tokenizer), the form every peer's router understands; random ids decode to text
that re-tokenizes to ~1.2x the nominal lengths, the same text for every peer.

Writes ``tests/perf/results/peers.json`` (summaries) and ``peers.md`` (the table
of ratios), so a later change can be compared with this one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from deployments.bench.backends import Backend, OpenAIBackend
from deployments.bench.cli import text_prompts
from deployments.bench.report import Slo, summarize
from deployments.bench.runner import Limits, run_closed_loop, run_open_loop
from deployments.bench.workload import ClassSpec, LengthRange, PrefixGroups, Workload
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


@dataclass(frozen=True)
class Peer:
    key: str
    label: str
    command: Callable[[int], list[str]]  # replicas -> argv
    scenarios: tuple[str, ...]
    uses_ray: bool = True


def _module(*args: str) -> Callable[[int], list[str]]:
    def argv(replicas: int) -> list[str]:
        module = [sys.executable, "-m", "tests.perf.peers", *args]
        return [*module, "--port", str(PORT), "--replicas", str(replicas)]

    return argv


PEERS = (
    Peer("vllm", "vLLM", lambda _: vllm_command(PORT), ("S1", "S2"), uses_ray=False),
    Peer("rsllm", "Ray Serve LLM", _module("ray-serve-llm"), ("S1", "S2", "S3")),
    Peer(
        "rsllm-prefix",
        "Ray Serve LLM + prefix router",
        _module("ray-serve-llm", "--prefix-router"),
        ("S3",),
    ),
    Peer("moe", "moe-cluster", _module("moe-cluster"), ("S1", "S2", "S3")),
)


def backend_for_peers() -> OpenAIBackend:
    # Text prompts (the seeded ids, decoded): Ray Serve LLM's prefix-aware router
    # divides by the prompt text's length and fails on token-id prompts.
    return OpenAIBackend(
        f"http://127.0.0.1:{PORT}", NAME, detokenize=text_prompts(str(MODEL_DIR))
    )


class Server:
    """One peer's server process group, ready when /v1/models answers (and, for
    the Ray-based peers, every replica runs)."""

    def __init__(self, peer: Peer, replicas: int, log: Path) -> None:
        self.peer = peer
        self.log = log.open("w")
        env = os.environ | ENV
        started = time.monotonic()
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            peer.command(replicas),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
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
        # Any vLLM process this peer started and left behind would skew the next.
        for proc in psutil.process_iter(["name", "create_time"]):
            if proc.info["name"].startswith("VLLM::") and (
                proc.info["create_time"] >= self.started_at
            ):
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
) -> dict[str, Any]:
    """Runs ``workload`` on ``backend`` (then closes it) and summarizes: closed loop
    at ``concurrency`` for ``n`` requests after ``warmup`` unrecorded ones, or open
    loop for ``duration_s`` when no concurrency is given."""
    try:
        if concurrency is None:
            limits = Limits(duration_s=duration_s)
            records, duration = await run_open_loop(
                backend, workload.requests(), limits
            )
        else:
            if warmup:
                await run_closed_loop(
                    backend, workload.requests(), concurrency, Limits(warmup)
                )
            records, duration = await run_closed_loop(
                backend, workload.requests(), concurrency, Limits(n)
            )
    finally:
        await backend.close()
    return summarize(records, duration, slo)


async def closed(workload: Workload, concurrency: int, n: int, warmup: int = 2) -> Any:
    return await drive(
        backend_for_peers(),
        workload,
        REALTIME_SLO,
        concurrency=concurrency,
        n=n,
        warmup=warmup,
    )


async def flood(background_rate: float, duration_s: float) -> Any:
    realtime = ClassSpec(
        "realtime", rate=0.5, input_len=lengths(64), output_len=lengths(32)
    )
    background = ClassSpec(
        "background",
        rate=background_rate,
        input_len=FLOOD_SHAPE.input_len,
        output_len=FLOOD_SHAPE.output_len,
    )
    workload = Workload((realtime, background), seed=2)
    return await drive(
        backend_for_peers(), workload, REALTIME_SLO, duration_s=duration_s
    )


def run_peer(peer: Peer, capacity: dict[str, float], logs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for replicas, names in ((1, ("S1", "S2")), (2, ("S3",))):
        todo = [s for s in names if s in peer.scenarios]
        if not todo:
            continue
        print(f"== {peer.label}: {replicas} replica(s), {todo}", flush=True)
        try:
            server = Server(peer, replicas, logs / f"{peer.key}-{replicas}.log")
        except RuntimeError as e:
            out["error"] = str(e)
            continue
        out[f"startup_s_{replicas}"] = server.startup_s
        try:
            if "S1" in todo:
                out["S1"] = asyncio.run(closed(S1, concurrency=1, n=16))
            if "S2" in todo:
                if "rate" not in capacity:  # the first peer's capacity sets the load
                    w = Workload((FLOOD_SHAPE,), seed=4)
                    capacity["rate"] = asyncio.run(closed(w, 16, 48))["all"][
                        "request_rate"
                    ]
                    capacity["measured_on"] = peer.label  # type: ignore[assignment]
                out["S2"] = asyncio.run(flood(2 * capacity["rate"], 30.0))
            if "S3" in todo:
                out["S3"] = asyncio.run(closed(S3, concurrency=8, n=48, warmup=4))
        except Exception as e:  # a peer that fails is a result too
            out["error"] = repr(e)
        finally:
            server.stop()
    return out


ROWS = [
    ("S1", "all", "ttft_ms", "p50", "TTFT p50 (ms)", False),
    ("S1", "all", "tpot_ms", "p50", "TPOT p50 (ms)", False),
    ("S1", "all", "e2e_ms", "p50", "E2E p50 (ms)", False),
    ("S1", "all", "output_tok_s", None, "output tok/s", True),
    ("S2", "realtime", "ttft_ms", "p50", "realtime TTFT p50 (ms)", False),
    ("S2", "realtime", "ttft_ms", "p99", "realtime TTFT p99 (ms)", False),
    ("S2", "realtime", "goodput", None, "realtime goodput, TTFT<=1s (req/s)", True),
    ("S2", "background", "output_tok_s", None, "background output tok/s", True),
    ("S2", "all", "errors", None, "refused/failed requests", None),
    ("S3", "all", "ttft_ms", "p50", "TTFT p50 (ms)", False),
    ("S3", "all", "ttft_ms", "p99", "TTFT p99 (ms)", False),
    ("S3", "all", "output_tok_s", None, "output tok/s", True),
    ("S3", "all", "cached_prompt_share", None, "prompt tokens from cache", True),
]


def cell(
    results: dict[str, Any], peer: str, row: tuple[Any, ...]
) -> float | str | None:
    scenario, klass, metric, stat, _, _ = row
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
    head += (
        " | moe-cluster vs "
        + " | moe-cluster vs ".join(p.label for p in peers if p.key != "moe")
        + " |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in ROWS:
        values = [cell(results, p.key, row) for p in peers]
        moe = cell(results, "moe", row)
        ratios = []
        for p, v in zip(peers, values, strict=True):
            if p.key == "moe":
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
    args = parser.parse_args()
    only = set(args.peers)
    capacity: dict[str, Any] = {}
    if args.capacity:
        capacity = {"rate": args.capacity, "measured_on": "an earlier run"}
    results: dict[str, Any] = {}
    for peer in PEERS:
        if only and peer.key not in only:
            continue
        results[peer.key] = run_peer(peer, capacity, logs)
        name = "peers.json" if not only else "peers-partial.json"
        (RESULTS / name).write_text(
            json.dumps({"capacity": capacity, "results": results}, indent=1)
        )
    table = markdown(results, capacity)
    if not only:  # a partial run does not replace the recorded comparison
        (RESULTS / "peers.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
