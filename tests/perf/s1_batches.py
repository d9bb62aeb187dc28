"""S1 at one stream in short batches on one server start: how much a server's
time per output token moves from batch to batch, and whether the engine core
was kept waiting for a core meanwhile.

    .venv/bin/python -m tests.perf.s1_batches [moe|vllm-uni|...] [--batches 12]
        [--per-batch 24] [--variants as-is,client-off,engine-nice-0]

Starts one system as ``make bench-peers`` does, then runs ``--batches`` rounds of
the variants in turn, each a closed loop of ``--per-batch`` S1 requests over
HTTP, new prompts throughout. Per batch it prints the TPOT p50, the output
tok/s, how long the engine core's main thread waited, runnable, for a core
(``run_delay``) per request, and how often a thread of this process, the load
generator, was found runnable on the engine core's cores (sampled every 5 ms).
Variants (moe-cluster, whose engine core has cores of its own): ``as-is``;
``client-off`` (the load generator's threads kept off the engine's cores);
``engine-nice-0`` (the engine core's main thread at nice 0, where Ray starts it
at 15; needs root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tests.perf.compare_peers import PEERS, S1, Server, closed
from tests.perf.s1_profile import cpu_waits, processes, title

VARIANTS = ("as-is", "client-off", "engine-nice-0")


class Sampler:
    """Counts this process's runnable threads, and those on ``cores``."""

    def __init__(self, cores: set[int]) -> None:
        self.cores, self.on, self.seen = cores, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.on = self.seen = 0

    def share(self) -> float:
        return self.on / max(1, self.seen)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        tasks = Path(f"/proc/{os.getpid()}/task")
        while not self._stop.is_set():
            for tid in os.listdir(tasks):
                try:
                    stat = (tasks / tid / "stat").read_text()
                except OSError:
                    continue
                fields = stat.rsplit(")", 1)[1].split()
                if fields[0] == "R":  # running or runnable
                    self.seen += 1
                    self.on += int(fields[36]) in self.cores  # its last core
            time.sleep(0.005)


def _pin_threads(cores: set[int]) -> None:
    """Every thread of this process onto ``cores`` (affinity is per thread)."""
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        with contextlib.suppress(OSError):  # ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", nargs="?", default="moe")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--per-batch", type=int, default=24)
    parser.add_argument("--variants", default="as-is")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
    peer = next(p for p in PEERS if p.key == args.system)
    log = Path(tempfile.gettempdir()) / f"s1_batches-{peer.key}.log"
    server = Server(peer, 1, log)
    everywhere = set(range(os.cpu_count() or 1))
    try:
        engine = next(
            p for p in processes(server.started_at) if "EngineCore" in title(p)
        )
        cores = set(engine.cpu_affinity() or everywhere)
        nice = os.getpriority(os.PRIO_PROCESS, engine.pid)
        print(
            f"{peer.label}: engine core {engine.pid} on cores {sorted(cores)}, "
            f"nice {nice}"
        )
        if cores == everywhere and set(variants) != {"as-is"}:
            parser.error("the engine core has no cores of its own: only as-is")
        sampler = Sampler(cores)
        stream = S1.requests()
        rows: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
        for b in range(args.batches * len(variants)):
            variant = variants[b % len(variants)]
            _pin_threads(everywhere - cores if variant == "client-off" else everywhere)
            if nice != 0:
                os.setpriority(
                    os.PRIO_PROCESS,
                    engine.pid,
                    0 if variant == "engine-nice-0" else nice,
                )
            sampler.reset()
            waited = cpu_waits([engine])[engine.pid][1]
            got = asyncio.run(closed(S1, 1, args.per_batch, warmup=0, requests=stream))
            after = cpu_waits([engine])[engine.pid][1]
            per_request = (after - waited) * 1e3 / args.per_batch
            tpot, tok_s = got["all"]["tpot_ms"]["p50"], got["all"]["output_tok_s"]
            rows[variant].append((tpot, tok_s, per_request))
            print(
                f"{b:3d} {variant:14s} TPOT p50 {tpot:.2f} ms, {tok_s:.0f} tok/s, "
                f"engine core waited {per_request:.1f} ms a request, load generator "
                f"runnable on its cores {sampler.share():.0%}",
                flush=True,
            )
        sampler.stop()
        for variant, got in rows.items():
            tpots, rates, waits = zip(*got, strict=True)
            print(
                f"{variant:14s} TPOT p50 median {statistics.median(tpots):.2f} ms "
                f"({min(tpots):.2f}-{max(tpots):.2f}), tok/s median "
                f"{statistics.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f}), "
                f"engine core waited {statistics.median(waits):.1f} ms a request "
                f"(at most {max(waits):.1f})"
            )
    finally:
        _pin_threads(everywhere)
        server.stop()


if __name__ == "__main__":
    main()
