"""What it means: latency percentiles, throughput and goodput per QoS class."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from deployments.bench.runner import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Slo:
    """A request is good when it succeeded and met every limit given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (
            r.ttft_s is None or r.ttft_s * 1e3 > self.ttft_ms
        ):
            return False
        tpot = r.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


def latency_stats(values_s: Sequence[float]) -> dict[str, float]:
    """mean and percentiles (numpy's linear interpolation), in milliseconds."""
    if not values_s:
        return {"mean": math.nan} | {f"p{p}": math.nan for p in PERCENTILES}
    ms = np.asarray(values_s, dtype=float) * 1e3
    out = {"mean": float(ms.mean())}
    out |= {
        f"p{p}": float(x)
        for p, x in zip(PERCENTILES, np.percentile(ms, PERCENTILES), strict=True)
    }
    return out


def summarize_group(
    records: Sequence[RequestRecord], duration_s: float, slo: Slo
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = [r for r in ok if r.cached_tokens is not None]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": dict(Counter(r.error for r in records if r.error)),
        "ttft_ms": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency_stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": latency_stats([g for r in ok for g in r.itls_s()]),
        "e2e_ms": latency_stats([r.e2e_s for r in ok]),
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration_s,
        "total_tok_s": (out_tokens + prompt_tokens) / duration_s,
        "request_rate": len(ok) / duration_s,
        "goodput": sum(slo.met_by(r) for r in records) / duration_s,
        "cached_prompt_share": (
            sum(r.cached_tokens or 0 for r in cached)
            / max(1, sum(r.prompt_tokens for r in cached))
            if cached
            else None
        ),
    }


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: Slo
) -> dict[str, Any]:
    """``{"all": ..., "realtime": ..., ...}``: one summary per class seen."""
    out = {"all": summarize_group(records, duration_s, slo)}
    for qos in sorted({r.qos for r in records}):
        group = [r for r in records if r.qos == qos]
        out[qos] = summarize_group(group, duration_s, slo)
    return out


def result_json(
    config: dict[str, Any],
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: Slo,
) -> dict[str, Any]:
    return {
        "config": config,
        "duration_s": duration_s,
        "slo": asdict(slo),
        "summary": summarize(records, duration_s, slo),
        "records": [asdict(r) for r in records],
    }


def table(summary: dict[str, Any]) -> str:
    """A fixed-width table of the headline numbers per class."""
    head = (
        f"{'class':<11}{'done':>6}{'err':>5}{'ttft p50':>10}{'ttft p99':>10}"
        f"{'tpot p50':>10}{'itl p99':>9}{'e2e p99':>10}{'out tok/s':>11}"
        f"{'req/s':>8}{'goodput':>9}{'cached':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        cached = s["cached_prompt_share"]
        lines.append(
            f"{name:<11}{s['completed']:>6}{sum(s['errors'].values()):>5}"
            f"{s['ttft_ms']['p50']:>10.1f}{s['ttft_ms']['p99']:>10.1f}"
            f"{s['tpot_ms']['p50']:>10.2f}{s['itl_ms']['p99']:>9.2f}"
            f"{s['e2e_ms']['p99']:>10.1f}{s['output_tok_s']:>11.1f}"
            f"{s['request_rate']:>8.2f}{s['goodput']:>9.2f}"
            f"{'-' if cached is None else f'{cached:.0%}':>8}"
        )
    errors = {k: v for s in summary.values() for k, v in s["errors"].items()}
    if errors:
        lines.append(
            "errors (all classes): "
            + ", ".join(f"{code} x{n}" for code, n in summary["all"]["errors"].items())
        )
    return "\n".join(lines) + "\n(latencies in ms)"
