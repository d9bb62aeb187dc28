"""Where S1's time goes: CPU per process, the engine's thread, py-spy's frames.

    .venv/bin/python -m tests.perf.s1_profile [moe|vllm|vllm-uni|...] [--engine-json J]
        [--router-json J] [--kvstore-json J] [--pyspy SECONDS]
        [--pyspy-concurrency N] [--pyspy-idle | --pyspy-gil] [--grpc]
        [--vllm-no-stats] [--waits SECONDS]
        [--idle SECONDS]

Starts one system as ``make bench-peers`` does (one replica, one core), runs S1
(128 prompt tokens, 64 output tokens) closed loop at concurrency 1 and 4 (every
prompt new to the server, so no prefix cache answers any of it), and
meanwhile samples every process the system started: CPU seconds per process
(grouped by its title: the Serve proxy, the ingress and engine replicas, vLLM's
EngineCore, the router, Ray's own daemons) per request served, and how long
vLLM's engine core waited, runnable, for a core (what sharing the node's cores
with the rest costs the engine's steps). Of the engine core's main thread, which
steps the model, it also prints the share of the run it was on a core, runnable
but off one, and asleep (waiting for work, or for a lock such as the GIL), its
CPU per output token (tokens counted as the run's rate times its length, the
warmup's included) and its sleeps and preemptions per token. With ``--pyspy``
it also records each of the busiest processes with py-spy for that long, at
``--pyspy-concurrency`` streams (one by default), and prints the frames that
hold most samples (self and inclusive); ``--pyspy-idle`` samples waiting
threads too, each stack under its thread, and prints where the raw stacks are;
``--pyspy-gil`` samples only the thread holding the GIL, and prints each thread's
share of the run it held it: what one process's threads can take from each other
(vLLM's engine core is a process of its own, so the engine replica's threads
take nothing from the thread that steps the model).
With ``--waits`` it first traces the engine core's main thread with ``perf
trace`` for that long at four streams, and prints how often, and for how long,
it blocked for 1 ms or more: waits of 5 ms or more are counted as the engine
out of work (its waits for the GIL and for the page store's answers were all
shorter in the runs recorded), shorter ones as a lock or a socket.
With ``--idle`` it first measures the started server serving nothing, for that
long: CPU per second per process (what the system costs a node whether or not
it serves).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from tests.perf.compare_peers import PEERS, S1, Server, closed, is_moe
from tests.perf.peers import platform_kwargs

RESULTS = Path(__file__).parent / "results"


def title(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "?"
    name = cmd[0] if cmd else p.name()
    if name.startswith(("ray::", "VLLM::")):
        return str(name.split(" ")[0])
    base = Path(name).name
    if "python" in base and len(cmd) > 1:
        args = [a for a in cmd[1:] if not a.startswith("-")]
        return f"python {Path(args[0]).name if args else ''}".strip()
    return base


def processes(since: float) -> list[psutil.Process]:
    """Every process started since ``since`` (the server's, Ray's, vLLM's)."""
    out = []
    for p in psutil.process_iter(["create_time"]):
        if p.info["create_time"] >= since - 1 and p.pid != psutil.Process().pid:
            out.append(p)
    return out


def cpu(procs: list[psutil.Process]) -> dict[int, tuple[str, float]]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (title(p), t.user + t.system)
        except psutil.Error:
            pass
    return out


def main_thread(pid: int) -> tuple[float, float, int, int] | None:
    """(seconds on a core, seconds runnable waiting for one, voluntary and
    involuntary context switches) of ``pid``'s main thread so far. A voluntary
    switch is the thread going to sleep: waiting for input, for a lock (the
    GIL among them), for I/O."""
    task = Path(f"/proc/{pid}/task/{pid}")
    try:
        ran, waited, _ = task.joinpath("schedstat").read_text().split()
        status = task.joinpath("status").read_text().splitlines()
    except (OSError, ValueError):
        return None
    switches = dict(line.split(":\t") for line in status if "ctxt_switches" in line)
    return (
        int(ran) / 1e9,
        int(waited) / 1e9,
        int(switches["voluntary_ctxt_switches"]),
        int(switches["nonvoluntary_ctxt_switches"]),
    )


def cpu_waits(procs: list[psutil.Process]) -> dict[int, tuple[str, float]]:
    """Seconds each process's main thread has waited, runnable, for a core (the
    kernel's ``run_delay``, ``/proc/PID/task/PID/schedstat``): what sharing the
    node's cores costs it. vLLM's engine core steps the model on its main thread
    (one OpenMP thread, the uni executor)."""
    out = {}
    for p in procs:
        if (thread := main_thread(p.pid)) is not None:
            out[p.pid] = (title(p), thread[1])
    return out


def engine_core(procs: list[psutil.Process]) -> int | None:
    """The pid of vLLM's engine core, which steps the model on its main thread
    (one OpenMP thread, the uni executor)."""
    return next((p.pid for p in procs if "EngineCore" in title(p)), None)


def engine_main(procs: list[psutil.Process]) -> tuple[float, float, int, int] | None:
    """``main_thread`` of vLLM's engine core."""
    pid = engine_core(procs)
    return None if pid is None else main_thread(pid)


def by_title(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    total: dict[str, float] = collections.defaultdict(float)
    for pid, (name, t) in after.items():
        total[name] += t - before.get(pid, (name, 0.0))[1]
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def print_cpu(used: dict[str, float], per: float, unit: str, floor: float) -> None:
    """One line per process title using more than ``floor`` CPU seconds: its
    milliseconds per ``unit`` (``per`` of them in the interval)."""
    for name, v in used.items():
        if v > floor:
            print(f"    {name:45s} {1000 * v / per:8.1f} ms CPU/{unit}")


def stacks(raw: Path) -> Iterator[tuple[list[str], int]]:
    """(frames, outermost first; samples) of each line of py-spy's collapsed
    stacks."""
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        yield stack.split(";"), int(count)


def top_frames(raw: Path, n: int = 12) -> tuple[list[Any], list[Any], int]:
    """(self, inclusive, samples) from py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    samples = 0
    for frames, k in stacks(raw):
        samples += k
        own[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    return own.most_common(n), incl.most_common(n), samples


RATE = 100  # py-spy's samples a second


def gil_shares(raw: Path, seconds: float) -> dict[str, float]:
    """Each thread's share of ``seconds`` holding the GIL, from py-spy's stacks
    recorded with ``--gil --threads`` (each stack under its thread)."""
    held: collections.Counter[str] = collections.Counter()
    for frames, k in stacks(raw):
        held[frames[0]] += k  # "thread (TID): NAME"
    return {t: k / (RATE * seconds) for t, k in held.most_common()}


def pyspy(
    pids: dict[int, str],
    seconds: int,
    out: Path,
    idle: bool = False,
    gil: bool = False,
) -> list[Any]:
    """Starts py-spy on each process (collapsed stacks into ``out``); with
    ``idle``, threads' samples while they wait too, each stack under its
    thread; with ``gil``, only the thread holding the GIL, under its thread."""
    spy = str(Path(sys.executable).parent / "py-spy")

    def argv(pid: int) -> list[str]:
        record = [spy, "record", "--pid", str(pid), "--duration", str(seconds)]
        options = ["--nonblocking", "--rate", str(RATE), "--format", "raw"]
        if idle:
            options += ["--idle", "--threads"]
        if gil:
            options += ["--gil", "--threads"]
        return [*record, *options, "--output", str(out / f"{pid}.txt")]

    return [
        subprocess.Popen(
            argv(pid),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in pids
    ]


# A syscall perf trace printed: "  313.040 (21.623 ms): futex(uaddr: 0x..., op: ..."
_TRACED = re.compile(r"\(\s*([\d.]+) ms\): (\w+)\((.*)")
_FUTEX_OP = re.compile(r"op: ([\w|]+)")
# The calls a thread blocks in: a lock or condition (the GIL's among them), a
# queue's condition (vLLM's engine core waiting for requests), a socket.
WAIT_CALLS = ("futex", "poll", "ppoll", "epoll_wait", "select", "recvfrom")
# A wait this long is counted as the engine out of work: its waits for the GIL
# (at most the 5-ms switch interval, as a rule) and for the page store's answers
# were all shorter in the runs recorded.
IDLE_MS = 5.0


def engine_waits(trace: str, seconds: float) -> dict[str, float]:
    """From ``perf trace --duration 1`` of one thread for ``seconds``: how often
    it blocked for ``IDLE_MS`` or more (and for how long, per second and at the
    median), and for 1 ms to ``IDLE_MS``. A futex that wakes others is not a
    wait, however long it took (its thread was preempted in it)."""
    long: list[float] = []
    short: list[float] = []
    for line in trace.splitlines():
        m = _TRACED.search(line)
        if m is None or m[2] not in WAIT_CALLS:
            continue
        op = _FUTEX_OP.search(m[3])
        if m[2] == "futex" and (op is None or "WAIT" not in op[1]):
            continue
        ms = float(m[1])
        (long if ms >= IDLE_MS else short).append(ms)
    long.sort()
    return {
        "idle_waits_per_s": round(len(long) / seconds, 2),
        "idle_ms_per_s": round(sum(long) / seconds, 2),
        "idle_wait_p50_ms": round(long[len(long) // 2], 2) if long else 0.0,
        "short_waits_per_s": round(len(short) / seconds, 2),
        "short_ms_per_s": round(sum(short) / seconds, 2),
    }


def trace_waits(
    perf: str, pid: int, seconds: int, out: Path, grpc: bool
) -> dict[str, float]:
    """``engine_waits`` of ``pid``'s main thread over ``seconds`` at four
    streams: ``perf trace`` of its blocking calls of 1 ms or more (into
    ``out``), started once the streams run."""
    load = threading.Thread(
        target=asyncio.run,
        args=(run(grpc, 4, 1_000_000, seconds + 5),),
        daemon=True,  # not waited for if perf fails
    )
    load.start()
    time.sleep(2.0)  # four streams running
    argv = [perf, "trace", "--tid", str(pid), "--duration", "1"]
    argv += ["-e", ",".join(WAIT_CALLS), "-o", str(out)]
    tracer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(seconds)
    tracer.send_signal(signal.SIGINT)
    _, err = tracer.communicate(timeout=30)
    if not out.exists() or tracer.returncode not in (0, -signal.SIGINT):
        raise SystemExit(f"perf trace failed: {err.decode().strip()}")
    load.join()
    return engine_waits(out.read_text(), seconds)


# One stream of S1 prompts for the server's whole run: a prompt sent twice would be
# answered in part from a prefix cache (vLLM's, or moe-cluster's page store).
PROMPTS = S1.requests()


async def run(
    backend_grpc: bool, concurrency: int, n: int, duration_s: float | None = None
) -> dict[str, Any]:
    summary = await closed(
        S1, concurrency, n, 4, backend_grpc, duration_s, requests=PROMPTS
    )
    return dict(summary["all"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "system",
        choices=[peer.key for peer in PEERS],
        default="moe",
        help="a make bench-peers peer, started as it starts it (its arguments and "
        "environment: vllm-uni is vLLM with the uni executor)",
    )
    p.add_argument("--engine-json", default="{}")
    p.add_argument("--router-json", default="{}")
    p.add_argument("--kvstore-json", default="{}", help="moe: page store settings")
    p.add_argument("--grpc", action="store_true", help="moe-cluster over gRPC")
    p.add_argument("--pyspy", type=int, default=0, help="seconds of py-spy")
    p.add_argument(
        "--pyspy-concurrency", type=int, default=1, help="streams while py-spy runs"
    )
    p.add_argument(
        "--pyspy-idle",
        action="store_true",
        help="py-spy samples waiting threads too, each stack under its thread",
    )
    p.add_argument(
        "--pyspy-gil",
        action="store_true",
        help="py-spy samples only the thread holding the GIL: each thread's share",
    )
    p.add_argument(
        "--waits",
        type=int,
        default=0,
        help="first, seconds of perf trace on the engine core's main thread at "
        "four streams: how often and how long it blocks",
    )
    p.add_argument(
        "--idle",
        type=int,
        default=0,
        help="first, seconds of the started server idle: CPU per second per process",
    )
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--label", default="")
    p.add_argument(
        "--server-args", default="", help="more arguments for the server (vllm)"
    )
    p.add_argument(
        "--vllm-no-stats",
        action="store_true",
        help="bare vLLM without its per-step statistics and Prometheus metrics "
        "(--disable-log-stats), which moe-cluster's engines keep",
    )
    args = p.parse_args()
    if args.pyspy_idle and args.pyspy_gil:
        p.error("--pyspy-idle and --pyspy-gil sample differently: give one of them")
    perf = shutil.which("perf") or ""
    if args.waits and not perf:
        p.error("--waits needs perf (Debian's linux-perf)")
    base = next(peer for peer in PEERS if peer.key == args.system)
    extra = args.server_args.split()
    if is_moe(args.system):
        extra += ["--engine-json", args.engine_json, "--router-json", args.router_json]
        extra += ["--kvstore-json", args.kvstore_json]
    if args.vllm_no_stats:
        if args.system not in ("vllm", "vllm-uni"):
            p.error("--vllm-no-stats is bare vLLM's (system vllm or vllm-uni)")
        extra.append("--disable-log-stats")
    peer = base.with_args(extra)
    logs = Path(tempfile.mkdtemp(prefix="s1-"))
    started = time.time()
    server = Server(peer, 1, logs / "server.log")
    out: dict[str, Any] = {
        "system": args.system,
        "label": args.label,
        "args": vars(args),
        "engine": platform_kwargs(),
    }
    try:
        procs = processes(started)
        if args.idle:
            time.sleep(5.0)  # past the start's last work (warmup, first reports)
            before = cpu(procs)
            time.sleep(args.idle)
            used = by_title(before, cpu(procs))
            out["idle_cpu_ms_per_s"] = {
                k: round(1000 * v / args.idle, 1) for k, v in used.items() if v > 0
            }
            print(f"idle: {1000 * sum(used.values()) / args.idle:.1f} ms CPU/s")
            print_cpu(used, args.idle, "s", floor=0.0)
        if args.waits:
            core = engine_core(procs)
            if core is None:
                raise SystemExit("--waits: no vLLM engine core among the processes")
            traced = logs / "engine-waits.txt"
            waits = trace_waits(perf, core, args.waits, traced, args.grpc)
            out["engine_waits_c4"] = waits
            print(
                f"the engine core's main thread at four streams ({traced}): "
                f"{waits['idle_waits_per_s']:.1f} waits/s of {IDLE_MS:.0f} ms or more, "
                f"{waits['idle_ms_per_s']:.1f} ms/s (p50 "
                f"{waits['idle_wait_p50_ms']:.1f} ms); "
                f"{waits['short_waits_per_s']:.1f}/s of 1-{IDLE_MS:.0f} ms, "
                f"{waits['short_ms_per_s']:.1f} ms/s",
                flush=True,
            )
        if args.pyspy:
            busy = {
                pid: name
                for pid, (name, _) in cpu(procs).items()
                if name.startswith(("ray::Serve", "ray::DeepSeek", "VLLM::"))
                or "api_server" in name
            }
            spies = pyspy(busy, args.pyspy, logs, args.pyspy_idle, args.pyspy_gil)
            duration = args.pyspy + 2.0
            asyncio.run(run(args.grpc, args.pyspy_concurrency, 1_000_000, duration))
            for spy in spies:
                spy.wait()
            print(f"py-spy's stacks: {logs}")
            for pid, name in busy.items():
                f = logs / f"{pid}.txt"
                if not f.exists():
                    continue
                own, incl, samples = top_frames(f)
                print(f"--- py-spy {name} (pid {pid}): {samples} samples")
                if args.pyspy_gil:
                    print("  the GIL held, share of the run, by thread:")
                    for thread, share in gil_shares(f, args.pyspy).items():
                        print(f"    {100 * share:5.1f}%  {thread}")
                print("  self:")
                for frame, k in own:
                    print(f"    {100 * k / samples:5.1f}%  {frame}")
                print("  inclusive:")
                for frame, k in incl:
                    print(f"    {100 * k / samples:5.1f}%  {frame}")
        for c in (1, 4):
            before, waits_before = cpu(procs), cpu_waits(procs)
            main_before = engine_main(procs)
            t0 = time.monotonic()
            s = asyncio.run(run(args.grpc, c, args.requests))
            wall = time.monotonic() - t0
            main_after = engine_main(procs)
            used = by_title(before, cpu(procs))
            waited = by_title(waits_before, cpu_waits(procs))
            out[f"c{c}"] = {
                "output_tok_s": s["output_tok_s"],
                "ttft_p50_ms": s["ttft_ms"]["p50"],
                "tpot_p50_ms": s["tpot_ms"]["p50"],
                "errors": s["errors"],
                "cpu_s_per_request": {
                    k: round(v / args.requests, 4) for k, v in used.items() if v > 0.05
                },
                "cpu_wait_s_per_request": {
                    k: round(v / args.requests, 4)
                    for k, v in waited.items()
                    if v > 0.005
                },
                "wall_s": round(wall, 1),
            }
            tokens = s["output_tok_s"] * wall
            if main_before and main_after and tokens > 0:
                ran, queued, vol, invol = (
                    b - a for a, b in zip(main_before, main_after, strict=True)
                )
                # Of the interval, the engine's main thread was on a core, runnable
                # but off one, or asleep (no work, or waiting on a lock).
                out[f"c{c}"]["engine_main_thread"] = {
                    "on_core_share": round(ran / wall, 4),
                    "runnable_share": round(queued / wall, 4),
                    "asleep_share": round(max(0.0, wall - ran - queued) / wall, 4),
                    "on_core_ms_per_token": round(1000 * ran / tokens, 4),
                    "voluntary_switches_per_token": round(vol / tokens, 3),
                    "involuntary_switches_per_token": round(invol / tokens, 3),
                }
            print(
                f"c={c}: {s['output_tok_s']:.1f} tok/s, TTFT p50 "
                f"{s['ttft_ms']['p50']:.1f} ms, TPOT p50 {s['tpot_ms']['p50']:.2f} ms,"
                f" errors {s['errors']}",
                flush=True,
            )
            print_cpu(used, args.requests, "req", floor=0.05)
            engine = sum(v for k, v in waited.items() if "EngineCore" in k)
            print(
                f"    the engine core's main thread waited for a core "
                f"{1000 * engine / args.requests:.1f} ms/req",
                flush=True,
            )
            if mt := out[f"c{c}"].get("engine_main_thread"):
                print(
                    "    its share of the time: on a core "
                    f"{mt['on_core_share']:.3f}, runnable "
                    f"{mt['runnable_share']:.3f}, asleep {mt['asleep_share']:.3f};"
                    f" {mt['on_core_ms_per_token']:.3f} ms on a core a token,"
                    f" {mt['voluntary_switches_per_token']:.2f} sleeps and "
                    f"{mt['involuntary_switches_per_token']:.2f} preemptions a token",
                    flush=True,
                )
    finally:
        server.stop()
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / "s1_profile.jsonl").open("a") as log:
        log.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
