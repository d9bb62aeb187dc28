"""What moe-cluster's additions to vLLM's engine cost it, with the rest of the
cluster out of the way.

    .venv/bin/python -m tests.perf.engine_step [--variants bare,moe,...]
        [--batch 4] [--trials 12] [--prompt-tokens 128] [--core N] [--duty 0.3]
        [--label L]

Each variant is one vLLM engine run as an engine replica runs it: ``AsyncLLM``
in a process of its own (on the other cores), its engine core (the uni
executor, one OpenMP thread) spawned onto core ``--core`` (the node's last by
default), the same core for every variant. The variants take turns, one at a
time, in a new order each trial, so the machine's drifts in pace fall on every
variant alike: each runs ``--batch`` new requests at once (``--prompt-tokens``
prompt tokens, 128 by default, every prompt new; 64 output tokens). Per variant
it prints the median time between a request's tokens (the decode step) and its
mean, the median tokens/s of a whole trial, each as the median of its ratios to
the first variant's in the same trial (with their range), the engine core's CPU
per token and the time to first token; and it appends them, with every trial, to
``tests/perf/results/engine_step.jsonl``.

On the 2-core AMX Xeon the engine started first (the first variant listed) ran
4-6% slower than the others, whatever it was (HISTORY.md, "Prompts the store
lacks"): list a throwaway variant first, and the two sides of a comparison in
turn after it (ABBA).

Variants, ``BASE[-split][@TREE][+KIND]``:

- ``bare``: vLLM as the ``vllm-uni`` peer of ``make bench-peers`` runs it
  (first-come first-served, no KV connector, no worker extension).
- ``moe``: vLLM's arguments and environment exactly as an engine replica of
  ``cluster/configs/tiny-cpu.yaml`` builds them (``deployments.engine.args``),
  the expert-load hooks installed and read every 0.5 s as the replica reads
  them, the page store's connector saving to a node store served from this
  (controller) process on the other cores, as the store actor serves it, and
  (where the engine caches prefixes itself) its KV-cache events published.
- ``moe-no-store``, ``moe-no-expert-load``, ``moe-fcfs``, ``moe-no-thp``,
  ``moe-no-events``: ``moe`` less one of them (the page store; the expert-load
  hooks and their reads; the priority scheduling the router's QoS classes map
  to; torch's transparent huge pages; the KV-cache events).
- ``-split``: the engine core's threads but its main one moved off its core,
  as the ``reserved`` and ``pinned`` layouts place them.
- ``@TREE``: the engine core imports moe-cluster from the checkout at TREE
  (the code before a change, against the change); TREE needs this file.
- ``+KIND``: while the variant runs, a ``tests.perf.neighbour`` of that kind
  (``python``, ``stream``, ``spin``) works on another core ``--duty`` of the
  time, as the rest of a cluster does beside the engine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.perf import neighbour
from tests.perf.peers import ENGINE, ENV, MODEL_DIR, platform_kwargs

RESULTS = Path(__file__).parent / "results"
CONFIG = Path(__file__).resolve().parents[2] / "cluster/configs/tiny-cpu.yaml"
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 64
VARIANTS = (
    "bare",
    "moe",
    "moe-no-store",
    "moe-no-expert-load",
    "moe-fcfs",
    "moe-no-thp",
    "moe-no-events",
)
EXPERT_LOAD_POLL_S = 0.5  # the replica's read of the counters while busy


def _spec(variant: str, socket: str) -> tuple[dict[str, str], Any, bool]:
    """(environment, vLLM's arguments, whether to read the expert load) of
    ``variant``. Built here, not in the variant's process: building moe's
    arguments imports the page store's modules (numba among them), which vLLM's
    CPU worker must not find loaded when it starts (as in an engine replica,
    whose engine core imports them only when it builds the connector)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from cluster.config import load_config
    from deployments.engine.args import engine_args, engine_env

    config = load_config(CONFIG)
    backend = {"attention_backend": ENGINE["attention_backend"]}
    config = config.model_copy(
        update={"engine": config.engine.model_copy(update=backend)}
    ).resolved()
    moe = variant.startswith("moe")
    e = config.engine
    if variant == "moe-no-expert-load":
        e = e.model_copy(update={"measure_expert_load": False})
    env = dict(ENV) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if not moe:
        p = platform_kwargs()
        args = AsyncEngineArgs(
            model=str(MODEL_DIR.resolve()),
            served_model_name=[config.model.served_name],
            attention_backend=str(p["attention_backend"]),
            dtype=str(p["dtype"]),
            block_size=int(str(p["block_size"])),
            max_model_len=int(ENGINE["max_model_len"]),
            kv_cache_memory_bytes=int(ENGINE["kv_cache_memory_bytes"]),
            max_num_seqs=int(ENGINE["max_num_seqs"]),
            enforce_eager=True,
            distributed_executor_backend="uni",
            disable_log_stats=False,
        )
        return env, args, False
    env |= engine_env(e)
    if variant == "moe-no-thp":
        env.pop("THP_MEM_ALLOC_ENABLE", None)
    # The KV-cache events an engine replica subscribes to (where the engine
    # caches prefixes itself): published here to no one, as vLLM's publisher
    # drops what no subscriber takes; the engine core's work is the same.
    events = f"ipc://{Path(socket).parent}/events-{variant}-{os.getpid()}"
    args = engine_args(
        config.model.path,
        config.model.served_name,
        e,
        kv_events_endpoint=None if variant == "moe-no-events" else events,
        kv_store_socket=None if variant == "moe-no-store" else socket,
    )
    if variant == "moe-fcfs":
        args.scheduling_policy = "fcfs"
    return env, args, e.measures_expert_load


def _worker(
    variant: str,
    env: dict[str, str],
    args: Any,
    polls: bool,
    split: bool,
    tree: str,
    core: int,
    prompt_tokens: int,
    conn: Any,
) -> None:
    """One variant's engine, run as an engine replica runs it: ``AsyncLLM`` here
    (on the other cores), its engine core in a process of its own on ``core``."""
    import asyncio

    import psutil

    os.environ.update(env)
    if tree:  # the engine core (spawned: this path) imports moe-cluster from there
        sys.path.insert(0, str(Path(tree).resolve()))
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    others = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})  # the engine core, spawned now, stays there
    engine = AsyncLLM.from_engine_args(args)
    os.sched_setaffinity(0, others)
    me = psutil.Process()
    cores = [c for c in me.children() if "EngineCore" in " ".join(c.cmdline())]
    if split:  # as an engine replica lays it out: the main thread alone on core
        from cluster.cpu_layout import _move_threads

        for c in cores:
            _move_threads(c.pid, others, keep={c.pid})
    params = SamplingParams(
        max_tokens=OUTPUT_TOKENS,
        ignore_eos=True,
        temperature=0.0,
        output_kind=RequestOutputKind.DELTA,
    )
    rng = random.Random()
    n = 0

    def engine_cpu() -> float:
        return sum(sum(c.cpu_times()[:2]) for c in cores)

    async def one(rid: str, gaps: list[float], firsts: list[float]) -> int:
        ids = [rng.randrange(4, 1000) for _ in range(prompt_tokens)]
        last = None
        sent = time.perf_counter()
        tokens = 0
        async for out in engine.generate({"prompt_token_ids": ids}, params, rid):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            else:
                firsts.append(now - sent)
            last = now
            tokens += len(out.outputs[0].token_ids)
        return tokens

    async def reads(done: asyncio.Event) -> None:
        while not done.is_set():  # the replica reads the counters while busy
            await asyncio.sleep(EXPERT_LOAD_POLL_S)
            await engine.collective_rpc("moe_expert_load_take")

    async def trial(batch: int) -> dict[str, float]:
        nonlocal n
        gaps: list[float] = []
        firsts: list[float] = []
        done = asyncio.Event()
        poller = asyncio.create_task(reads(done)) if polls else None
        cpu0, started = engine_cpu(), time.perf_counter()
        rids = [f"{variant}-{n + i}" for i in range(batch)]
        n += batch
        tokens = sum(await asyncio.gather(*(one(r, gaps, firsts) for r in rids)))
        wall = time.perf_counter() - started
        cpu = engine_cpu() - cpu0
        done.set()
        if poller is not None:
            await poller
        return {
            "step_ms": 1000 * statistics.median(gaps),
            "step_mean_ms": 1000 * statistics.fmean(gaps),
            "ttft_ms": 1000 * statistics.median(firsts),
            "tok_s": tokens / wall,
            "cpu_ms_per_token": 1000 * cpu / max(tokens, 1),
        }

    async def serve() -> None:
        if polls:
            await engine.collective_rpc("moe_expert_load_install")
        await trial(1)  # warm
        conn.send("ready")
        loop = asyncio.get_running_loop()
        while (msg := await loop.run_in_executor(None, conn.recv)) is not None:
            conn.send(await trial(int(msg)))

    try:
        asyncio.run(serve())
    finally:
        engine.shutdown()


def _base(variant: str) -> str:
    """``BASE[-split][@TREE][+KIND]`` -> ``BASE``."""
    return variant.partition("+")[0].partition("@")[0].removesuffix("-split")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    p.add_argument("--label", default="", help="names the row in the results")
    p.add_argument("--duty", type=float, default=0.3, help="+KIND neighbours' duty")
    p.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)))
    args = p.parse_args()
    variants = args.variants.split(",")
    unknown = {_base(v) for v in variants} - set(VARIANTS)
    unknown |= {v.partition("+")[2] for v in variants} - {"", *neighbour.KINDS}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    # The node store, served here on the other cores, as the store actor does.
    from tests.kvstore.test_rpc import Running

    socket = str(Path(tempfile.mkdtemp(prefix="engine-step-")) / "store.sock")
    others = set(os.sched_getaffinity(0)) - {args.core} or {args.core}
    os.sched_setaffinity(0, others)
    store = Running(socket, capacity_bytes=512 << 20, sync_interval_s=0.5)
    ctx = mp.get_context("spawn")
    # Neighbours on another core, stopped except while a "+KIND" variant runs.
    kinds = {v.partition("+")[2] for v in variants} - {""}
    neighbours = {k: neighbour.start(k, args.duty, min(others)) for k in kinds}
    for proc in neighbours.values():
        proc.send_signal(signal.SIGSTOP)
    engines = {}
    for v in dict.fromkeys(x.partition("+")[0] for x in variants):
        mine, theirs = ctx.Pipe()
        env, engine_args, polls = _spec(_base(v), socket)
        engine, _, tree = v.partition("@")
        split = engine.endswith("-split")
        proc = ctx.Process(
            target=_worker,
            args=(
                v,
                env,
                engine_args,
                polls,
                split,
                tree,
                args.core,
                args.prompt_tokens,
                theirs,
            ),
        )
        proc.start()
        theirs.close()  # a variant that fails to start: EOFError, not a hang
        assert mine.recv() == "ready", v  # one at a time: each starts alone
        engines[v] = (proc, mine)
        print(f"{v}: ready", flush=True)
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    try:
        for t in range(args.trials):
            order = variants[t % len(variants) :] + variants[: t % len(variants)]
            for v in order:
                engine, _, kind = v.partition("+")
                conn = engines[engine][1]
                if kind:
                    neighbours[kind].send_signal(signal.SIGCONT)
                conn.send(args.batch)
                results[v].append(conn.recv())
                if kind:
                    neighbours[kind].send_signal(signal.SIGSTOP)
            line = "  ".join(
                f"{v} {results[v][-1]['step_ms']:.2f}ms {results[v][-1]['tok_s']:.0f}"
                for v in variants
            )
            print(f"trial {t + 1}: {line}", flush=True)
    finally:
        for _, conn in engines.values():
            conn.send(None)
        for proc, _ in engines.values():
            proc.join(60)
        for proc in neighbours.values():
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        store.stop()
    base = variants[0]
    print(f"\nbatch {args.batch}, {args.trials} trials; ratios to {base}, same trial")
    print(f"{'variant':22s} {'decode step':>12s} {'ratio (range)':>22s} "
          f"{'tok/s':>7s} {'ratio':>6s} {'CPU ms/token':>13s} "
          f"{'mean step':>10s} {'TTFT':>8s}")  # fmt: skip
    summary: dict[str, dict[str, float]] = {}
    for v in variants:
        rs = results[v]
        steps = [r["step_ms"] for r in rs]
        ratios = [
            r["step_ms"] / b["step_ms"] for r, b in zip(rs, results[base], strict=True)
        ]
        tok = [r["tok_s"] / b["tok_s"] for r, b in zip(rs, results[base], strict=True)]
        print(
            f"{v:22s} {statistics.median(steps):9.2f} ms "
            f"{statistics.median(ratios):8.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
            f" {statistics.median(r['tok_s'] for r in rs):7.1f}"
            f" {statistics.median(tok):6.3f}"
            f" {statistics.median(r['cpu_ms_per_token'] for r in rs):13.3f}"
            f" {statistics.median(r['step_mean_ms'] for r in rs):7.2f} ms"
            f" {statistics.median(r['ttft_ms'] for r in rs):5.1f} ms"
        )
        summary[v] = {
            "step_ms": statistics.median(steps),
            "step_ratio": statistics.median(ratios),
            "tok_s": statistics.median(r["tok_s"] for r in rs),
            "tok_s_ratio": statistics.median(tok),
            "cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in rs),
            "step_mean_ms": statistics.median(r["step_mean_ms"] for r in rs),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in rs),
        }
    from tests.perf.compare_peers import machine

    row = {"label": args.label, "machine": machine(), "args": vars(args)}
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / "engine_step.jsonl").open("a") as log:
        log.write(json.dumps(row | {"summary": summary, "trials": results}) + "\n")


if __name__ == "__main__":
    main()
