"""How much a busy neighbour core slows an engine's step on this node.

    .venv/bin/python -m tests.perf.neighbour [--seconds S] [--rounds N]
    .venv/bin/python -m tests.perf.neighbour --as-neighbour KIND [--duty D] [--cpu C]

A decode step of a small model on one core streams its weights from the caches
the node's cores share (the tiny model is 20 MiB of fp32: more than a core's L2,
less than the L3). The probe does the same on the node's last core: one thread
multiplying a few rows by 16 MiB of weight matrices, as a one-thread engine's
decode does. Beside it, on another core, runs each kind of neighbour in turn:

- ``none``: nothing.
- ``spin``: a Python loop adding integers (a core busy, next to no memory).
- ``python``: a Python loop reading and replacing entries of a dict of a
  million objects (what Python servers do: pointer chasing over a large heap).
- ``stream``: copying a 64 MiB array (a memory-bandwidth hog).

Each at ``--duty`` of the time (1.0 and 0.3 by default: busy for that share of
every 10 ms). It prints the probe's time per pass and its ratio to ``none``.
A ratio above 1 for ``python`` or ``stream`` and not for ``spin`` means the
cores share what the step needs (cache or memory bandwidth) and the rest of a
serving cluster on the other core costs the engine time even when it never
takes the engine's core.

``--as-neighbour KIND`` runs one neighbour alone until killed, on core ``--cpu``
(any core by default), to put beside a server under load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

PERIOD_S = 0.01
KINDS = ("none", "spin", "python", "stream")


def neighbour(kind: str, duty: float) -> None:
    """Runs ``kind`` for ``duty`` of every ``PERIOD_S``, forever."""
    if kind == "spin":
        x = 0

        def work() -> None:
            nonlocal x
            for _ in range(2000):
                x += 1

    elif kind == "python":
        import random

        heap = {i: (i, str(i)) for i in range(1_000_000)}
        keys = list(heap)
        random.shuffle(keys)
        at = 0

        def work() -> None:
            nonlocal at
            for _ in range(2000):
                k = keys[at]
                heap[k] = (heap[k][0] + 1, heap[k][1])
                at = (at + 1) % len(keys)

    elif kind == "stream":
        import numpy as np

        src = np.ones(64 << 20, dtype=np.uint8)
        dst = np.empty_like(src)

        def work() -> None:
            np.copyto(dst[: 8 << 20], src[: 8 << 20])
            src[:1] += 1

    else:
        raise ValueError(f"unknown neighbour {kind!r}")
    print("ready", flush=True)  # its heap or arrays built
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < duty * PERIOD_S:
            work()
        if duty < 1:
            time.sleep(max(0.0, PERIOD_S - (time.perf_counter() - start)))


def probe(seconds: float) -> float:
    """Median ms per pass of one thread streaming 16 MiB of weights, over
    ``seconds``."""
    import torch

    torch.set_num_threads(1)
    weights = [torch.randn(1024, 1024) for _ in range(4)]  # 16 MiB of fp32
    x = torch.randn(4, 1024)

    def one() -> None:
        for w in weights:
            x @ w

    for _ in range(20):
        one()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(10):
            one()
        times.append((time.perf_counter() - t) / 10 * 1e3)
    return statistics.median(times)


def start(kind: str, duty: float, cpu: int) -> subprocess.Popen[bytes]:
    """A neighbour on core ``cpu``, returned once it is ready to work."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.perf.neighbour",
            "--as-neighbour",
            kind,
            "--duty",
            str(duty),
            "--cpu",
            str(cpu),
        ],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        proc.kill()
        raise RuntimeError(f"neighbour {kind} did not start")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duty", type=float, nargs="*", default=[1.0, 0.3])
    ap.add_argument("--as-neighbour", choices=KINDS[1:])
    ap.add_argument("--cpu", type=int, default=-1)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.as_neighbour:
        if args.cpu >= 0:
            os.sched_setaffinity(0, {args.cpu})
        neighbour(args.as_neighbour, args.duty[0])
        return
    if len(cores) < 2:
        sys.exit("needs two cores: the probe's and its neighbour's")
    probe_core, other = cores[-1], cores[0]
    os.sched_setaffinity(0, {probe_core})
    print(
        f"probe on core {probe_core}, neighbour on core {other}; "
        f"ms per pass (median of {args.seconds:.0f} s), ratio to none"
    )
    results: dict[tuple[str, float], list[float]] = {}
    for r in range(args.rounds):
        for kind in KINDS:
            for duty in [1.0] if kind == "none" else args.duty:
                proc = start(kind, duty, other) if kind != "none" else None
                try:
                    ms = probe(args.seconds)
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()
                results.setdefault((kind, duty), []).append(ms)
                base = results[("none", 1.0)][-1]
                print(
                    f"round {r + 1}  {kind:6s} duty {duty:.1f}  "
                    f"{ms:7.3f} ms  {ms / base:5.2f}x",
                    flush=True,
                )
    print("\nmedian over rounds, ratio to none:")
    base = statistics.median(results[("none", 1.0)])
    for (kind, duty), v in results.items():
        m = statistics.median(v)
        print(f"  {kind:6s} duty {duty:.1f}  {m:7.3f} ms  {m / base:5.2f}x")


if __name__ == "__main__":
    main()
