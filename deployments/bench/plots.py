"""PNG plots of a run: latency CDFs per class and output tokens/s over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from deployments.bench.runner import RequestRecord


def tokens_per_second(records: Sequence[RequestRecord]) -> list[float]:
    """Output tokens in each second of the run (1 s bins from the start)."""
    end = max((r.end_s for r in records), default=0.0)
    counts = [0.0] * (int(end) + 1)
    for r in records:
        # An SSE event may carry several tokens (servers batch streams) but is
        # recorded as one: spread the server's count evenly over the chunks.
        scale = r.output_tokens / max(1, sum(r.chunk_tokens))
        for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True):
            counts[min(int(t), len(counts) - 1)] += n * scale
    return counts


def write_plots(records: Sequence[RequestRecord], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.ok]
    classes = sorted({r.qos for r in ok})
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (title, metric) in zip(
        axes,
        (("TTFT", lambda r: r.ttft_s), ("end-to-end latency", lambda r: r.e2e_s)),
        strict=True,
    ):
        for qos in classes:
            xs = sorted(
                v * 1e3 for r in ok if r.qos == qos and (v := metric(r)) is not None
            )
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=qos)
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
        if classes:
            ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for qos in [*classes, "all"]:
        counts = tokens_per_second([r for r in ok if qos in (r.qos, "all")])
        ax.plot(
            range(len(counts)), counts, label=qos, linewidth=2 if qos == "all" else 1
        )
    ax.set(title="output tokens/s over time", xlabel="s since start", ylabel="tok/s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
