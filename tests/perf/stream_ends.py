"""Where S1's streams end and the next ones begin, as the client sees them.

    .venv/bin/python -m tests.perf.stream_ends [moe|vllm-uni|...] [--concurrency 4]
        [--requests 240] [--server-args "..."] [--label L]

Starts one system as ``make bench-peers`` does (one replica, one core) and runs S1
closed loop over OpenAI HTTP, as bench-peers' load generator sends it (every
prompt new to the server), timing each request at the client on the wall clock:
when it was sent, its first and last token chunks, and when its answer ended
(``[DONE]`` read). Prints, p10 / p50 / p90:

- ``ttft``: sent to the first token chunk;
- ``last token -> end``: the last token chunk to the end of the answer: what a
  server spends between a stream's last token and telling the client it is
  over, which a closed-loop client waits for before its next request;
- ``set turnover``: S1's streams have one length, so at several streams they end
  in sets; from a set's last token chunk to the next token chunk of any
  request (the next set's first): the hops back to the server, its prefill
  and the first token's way out, while the engine may have nothing to do;
- ``set spread``: from a set's first last-chunk to its last;
- ``next set's first token``: from the first request sent after a set began to
  end to the first token of any request sent then (the next set's first
  token): the path in and out and a prefill, at the moment the server is
  winding the ended streams down;
- ``tpot``: a request's first token chunk to its last, per token after the
  first (the steps that prefill other requests' prompts count in it).

and the output tok/s of the run. Appends them to
``tests/perf/results/stream_ends.jsonl``. With ``OTEL_TRACES_SAMPLER=always_on``
and an OTLP endpoint in the environment, moe-cluster traces every request
(``tests.otlp_receiver``), on the same wall clock.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import shlex
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from deployments.bench.backends import Backend, Chunk
from deployments.bench.workload import RequestSpec
from tests.perf.compare_peers import PEERS, RESULTS, S1, Server, api

WARMUP = 16  # requests before the recorded ones, per run
SET_GAP_S = 0.015  # last chunks this close together end one set


@dataclass(frozen=True, slots=True)
class Timed:
    stream: int
    sent: float  # wall clock, s
    first: float
    last: float  # the last token chunk
    end: float  # the answer over


async def _one(backend: Backend, spec: RequestSpec, stream: int) -> Timed:
    sent = time.time()
    chunks: list[float] = []
    async for event in backend.stream(spec):
        if isinstance(event, Chunk):
            chunks.append(time.time())
    if not chunks:
        raise RuntimeError("a request ended without a token")
    return Timed(stream, sent, chunks[0], chunks[-1], time.time())


async def run(concurrency: int, n: int) -> list[Timed]:
    """``WARMUP`` then ``n`` requests closed loop; the recorded ones' times."""
    backend, prompts = api(False)
    specs = prompts(S1.requests())
    left = WARMUP + n
    done: list[Timed] = []

    async def stream(i: int) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            done.append(await _one(backend, next(specs), i))

    try:
        await asyncio.gather(*(stream(i) for i in range(concurrency)))
    finally:
        await backend.close()
    done.sort(key=lambda t: t.sent)
    return done[WARMUP:]


def sets(timed: list[Timed]) -> list[list[Timed]]:
    """Requests grouped by their last token chunks, ``SET_GAP_S`` apart or less."""
    by_last = sorted(timed, key=lambda t: t.last)
    out: list[list[Timed]] = [[by_last[0]]] if by_last else []
    for t in by_last[1:]:
        if t.last - out[-1][-1].last <= SET_GAP_S:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def turnovers(timed: list[Timed]) -> list[float]:
    """For each set but the last: its last token chunk to the next first chunk."""
    firsts = sorted(t.first for t in timed)
    out = []
    for group in sets(timed)[:-1]:
        last = max(t.last for t in group)
        i = bisect.bisect_right(firsts, last)
        if i < len(firsts):
            out.append(firsts[i] - last)
    return out


def next_set_first_tokens(timed: list[Timed]) -> list[float]:
    """For each set: from the first request sent after its first end to the
    first token of the requests sent from then on, as many as the set had."""
    by_sent = sorted(timed, key=lambda t: t.sent)
    sent = [t.sent for t in by_sent]
    out = []
    for group in sets(timed):
        i = bisect.bisect_left(sent, group[0].last)
        following = by_sent[i : i + len(group)]
        if len(following) == len(group):
            out.append(min(t.first for t in following) - following[0].sent)
    return out


def percentiles(seconds: list[float]) -> dict[str, float]:
    v = sorted(1e3 * s for s in seconds)
    if not v:
        return {}
    tenth = len(v) // 10
    return {"p10": v[tenth], "p50": v[len(v) // 2], "p90": v[len(v) - 1 - tenth]}


def summary(timed: list[Timed], tokens: int) -> dict[str, object]:
    groups = sets(timed)
    span = max(t.end for t in timed) - min(t.sent for t in timed)
    return {
        "requests": len(timed),
        "output_tok_s": len(timed) * tokens / span,
        "ttft": percentiles([t.first - t.sent for t in timed]),
        "last_token_to_end": percentiles([t.end - t.last for t in timed]),
        "set_turnover": percentiles(turnovers(timed)),
        "set_spread": percentiles([g[-1].last - g[0].last for g in groups]),
        "next_set_first_token": percentiles(next_set_first_tokens(timed)),
        "tpot": percentiles([(t.last - t.first) / (tokens - 1) for t in timed]),
        "set_sizes": sorted({len(g) for g in groups}),
        "sets": len(groups),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    keys = [peer.key for peer in PEERS]
    p.add_argument("system", nargs="?", choices=keys, default="moe")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--label", default="")
    p.add_argument("--server-args", default="", help="more arguments for its server")
    args = p.parse_args()
    peer = next(x for x in PEERS if x.key == args.system)
    peer = peer.with_args(shlex.split(args.server_args))
    logs = Path(tempfile.mkdtemp(prefix="stream-ends-"))
    server = Server(peer, 1, logs / "server.log")
    try:
        timed = asyncio.run(run(args.concurrency, args.requests))
    finally:
        server.stop()
    tokens = next(iter(S1.requests())).max_tokens
    out = {
        "system": args.system,
        "label": args.label,
        "server_args": args.server_args,
        "concurrency": args.concurrency,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **summary(timed, tokens),
    }
    print(f"{args.system}, {args.concurrency} streams: {out['output_tok_s']:.1f} tok/s")
    for key in (
        "ttft",
        "last_token_to_end",
        "set_turnover",
        "set_spread",
        "next_set_first_token",
        "tpot",
    ):
        q = out[key]
        assert isinstance(q, dict)
        cells = "  ".join(f"{k} {v:7.2f}" for k, v in q.items())
        print(f"  {key.replace('_', ' '):22s} {cells} ms")
    print(f"  sets: {out['sets']} of {out['set_sizes']} requests")
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / "stream_ends.jsonl").open("a") as f:
        f.write(json.dumps(out) + "\n")
    (logs / "timed.json").write_text(json.dumps([asdict(t) for t in timed]))
    print(f"  each request's times: {logs / 'timed.json'}")


if __name__ == "__main__":
    main()
