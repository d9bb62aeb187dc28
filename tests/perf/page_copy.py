"""Page load bandwidth: arena page -> engine cache buffer, against a plain memcpy.

    .venv/bin/python -m tests.perf.page_copy

Two page sizes: one vLLM block (16 tokens) of the tiny model across its 4 layers
(MLA latent 576 x fp32: 147 KiB) and of DeepSeek-V3 (64 tokens x 61 layers x 576 x
bf16: 4.3 MiB). For each: a plain ``np.copyto`` between two private buffers, the
arena copy alone (shared memory -> private buffer), and the arena load as the store
does it (copy + xxh3 check of what arrived).
"""

from __future__ import annotations

import time
import uuid

import numpy as np

from kvstore.arena import Arena

SIZES = {
    "tiny (16 tok x 4 layers x 576 x fp32)": 16 * 4 * 576 * 4,
    "DeepSeek-V3 (64 tok x 61 layers x 576 x bf16)": 64 * 61 * 576 * 2,
}
TOTAL_BYTES = 1 << 30


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure(page_bytes: int) -> dict[str, float]:
    pages = max(4, TOTAL_BYTES // page_bytes // 4)
    arena = Arena.create(f"moe-perf-{uuid.uuid4().hex[:8]}", pages, page_bytes)
    try:
        src = np.random.default_rng(0).integers(
            0, 255, (pages, page_bytes), dtype=np.uint8
        )
        checksums = [arena.write(i, src[i]) for i in range(pages)]
        dst = np.empty((pages, page_bytes), dtype=np.uint8)
        moved = pages * page_bytes * 4
        dst.fill(1)  # fault the destination in before timing
        results = {}
        t = time.perf_counter()
        for _ in range(4):
            for i in range(pages):
                np.copyto(dst[i], src[i])
        results["memcpy"] = _rate(moved, time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(4):
            for i in range(pages):
                np.copyto(dst[i], arena.page(i))
        results["arena copy"] = _rate(moved, time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(4):
            for i in range(pages):
                arena.read_into(i, dst[i], checksums[i])
        results["arena load (copy + xxh3)"] = _rate(moved, time.perf_counter() - t)
        return results
    finally:
        arena.close()


def main() -> None:
    print("| page | memcpy GB/s | arena copy GB/s | arena load (copy + xxh3) GB/s |")
    print("|---|---|---|---|")
    for label, size in SIZES.items():
        r = measure(size)
        print(
            f"| {label}, {size / 1024:.0f} KiB | {r['memcpy']:.1f} | "
            f"{r['arena copy']:.1f} | {r['arena load (copy + xxh3)']:.1f} |"
        )


if __name__ == "__main__":
    main()
