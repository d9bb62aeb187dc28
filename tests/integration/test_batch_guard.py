"""``engine.realtime_batch_mates``, ``engine.background_cpu_yield`` and
``engine.background_prefill_tokens`` on real engines: the session's engines let
one background request decode beside a realtime one (the setting is 1), an
engine with only background requests idles 80% of its time while the other
holds a realtime one, and a step computes at most 4 tokens of background
prompts (one whole prompt where vLLM does not chunk them: CPU_MLA).

While a realtime stream runs on a replica with two background streams, one of
those pauses (no tokens for about the realtime stream's length) and then goes
on, and the two on the other replica slow down; every stream ends with the
tokens of an uninterrupted greedy run. Background prompts computed under that
cap end with the greedy run's tokens too."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from cluster.tiny_model import greedy_chain, greedy_successors
from deployments.proto import inference_pb2 as pb
from tests.integration import streams
from tests.integration.conftest import ENGINE, Served

PROMPT = [11, 12, 13, 14, 15]
BACKGROUND_TOKENS = 800
REALTIME_TOKENS = 400


def _run(
    served: Served,
    rid: str,
    qos: int,
    max_tokens: int,
    out: streams.Stream,
    prompt: list[int] = PROMPT,
) -> None:
    request = pb.GenerateRequest(
        request_id=rid,
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
        qos=qos,  # type: ignore[arg-type]
    )
    for msg in served.client().generate(request, timeout=180):
        if msg.HasField("chunk"):
            out.tokens += msg.chunk.token_ids
            out.at.append(time.monotonic())
            out.ends.append(len(out.tokens))
        elif msg.HasField("finished"):
            out.finished = msg.finished


def test_background_pauses_beside_a_realtime_stream_and_loses_nothing(
    served: Served,
) -> None:
    assert ENGINE["realtime_batch_mates"] == 1
    assert ENGINE["background_cpu_yield"] == 0.8
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
    # Three chunks each (background ones come every 500 ms): their pace alone.
    while min(len(s.at) for s in bg.values()) < 3:
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
    # Three of the four went at under half their pace while it ran: the paused
    # one, and the two on the engine that idled for it.
    start, end = rt.at[0], rt.at[-1]
    assert end - start > 1.0  # room for background chunks (every 500 ms)
    paces = [(_pace(s, s.at[0], start), _pace(s, start, end)) for s in bg.values()]
    slowed = [p for p in paces if p[1] < 0.5 * p[0]]
    assert len(slowed) >= 3, paces


def _pace(s: streams.Stream, t0: float, t1: float) -> float:
    """Tokens/s a stream decoded in [t0, t1]: between its first and last chunk
    in there; with fewer than two chunks, what came over the whole span."""
    inside = [i for i, t in enumerate(s.at) if t0 <= t <= t1]
    if len(inside) < 2:
        came = sum(s.ends[i] - (s.ends[i - 1] if i else 0) for i in inside)
        return came / (t1 - t0)
    first, last = inside[0], inside[-1]
    return (s.ends[last] - s.ends[first]) / (s.at[last] - s.at[first])


def test_background_prompts_computed_a_few_tokens_a_step_lose_nothing(
    served: Served, tiny_model: Path
) -> None:
    # 4 tokens a step: each 60-token prompt takes 15 steps or more, beside the
    # others' (one prompt a step where vLLM does not chunk them). Each prompt is
    # its own, so no cached prefix shortens it.
    assert ENGINE["background_prefill_tokens"] == 4
    prompts = {f"cap-bg-{i}": [100 + i, *range(200, 259)] for i in range(4)}
    out = {rid: streams.Stream() for rid in prompts}
    threads = [
        threading.Thread(
            target=_run,
            args=(served, rid, pb.BACKGROUND, 8, out[rid], prompt),
            daemon=True,
        )
        for rid, prompt in prompts.items()
    ]
    for t in threads:
        t.start()
    streams.join(threads)
    expected = greedy_chain(greedy_successors(tiny_model), prompts["cap-bg-0"][-1], 8)
    for rid, s in out.items():
        assert s.tokens == expected, rid
        assert s.finished.prompt_tokens == 60, rid
        assert s.finished.cached_tokens == 0, rid
