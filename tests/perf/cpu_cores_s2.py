"""S2 for moe-cluster under one ``engine.cpu_cores`` layout, longer than bench-peers'.

    .venv/bin/python -m tests.perf.cpu_cores_s2 {shared|pinned|reserved|auto}
        [--seconds 90] [--capacity REQ_S] [--label L]

One engine replica, as ``make bench-peers`` starts moe-cluster (HAProxy, one
OpenMP thread), with ``engine.cpu_cores`` set; then bench-peers' S2: a realtime
stream (0.5 req/s) under background at twice ``--capacity`` (bench-peers prints
the capacity it measured), for ``--seconds`` (bench-peers' 30 s gives 15
realtime requests, too few for a p99). Prints the realtime TTFT and TPOT and the
background's throughput, and appends the run to
``tests/perf/results/cpu_cores_s2.jsonl``. Alternate the layouts to compare them:
the machine's pace moves between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from tests.perf.compare_peers import PEERS, RESULTS, Server, flood, machine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cpu_cores", choices=("shared", "pinned", "reserved", "auto"))
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--capacity", type=float, required=True)
    p.add_argument("--label", default="")
    args = p.parse_args()
    base = next(peer for peer in PEERS if peer.key == "moe")
    extra = ["--engine-json", json.dumps({"cpu_cores": args.cpu_cores})]
    peer = base.with_args(extra)
    logs = Path(tempfile.mkdtemp(prefix="cpu-cores-s2-"))
    server = Server(peer, 1, logs / "server.log")
    try:
        out = asyncio.run(flood(2 * args.capacity, args.seconds))
    finally:
        server.stop()
    rt, bg = out["realtime"], out["background"]
    ttft = {k: round(rt["ttft_ms"][k], 1) for k in ("p50", "p90", "p99")}
    tpot = {k: round(rt["tpot_ms"][k], 2) for k in ("p50", "p99")}
    print(
        f"{args.cpu_cores}: realtime {rt['completed']} requests, TTFT {ttft} ms, "
        f"TPOT {tpot} ms; background {bg['output_tok_s']:.1f} tok/s "
        f"(refused {bg['errors']})"
    )
    row = {
        "label": args.label,
        "cpu_cores": args.cpu_cores,
        "machine": machine(),
        "command": f"python -m tests.perf.cpu_cores_s2 {args.cpu_cores} "
        f"--seconds {args.seconds:g} --capacity {args.capacity:g}",
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "realtime_ttft_ms": rt["ttft_ms"],
        "realtime_requests": rt["completed"],
        "background_output_tok_s": bg["output_tok_s"],
        "S2": out,
    }
    with (RESULTS / "cpu_cores_s2.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
