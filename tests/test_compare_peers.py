"""``tests.perf.compare_peers``: which server each scenario runs on, over which
API, and what the table holds moe-cluster's gRPC figures against (no server is
started here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.perf import compare_peers as cp


class _Server:
    started: ClassVar[list[tuple[str, int, tuple[str, ...]]]] = []

    def __init__(
        self, peer: cp.Peer, replicas: int, log: Path, extra: tuple[str, ...] = ()
    ) -> None:
        self.log = log
        self.startup_s = 1.0
        _Server.started.append((log.name, replicas, extra))

    def stop(self) -> None:
        pass


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Each scenario run as (what, over gRPC, its arguments), in order."""
    seen: list[tuple[Any, ...]] = []
    _Server.started = []

    def summary(name: str) -> dict[str, Any]:
        return {"all": {"request_rate": 5.0, "name": name}}

    async def closed(workload: Any, concurrency: int, n: int, **kw: Any) -> Any:
        seen.append(("closed", kw.get("grpc", False), workload, kw.get("requests")))
        return summary("closed")

    async def flood(rate: float, duration_s: float, **kw: Any) -> Any:
        seen.append(("flood", kw.get("grpc", False), rate, kw.get("seed", 2)))
        return summary("flood")

    async def joining(server: Any, grpc: bool = False) -> Any:
        seen.append(("joining", grpc, server.log.name, None))
        return summary("joining")

    monkeypatch.setattr(cp, "Server", _Server)
    monkeypatch.setattr(cp, "closed", closed)
    monkeypatch.setattr(cp, "flood", flood)
    monkeypatch.setattr(cp, "joining", joining)
    return seen


def _peer(key: str) -> cp.Peer:
    return next(p for p in cp.PEERS if p.key == key)


def test_moe_runs_every_scenario_over_both_apis(
    calls: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    out = cp.run_peer(_peer("moe"), {"rate": 4.0}, tmp_path)
    assert "error" not in out
    http = {"S1", "S1c4", "S2", "S3", "S3b", "S3c"}
    grpc = {"S1g", "S1gc4", "S2g", "S3g", "S3bg", "S3cg"}
    assert http | grpc <= set(out)
    # S3b and S3c leave the store (or the replica set) changed: a fresh server
    # for each API, the same arguments; S1, S2 and S3 share theirs.
    assert _Server.started == [
        ("moe-1-S1-S2.log", 1, ()),
        ("moe-2-S3.log", 2, ()),
        ("moe-2-S3b.log", 2, ("--kv-cache-mib", "64")),
        ("moe-2-S3b-grpc.log", 2, ("--kv-cache-mib", "64")),
        ("moe-1-S3c.log", 1, ("--scalable",)),
        ("moe-1-S3c-grpc.log", 1, ("--scalable",)),
    ]
    floods = [c for c in calls if c[0] == "flood"]
    assert [(c[1], c[2]) for c in floods] == [(False, 8.0), (True, 8.0)]
    assert floods[0][3] != floods[1][3]  # fresh prompts: not the store's hits
    s3 = [c for c in calls if c[0] == "closed" and c[2] is cp.S3]
    assert [c[1] for c in s3] == [False, True]
    assert s3[0][3] is not None and s3[1][3] is s3[0][3]  # the stream goes on
    s3b = [c for c in calls if c[0] == "closed" and c[2] is cp.S3B]
    assert [c[1] for c in s3b] == [False, True]
    assert [c[1:3] for c in calls if c[0] == "joining"] == [
        (False, "moe-1-S3c.log"),
        (True, "moe-1-S3c-grpc.log"),
    ]


def test_an_http_only_peer_gets_no_grpc_run(
    calls: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    out = cp.run_peer(_peer("rsllm-prefix"), {}, tmp_path)
    assert {"S3", "S3b", "S3c"} <= set(out)
    assert not any(k.endswith("g") for k in out if k.startswith("S"))
    assert not any(c[1] for c in calls)
    assert [s[0] for s in _Server.started] == [
        "rsllm-prefix-2-S3.log",
        "rsllm-prefix-2-S3b.log",
        "rsllm-prefix-1-S3c.log",
    ]


def test_grpc_can_be_left_out(calls: list[tuple[Any, ...]], tmp_path: Path) -> None:
    out = cp.run_peer(_peer("moe"), {}, tmp_path, frozenset({"S3"}), frozenset())
    assert [k for k in out if k.startswith("S")] == ["S3"]
    assert [s[0] for s in _Server.started] == ["moe-2-S3.log"]


def _s(value: float) -> dict[str, Any]:
    stats = {"p50": value, "p99": 2 * value}
    return {
        "ttft_ms": stats,
        "tpot_ms": stats,
        "e2e_ms": stats,
        "output_tok_s": value,
        "cached_prompt_share": 0.5,
        "goodput": value,
        "errors": {},
    }


def test_table_holds_moe_grpc_against_the_peers_http() -> None:
    results = {
        "rsllm-prefix": {"S3b": {"all": _s(20.0)}, "startup_s_2": 1.0},
        "moe": {
            "S3b": {"all": _s(100.0)},
            "S3bg": {"all": _s(120.0)},
            "startup_s_2": 1.0,
        },
    }
    rows = {
        line.split(" | ")[1]: line
        for line in cp.markdown(results, {}).splitlines()
        if line.startswith("| S3b")
    }
    assert rows["output tok/s"].endswith("| 20 | 100 | 5.00x |")
    assert rows["gRPC: output tok/s"].endswith("| 20 | 120 | 6.00x |")
    assert rows["gRPC: TTFT p99 (ms)"].endswith("| 40 | 240 | 6.00x |")


def test_grpc_gets_the_prompts_the_http_text_tokenizes_to(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Path
) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setattr(cp, "MODEL_DIR", tiny_model)
    cp._served_ids.cache_clear()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    text = cp.text_prompts(str(tiny_model))
    stream = cp.S3B.requests()
    served = cp.as_served(stream)
    first = next(served)
    assert next(stream).index == first.index + 1  # lazily: one taken, one made
    again = next(cp.S3B.requests())
    assert first.prompt == tuple(tokenizer(text(again.prompt)).input_ids)
    assert (first.index, first.max_tokens) == (again.index, again.max_tokens)
    assert len(first.prompt) > len(again.prompt)  # the text re-tokenizes longer
    cp._served_ids.cache_clear()
