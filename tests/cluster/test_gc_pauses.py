"""``gc_pauses.settle``: what a process built is frozen, and full collections
come ``FULL_EVERY`` generation-1 collections apart instead of CPython's 10.
Run in a child process: the collector's state is the whole process's."""

from __future__ import annotations

import json
import subprocess
import sys

from cluster import gc_pauses

CHILD = """
import gc, json
from cluster import gc_pauses
built = [[i] for i in range(50_000)]  # what a process builds while it starts
before = gc.get_threshold()
gc_pauses.settle("test")
after = gc.get_threshold()
frozen = gc.get_freeze_count()
# Count the full collections while generation 1 is collected 150 times.
full = []
gc.callbacks.append(
    lambda phase, info: phase == "start" and info["generation"] == 2 and full.append(1)
)
kept = []
middle = gc.get_stats()[1]["collections"]
while gc.get_stats()[1]["collections"] - middle < 150:
    kept.append([len(kept)])  # survives: promoted towards the oldest generation
middle = gc.get_stats()[1]["collections"] - middle
print(json.dumps({"before": before, "after": after, "frozen": frozen,
                  "full": len(full), "middle": middle}))
"""


def test_settle_freezes_the_start_and_spaces_full_collections() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True
    )
    out = json.loads(done.stdout.splitlines()[-1])
    young, middle, full = out["before"]
    assert full == 10  # CPython's own
    assert out["after"] == [young, middle, gc_pauses.FULL_EVERY]
    assert out["frozen"] >= 50_000  # the start's objects are never walked again
    # 150 generation-1 collections: CPython would run ~15 full ones, here 1.
    assert out["middle"] >= 150
    assert 1 <= out["full"] <= out["middle"] // gc_pauses.FULL_EVERY
