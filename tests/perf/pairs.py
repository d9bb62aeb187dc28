"""One ``make bench-peers`` scenario, repeated in rounds: moe-cluster's ratio to
each reference with a confidence interval, where one bench-peers run gives a
single draw.

    make bench-s1-pairs     # or: .venv/bin/python -m tests.perf.pairs --scenario S1
    make bench-s3-pairs     # or: .venv/bin/python -m tests.perf.pairs --scenario S3
        [--rounds K] [--peers moe,REF,...] [--more] [--label L]

On a small VM the pace of a server moves from one start to the next by more
than the margins the goals turn on (bare vLLM's one-stream tok/s spanned 78-144
over fourteen starts of the same command; Ray Serve LLM's prefix router gave S3
79.5, 80.6 and 153.8 tok/s in three bench-peers runs). So each round starts
every peer afresh, one after the other, in an order that rotates from round to
round (each peer runs first, second, ... equally often, so a drift over the run
does not favour one), and runs bench-peers' own scenario on it (``run_peer``):
the same prompts, replicas and concurrency.

- S1 (one replica; one and four streams; moe-cluster over HTTP and gRPC, each
  held against the reference's HTTP point): output tok/s. References: bare vLLM
  with its statistics on and off.
- S3 (two replicas, four shared prefixes, eight streams): output tok/s, and the
  TTFT p50 and p99, for moe-cluster as it runs by default (least-loaded
  placement) and with its ``prefix`` policy. References: Ray Serve LLM with its
  prefix router, and with its default one.

Peers whose key starts with ``moe`` are the subjects, the others the
references. A round's ratio is a subject's figure over a reference's in that
round (for TTFT, lower is better); the summary is the geometric mean of the
rounds' ratios with a 95% confidence interval (Student's t on the log ratios),
and their range.

Writes ``tests/perf/results/<scenario>_pairs-<backend>.{json,md}``, or
``...-<backend>-<label>.{json,md}`` with ``--label`` (a run kept beside the
others: a setting tried, another day's code); ``--more`` adds rounds to the
ones recorded under the same name.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tests.perf.compare_peers import (
    PEERS,
    RESULTS,
    is_moe,
    machine,
    per_cpu,
    run_peer,
)

LABEL = re.compile(r"[A-Za-z0-9_-]+")  # a part of a file name, nothing more


@dataclass(frozen=True)
class Point:
    moe: str  # the subject's (moe-cluster's) result key
    ref: str  # the reference's result key it is held against
    label: str
    metric: str = "output_tok_s"  # or "ttft_p50", "ttft_p99"


@dataclass(frozen=True)
class Scenario:
    name: str  # run_peer's scenario
    points: tuple[Point, ...]
    peers: str  # the default --peers
    grpc: bool = False  # moe-cluster's gRPC points too (run_peer's grpc)


SCENARIOS = {
    s.name: s
    for s in (
        # The reference serves HTTP only: moe-cluster's gRPC is held against it too.
        Scenario(
            "S1",
            (
                Point("S1", "S1", "c=1 HTTP"),
                Point("S1g", "S1", "c=1 gRPC"),
                Point("S1c4", "S1c4", "c=4 HTTP"),
                Point("S1gc4", "S1c4", "c=4 gRPC"),
            ),
            "moe,vllm,vllm-nostats",
            grpc=True,
        ),
        Scenario(
            "S3",
            (
                Point("S3", "S3", "tok/s"),
                Point("S3", "S3", "TTFT p50", "ttft_p50"),
                Point("S3", "S3", "TTFT p99", "ttft_p99"),
            ),
            "moe,moe-prefix,rsllm-prefix,rsllm",
        ),
    )
}

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


def value(result: dict[str, Any], point: str, metric: str) -> float | None:
    """``metric`` of ``result[point]``; None where the point failed or completed
    no request."""
    s = result.get(point, {}).get("all")
    if not s or not s.get("completed"):
        return None
    if metric == "output_tok_s":
        v = float(s["output_tok_s"])
    elif metric in ("ttft_p50", "ttft_p99"):
        v = float(s["ttft_ms"][metric.removeprefix("ttft_")])
    else:
        raise ValueError(f"unknown metric {metric!r}")
    return v if v > 0 else None


def ratios(
    rounds: Sequence[dict[str, dict[str, Any]]],
    reference: str,
    scenario: Scenario = SCENARIOS["S1"],
    subject: str = "moe",
) -> dict[str, list[float]]:
    """Per point, ``subject``'s figure over ``reference``'s in each round both
    completed."""
    out: dict[str, list[float]] = {}
    for p in scenario.points:
        got = []
        for r in rounds:
            moe = value(r.get(subject, {}), p.moe, p.metric)
            ref = value(r.get(reference, {}), p.ref, p.metric)
            if moe and ref:
                got.append(moe / ref)
        out[p.label] = got
    return out


def _columns(key: str, scenario: Scenario) -> list[Point]:
    """A subject's points, or a reference's (each (key, metric) once)."""
    if is_moe(key):
        return list(scenario.points)
    seen: dict[tuple[str, str], Point] = {}
    for p in scenario.points:
        seen.setdefault((p.ref, p.metric), p)
    return list(seen.values())


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 1000 else f"{v:.1f}"


def markdown(
    rounds: Sequence[dict[str, dict[str, Any]]],
    keys: Sequence[str],
    scenario: Scenario = SCENARIOS["S1"],
) -> str:
    label = {p.key: p.label for p in PEERS}
    unit = {"output_tok_s": "", "ttft_p50": " (ms)", "ttft_p99": " (ms)"}
    lines = [machine().rstrip("\n"), ""]
    head = "| round | order | " + " | ".join(
        f"{label[k]} {p.label}{unit[p.metric]}"
        for k in keys
        for p in _columns(k, scenario)
    )
    head += " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(rounds):
        cells = [
            _fmt(value(r.get(k, {}), p.moe if is_moe(k) else p.ref, p.metric))
            for k in keys
            for p in _columns(k, scenario)
        ]
        order = ", ".join(rotated(keys, i))
        lines.append(f"| {i + 1} | {order} | " + " | ".join(cells) + " |")
    ttft = any(p.metric != "output_tok_s" for p in scenario.points)
    lines += [
        "",
        ("Output tok/s and TTFT" if ttft else "Output tok/s")
        + ". moe-cluster / reference, over the rounds"
        + (" (TTFT: below 1 is faster):" if ttft else ":"),
        "",
        "| moe-cluster | reference | point | geometric mean | 95% interval | range "
        "| rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for subject in filter(is_moe, keys):
        for ref in keys:
            if is_moe(ref):
                continue
            for point, rs in ratios(rounds, ref, scenario, subject).items():
                if not rs:
                    continue
                s = ratio_summary(rs)
                ci = f"{s['ci95_low']:.3f}-{s['ci95_high']:.3f}" if len(rs) > 1 else "-"
                lines.append(
                    f"| {label[subject]} | {label[ref]} | {point} | "
                    f"{s['geomean']:.3f} | {ci} | {s['min']:.3f}-{s['max']:.3f} | "
                    f"{len(rs)} |"
                )
    return "\n".join(lines) + "\n"


def result_stem(scenario: str, label: str = "") -> str:
    """The result files' name: ``<scenario>_pairs-<backend>``, then ``-<label>``."""
    stem = per_cpu(f"{scenario.lower()}_pairs")
    if not label:
        return stem
    if not LABEL.fullmatch(label):
        raise ValueError(f"letters, digits, - and _ only; got {label!r}")
    return f"{stem}-{label}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="S1")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--more",
        action="store_true",
        help="add the rounds to those the last run recorded (same peers), "
        "continuing its rotation",
    )
    p.add_argument(
        "--peers",
        help="moe-cluster's peers and the references, each started once a round "
        "(default: the scenario's)",
    )
    p.add_argument(
        "--label",
        default="",
        help="name the result files ...-<backend>-<label> (letters, digits, - or _)",
    )
    args = p.parse_args()
    scenario = SCENARIOS[args.scenario]
    keys = (args.peers or scenario.peers).split(",")
    known = {peer.key: peer for peer in PEERS}
    unknown = [k for k in keys if k not in known]
    if unknown or not any(map(is_moe, keys)) or all(map(is_moe, keys)):
        p.error(
            f"--peers: one or more moe-cluster peers (moe...) and one or more "
            f"references, of {sorted(known)}; got {keys}"
        )
    cannot = [k for k in keys if scenario.name not in known[k].scenarios]
    if cannot:
        p.error(f"--peers: {cannot} do not run {scenario.name}")
    try:
        stem = result_stem(scenario.name, args.label)
    except ValueError as e:
        p.error(f"--label: {e}")
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
            this[key] = run_peer(
                known[key],
                {},
                logs,
                frozenset({scenario.name}),
                frozenset({scenario.name} if scenario.grpc else ()),
            )
            if "error" in this[key]:
                print(f"   failed: {this[key]['error']}", flush=True)
        (RESULTS / f"{stem}.json").write_text(
            json.dumps(
                {"scenario": scenario.name, "peers": keys, "rounds": rounds}, indent=1
            )
        )
        print(markdown(rounds, keys, scenario), flush=True)
    (RESULTS / f"{stem}.md").write_text(markdown(rounds, keys, scenario))


if __name__ == "__main__":
    main()
