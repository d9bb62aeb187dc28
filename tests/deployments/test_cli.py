"""What `moe-cluster serve` does around the cluster it starts, without one."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from deployments.cli import end_leftover_haproxy

NODE = "ab" * 28  # a Ray node id: 56 hex digits
OTHER = "cd" * 28


def fake_haproxy(bin_dir: Path, node: str) -> subprocess.Popen[bytes]:
    """A process whose command line reads like Serve's HAProxy for ``node``."""
    exe = bin_dir / "haproxy"
    if not exe.exists():
        exe.symlink_to(sys.executable)
    cfg = f"/tmp/haproxy-serve/{node}/haproxy.cfg"
    return subprocess.Popen(
        [str(exe), "-c", "import time; time.sleep(60)", "-db", "-f", cfg]
    )


def test_leftover_haproxy_of_this_node_is_ended_and_no_other(tmp_path: Path) -> None:
    ours = fake_haproxy(tmp_path, NODE)
    theirs = fake_haproxy(tmp_path, OTHER)
    try:
        deadline = time.monotonic() + 10
        while len(psutil.Process(ours.pid).cmdline()) < 3:  # exec'd
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert end_leftover_haproxy(NODE) == [ours.pid]
        assert ours.wait(10) is not None
        assert theirs.poll() is None
        assert end_leftover_haproxy(NODE) == []
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
