"""``engine.realtime_batch_mates`` on real engines: the session's engines let one
background request decode beside a realtime one (the setting is 1). While a
realtime stream runs on a replica with two background streams, one of those
pauses (no tokens for about the realtime stream's length) and then goes on;
every stream ends with the tokens of an uninterrupted greedy run."""

from __future__ import annotations

import threading
import time

from deployments.proto import inference_pb2 as pb
from tests.integration import streams
from tests.integration.conftest import ENGINE, Served

PROMPT = [11, 12, 13, 14, 15]
BACKGROUND_TOKENS = 600
REALTIME_TOKENS = 300


def _run(
    served: Served, rid: str, qos: int, max_tokens: int, out: streams.Stream
) -> None:
    request = pb.GenerateRequest(
        request_id=rid,
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
        qos=qos,  # type: ignore[arg-type]
    )
    for msg in served.client().generate(request, timeout=180):
        if msg.HasField("chunk"):
            out.tokens += msg.chunk.token_ids
            out.at.append(time.monotonic())
        elif msg.HasField("finished"):
            out.finished = msg.finished


def test_background_pauses_beside_a_realtime_stream_and_loses_nothing(
    served: Served,
) -> None:
    assert ENGINE["realtime_batch_mates"] == 1
    # Four background streams: least-loaded placement puts two on each replica.
    bg = {f"guard-bg-{i}": streams.Stream() for i in range(4)}
    threads = [
        threading.Thread(
            target=_run,
            args=(served, rid, pb.BACKGROUND, BACKGROUND_TOKENS, out),
            daemon=True,
        )
        for rid, out in bg.items()
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 90
    while min(len(s.tokens) for s in bg.values()) < 20:
        assert time.monotonic() < deadline, "the background streams never got going"
        time.sleep(0.05)
    rt = streams.Stream()
    _run(served, "guard-rt", pb.REALTIME, REALTIME_TOKENS, rt)
    streams.join(threads)
    assert rt.finished.completion_tokens == REALTIME_TOKENS
    assert all(s.finished.completion_tokens == BACKGROUND_TOKENS for s in bg.values())
    # Greedy: every stream the same tokens, the realtime one a prefix of them.
    first = next(iter(bg.values())).tokens
    assert all(s.tokens == first for s in bg.values())
    assert rt.tokens == first[:REALTIME_TOKENS]
    # A background stream beside it paused for most of its life.
    realtime_s = rt.at[-1] - rt.at[0]
    during = [
        max(s.gaps())
        for s in bg.values()
        if s.at[0] < rt.at[0] and s.at[-1] > rt.at[-1]  # it ran across
    ]
    assert during, "no background stream outlived the realtime one"
    assert max(during) >= 0.5 * realtime_s, (max(during), realtime_s)
