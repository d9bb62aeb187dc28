"""S1 against bare vLLM, repeated: moe-cluster's throughput ratio with a
confidence interval, where one ``make bench-peers`` run gives a single draw.

    make bench-s1-pairs     # or: .venv/bin/python -m tests.perf.s1_pairs
        [--rounds K] [--peers moe,vllm,vllm-nostats] [--more]

On a small VM the pace of a server moves from one start to the next by more
than the 5% the S1 goal turns on (bare vLLM's one-stream tok/s spanned 100-141
over eight starts of the same command). So each round starts every peer afresh,
one after the other, in an order that rotates from round to round (each peer
runs first, second, ... equally often, so a drift over the run does not favour
one), and runs ``make bench-peers``' S1 on it: the same prompts, one and four
streams, over HTTP (and gRPC for moe-cluster). A round's ratio is
moe-cluster's output tok/s over the reference's in that round; the summary is
the geometric mean of the rounds' ratios with a 95% confidence interval
(Student's t on the log ratios), and their range.

Writes ``tests/perf/results/s1_pairs-<backend>.{json,md}``; ``--more`` adds
rounds to the recorded ones.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from typing import Any

from tests.perf.compare_peers import PEERS, RESULTS, machine, per_cpu, run_peer

# moe-cluster's S1 points, and the reference's point each is measured against
# (the reference serves HTTP only: moe-cluster's gRPC is held against it too).
POINTS = (
    ("S1", "S1", "c=1 HTTP"),
    ("S1g", "S1", "c=1 gRPC"),
    ("S1c4", "S1c4", "c=4 HTTP"),
    ("S1gc4", "S1c4", "c=4 gRPC"),
)

# Student's t, two-sided 95%, by degrees of freedom (1-30).
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t95(df: int) -> float:
    if df < 1:
        raise ValueError("a confidence interval needs two or more rounds")
    return _T95[df - 1] if df <= len(_T95) else 1.96


def ratio_summary(ratios: Sequence[float]) -> dict[str, float]:
    """Geometric mean of ``ratios`` and its 95% interval (t on the logs); the
    interval is NaN for a single ratio."""
    if not ratios or any(r <= 0 for r in ratios):
        raise ValueError(f"ratios must be positive, got {list(ratios)}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) > 1:
        half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        low, high = math.exp(mean - half), math.exp(mean + half)
    else:
        low = high = math.nan
    return {
        "geomean": math.exp(mean),
        "ci95_low": low,
        "ci95_high": high,
        "min": min(ratios),
        "max": max(ratios),
        "rounds": len(ratios),
    }


def rotated(keys: Sequence[str], round_: int) -> list[str]:
    k = round_ % len(keys)
    return [*keys[k:], *keys[:k]]


def tok_s(result: dict[str, Any], point: str) -> float | None:
    s = result.get(point, {}).get("all")
    return float(s["output_tok_s"]) if s and s.get("completed") else None


def ratios(
    rounds: Sequence[dict[str, dict[str, Any]]], reference: str
) -> dict[str, list[float]]:
    """Per moe-cluster point, its tok/s over ``reference``'s in each round both
    completed."""
    out: dict[str, list[float]] = {}
    for moe_point, ref_point, label in POINTS:
        got = []
        for r in rounds:
            moe = tok_s(r.get("moe", {}), moe_point)
            ref = tok_s(r.get(reference, {}), ref_point)
            if moe and ref:
                got.append(moe / ref)
        out[label] = got
    return out


def markdown(rounds: Sequence[dict[str, dict[str, Any]]], keys: Sequence[str]) -> str:
    label = {p.key: p.label for p in PEERS}
    lines = [machine().rstrip("\n"), ""]
    head = "| round | order | " + " | ".join(
        f"{label[k]} {name}"
        for k in keys
        for _, _, name in (POINTS if k == "moe" else POINTS[::2])
    )
    head += " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(rounds):
        cells = []
        for k in keys:
            for moe_point, ref_point, _ in POINTS if k == "moe" else POINTS[::2]:
                v = tok_s(r.get(k, {}), moe_point if k == "moe" else ref_point)
                cells.append(f"{v:.1f}" if v else "-")
        order = ", ".join(rotated(keys, i))
        lines.append(f"| {i + 1} | {order} | " + " | ".join(cells) + " |")
    lines += ["", "Output tok/s. moe-cluster / reference, over the rounds:", ""]
    lines += [
        "| reference | point | geometric mean | 95% interval | range | rounds |",
        "|---|---|---|---|---|---|",
    ]
    for ref in keys:
        if ref == "moe":
            continue
        for point, rs in ratios(rounds, ref).items():
            if not rs:
                continue
            s = ratio_summary(rs)
            ci = f"{s['ci95_low']:.3f}-{s['ci95_high']:.3f}" if len(rs) > 1 else "-"
            lines.append(
                f"| {label[ref]} | {point} | {s['geomean']:.3f} | {ci} | "
                f"{s['min']:.3f}-{s['max']:.3f} | {len(rs)} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--more",
        action="store_true",
        help="add the rounds to those the last run recorded (same peers), "
        "continuing its rotation",
    )
    p.add_argument(
        "--peers",
        default="moe,vllm,vllm-nostats",
        help="moe and the references, each started once a round",
    )
    args = p.parse_args()
    keys = args.peers.split(",")
    known = {peer.key: peer for peer in PEERS}
    unknown = [k for k in keys if k not in known]
    if unknown or "moe" not in keys or len(keys) < 2:
        p.error(f"--peers: moe and one or more of {sorted(known)}; got {keys}")
    stem = per_cpu("s1_pairs")
    rounds: list[dict[str, dict[str, Any]]] = []
    if args.more:
        if not (RESULTS / f"{stem}.json").exists():
            p.error(f"--more: no rounds recorded in {RESULTS / stem}.json")
        recorded = json.loads((RESULTS / f"{stem}.json").read_text())
        if recorded["peers"] != keys:
            p.error(f"--more: the recorded rounds ran {recorded['peers']}, not {keys}")
        rounds = recorded["rounds"]
    if args.rounds < 1 or len(rounds) + args.rounds < 2:
        p.error("--rounds: two or more in all (a confidence interval needs them)")
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    first = len(rounds)
    for i in range(first, first + args.rounds):
        this: dict[str, dict[str, Any]] = {}
        rounds.append(this)
        for key in rotated(keys, i):
            print(f"== round {i + 1}/{first + args.rounds}: {key}", flush=True)
            this[key] = run_peer(known[key], {}, logs, frozenset({"S1"}))
            if "error" in this[key]:
                print(f"   failed: {this[key]['error']}", flush=True)
        (RESULTS / f"{stem}.json").write_text(
            json.dumps({"peers": keys, "rounds": rounds}, indent=1)
        )
        print(markdown(rounds, keys), flush=True)
    (RESULTS / f"{stem}.md").write_text(markdown(rounds, keys))


if __name__ == "__main__":
    main()
