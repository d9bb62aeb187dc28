"""The chaos suite's load, and what clients saw when a component was killed under it.

Six closed-loop greedy gRPC streams of 96 tokens, realtime, normal and background in
turn. A ``Row`` counts requests lost (no answer at all), streams failed (an error
status), streams with wrong tokens (against each prompt's uninterrupted answer: a
gap, a duplicate or a wrong token anywhere), streams that migrated, the time to
recover (from the kill to the first token of one-token probes sent one after another)
and the TTFT of the requests sent in the 10 s after the kill.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from deployments.ingress.client import InferenceClient
from deployments.proto import inference_pb2 as pb

PROMPTS = [[410 + i, 465, 14, 7 + i] for i in range(6)]
QOS = [pb.REALTIME, pb.NORMAL, pb.BACKGROUND]
MAX_TOKENS = 96
STREAMS = 6  # closed loop: each sends its next request when one ends
BEFORE_S, WINDOW_S = 3.0, 10.0

Connect = Callable[[], InferenceClient]


@dataclass
class Outcome:
    sent_at: float
    prompt: int
    code: grpc.StatusCode | None = None  # None: no answer at all (lost)
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    migrations: int = 0


@dataclass
class Row:
    component: str
    requests: int
    lost: int
    failed: int
    wrong: int
    recovery_s: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    migrated: int

    @classmethod
    def of(
        cls,
        component: str,
        outcomes: list[Outcome],
        reference: dict[int, list[int]],
        killed_at: float,
        recovered_at: float | None,
    ) -> Row:
        after = [o for o in outcomes if o.sent_at >= killed_at]
        ttfts = sorted(o.ttft_s * 1000 for o in after if o.ttft_s is not None)
        ok = [o for o in outcomes if o.code == grpc.StatusCode.OK]
        return cls(
            component,
            len(outcomes),
            lost=sum(o.code is None for o in outcomes),
            failed=sum(o.code not in (None, grpc.StatusCode.OK) for o in outcomes),
            wrong=sum(o.tokens != reference[o.prompt] for o in ok),
            recovery_s=None if recovered_at is None else recovered_at - killed_at,
            ttft_p50_ms=statistics.median(ttfts) if ttfts else None,
            ttft_p99_ms=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
            if ttfts
            else None,
            migrated=sum(o.migrations > 0 for o in ok),
        )

    def line(self) -> str:
        ttft = (
            f"{self.ttft_p50_ms:.0f} / {self.ttft_p99_ms:.0f} ms"
            if self.ttft_p50_ms is not None
            else "-"
        )
        rec = f"{self.recovery_s:.2f} s" if self.recovery_s is not None else "-"
        return (
            f"| {self.component} | {self.requests} | {self.lost} | {self.failed} | "
            f"{self.wrong} | {self.migrated} | {rec} | {ttft} |"
        )


def request(i: int, max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPTS[i]),
        sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
        qos=QOS[i % len(QOS)],
    )


def one(connect: Connect, i: int, max_tokens: int = MAX_TOKENS) -> Outcome:
    """Prompt ``i``'s greedy stream on a client of its own."""
    out = Outcome(time.monotonic(), i)
    client = connect()
    try:
        for msg in client.generate(request(i, max_tokens), timeout=120):
            if msg.HasField("chunk"):
                if out.ttft_s is None:
                    out.ttft_s = time.monotonic() - out.sent_at
                out.tokens += msg.chunk.token_ids
            elif msg.HasField("finished"):
                out.migrations = msg.finished.migrations
        out.code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        out.code = e.code() if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED else None
    finally:
        client.close()
    return out


def reference(connect: Connect) -> dict[int, list[int]]:
    """Each prompt's uninterrupted greedy tokens."""
    answers = {i: one(connect, i) for i in range(len(PROMPTS))}
    if not all(len(a.tokens) == MAX_TOKENS for a in answers.values()):
        raise RuntimeError(f"a reference answer fell short: {answers}")
    return {i: a.tokens for i, a in answers.items()}


def kill_under_load(
    component: str,
    connect: Connect,
    answers: dict[int, list[int]],
    kill: Callable[[], object],
) -> Row:
    """Runs the load for ``BEFORE_S``, calls ``kill``, probes until a token comes
    back, keeps the load on for ``WINDOW_S`` after the kill; what clients saw."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop = threading.Event()

    def loop(k: int) -> None:
        i = k
        while not stop.is_set():
            out = one(connect, i % len(PROMPTS))
            with lock:
                outcomes.append(out)
            i += STREAMS

    threads = [
        threading.Thread(target=loop, args=(k,), daemon=True) for k in range(STREAMS)
    ]
    for t in threads:
        t.start()
    time.sleep(BEFORE_S)
    kill()
    killed_at = time.monotonic()
    recovered_at: float | None = None
    while recovered_at is None and time.monotonic() - killed_at < 120:
        probe = one(connect, 0, max_tokens=1)
        if probe.code == grpc.StatusCode.OK and probe.ttft_s is not None:
            recovered_at = probe.sent_at + probe.ttft_s
    time.sleep(max(0.0, killed_at + WINDOW_S - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(150)
    return Row.of(component, outcomes, answers, killed_at, recovered_at)
