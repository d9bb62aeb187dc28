"""Long greedy gRPC streams run in threads while a test breaks something under them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from deployments.proto import inference_pb2 as pb
from tests.integration.conftest import Served, wait_until


@dataclass
class Stream:
    """What one stream's client got: its tokens and text pieces, when each chunk
    came, and how it ended (the ``Finished`` message, or an error code)."""

    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    at: list[float] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # tokens so far, per chunk
    finished: Any = None
    code: grpc.StatusCode | None = None
    details: str = ""

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.at, self.at[1:], strict=False)]

    def resumed_at(self, tokens_sent: int) -> float:
        """When the first chunk past ``tokens_sent`` tokens came: a stream that
        migrated after that many, its first chunk from the new replica."""
        return next(
            t for t, n in zip(self.at, self.ends, strict=True) if n > tokens_sent
        )


def migrated_after(served: Served, rid: str) -> int:
    """How many tokens request ``rid`` had sent when it migrated (the migration
    event of its trace; it migrated once)."""
    assert served.traces is not None
    traces = served.traces

    def migration() -> list[dict[str, Any]] | None:
        found = [
            attrs
            for s in traces.spans()
            if s.attributes.get("gen_ai.response.id") == rid
            for name, attrs in s.events
            if name == "migration"
        ]
        return found or None

    [event] = wait_until(migration, 30, f"the migration event of {rid}'s trace")
    return int(event["moe_cluster.migration.tokens_sent"])


def start(
    served: Served, rids: list[str], prompt: list[int], max_tokens: int, after: int
) -> tuple[dict[str, Stream], list[threading.Thread]]:
    """Starts one greedy stream per id (``ignore_eos``: each runs ``max_tokens``);
    returns once every stream has ``after`` tokens (or ended)."""
    streams = {rid: Stream() for rid in rids}
    ready = threading.Semaphore(0)

    def run(rid: str) -> None:
        out = streams[rid]
        request = pb.GenerateRequest(
            request_id=rid,
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True
            ),
        )
        told = False
        try:
            for msg in served.client().generate(request, timeout=180):
                if msg.HasField("chunk"):
                    out.tokens += msg.chunk.token_ids
                    out.text.append(msg.chunk.text)
                    out.at.append(time.monotonic())
                    out.ends.append(len(out.tokens))
                    if not told and len(out.tokens) >= after:
                        told = True
                        ready.release()
                elif msg.HasField("finished"):
                    out.finished = msg.finished
        except grpc.RpcError as e:
            out.code, out.details = e.code(), e.details() or ""
        if not told:
            ready.release()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in rids]
    for t in threads:
        t.start()
    for _ in rids:
        assert ready.acquire(timeout=90), "a stream never got going"
    return streams, threads


def join(threads: list[threading.Thread], timeout_s: float = 180) -> None:
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a stream hung"


def uninterrupted(
    streams: dict[str, Stream], moved: list[str], max_tokens: int
) -> Stream:
    """Asserts every stream finished with the tokens and text of one that never
    moved (no gap, no duplicate across a seam); returns that one."""
    assert all(s.code is None for s in streams.values()), streams
    reference = streams[next(r for r in streams if r not in moved)]
    assert len(reference.tokens) == max_tokens
    for rid, out in streams.items():
        assert out.tokens == reference.tokens, rid
        assert "".join(out.text) == "".join(reference.text), rid
        assert out.finished.completion_tokens == max_tokens
    return reference


def served_elsewhere(served: Served, away_from: str, n: int = 4) -> None:
    """Asserts ``n`` short requests are served, none by replica ``away_from``."""
    # Greedy and past EOS: a sampled token can be EOS, ending a request early.
    short = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6]),
        sampling=pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
    )
    for _ in range(n):
        msgs = list(served.client().generate(short, timeout=60))
        assert msgs[-1].finished.completion_tokens == 4, msgs
        assert msgs[-1].finished.replica_id != away_from
